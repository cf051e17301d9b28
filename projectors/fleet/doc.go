// Package fleet is the liveness projector: it projects the FLEET_NODES
// stream (what the fleet gateways publish about GPU nodes: connected,
// disconnected, status changed, allocation reports, and batches of
// heartbeat ages) into fleet_nodes, fleet_devices, fleet_allocation_reports
// and fleet_clock, and ages nodes healthy -> suspect -> unreachable as they
// go unheard. It is a projection.Projector, Sweeper and Resetter; it has no
// goroutines and does not know NATS. README.md explains the states, the
// thresholds and the clock guard; this comment, how the code keeps its
// promises.
//
// # Identity
//
// A node is (pool, node id), as in its certificate and subject: the fold's
// maps, the loads and every statement key nodes, devices and reports by
// the pair, so that nodes of the same id in two pools never meet. Reports
// are keyed by allocation and reporting node; readers count only the
// placed node's. The count of foreign reports (Stats.ForeignReports) reads
// fleet_allocations, another stream's table, but only to count: the rows
// written do not depend on it, so replay order does not matter.
//
// # Times
//
// Every time comes from the stream: a message's stored time (JetStream's
// clock), and for a liveness entry that time less the entry's age. The
// gateway's own `at` is never read, nor the wall clock in Apply. Times are
// cut to microseconds on the way in, so that Go and SQL compare them alike.
//
// # Replay yields the same rows
//
// A batch is folded in memory one message after the other, over what the
// database held before it, so the rows do not depend on batch boundaries.
// Aging is the harder part: the runner sweeps at wall-clock moments a
// replay does not reproduce. Three rules make that not matter:
//
//   - a sweep's transitions are stamped from last_seen (state_since =
//     last_seen + the threshold crossed), never from the sweep's time, and
//     sweeps compose: one at a later horizon does all an earlier one did;
//   - before any news of a node (a liveness entry or connected event that
//     moves last_seen), the fold first ages the node to the latest horizon
//     any sweep could have had by then, min(stored time, clock +
//     ClockSlack), so a node that was (or could have been) swept suspect
//     comes back healthy since the moment it was heard, sweep or no sweep;
//   - Apply sweeps every node itself whenever the liveness clock crosses a
//     multiple of SweepTick, and, when the clock resumes after a silence, to
//     the horizon sweeps in that silence could have reached (splitting the
//     batch there, since nodes age differently afterwards).
//
// So a live run and a replay agree once both have been swept to the same
// final horizon (a replay's closing Sweep does that). The exception is a
// runner sweep that happens while a message stored before it is still
// unapplied; the runner sweeps only after an empty fetch, so that window is
// milliseconds wide.
//
// # Rev
//
// Every change to a node row or its devices takes a new fleet_nodes.rev
// from the fleet_rev sequence, except a move of last_seen alone (the
// heartbeat, which the placer does not need to reload). One process applies
// at a time (the runner's lock), so revs grow in commit order. Reset does
// not restart the sequence: a replayed row takes a rev above any a reader
// has seen. Digest leaves rev out.
//
// # Cost
//
// Per batch: one round trip reads the clock row and the stored state of
// the nodes the fold needs (those named by a node event or more than once);
// one pipeline writes. A node named once, in a liveness entry (nearly every
// node of a live batch), is not read: its entry goes to one UPDATE over
// unnest() arrays that applies the fold's rule in SQL, touching only
// unindexed columns unless the state changes, so PostgreSQL updates it in
// place (HOT). README.md has the measured figures.
package fleet
