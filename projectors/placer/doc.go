// Package placer places GPU reservations: it projects FLEET_RESV (the
// reservations API's requests and cancellations) into fleet_reservations
// and decides where each reservation runs, writing the bookings and the
// placement decisions in one PostgreSQL transaction; a relay
// (streams.Outbox) publishes the decisions to FLEET_PLACE from the outbox
// table. It has no goroutines and does not know NATS.
//
// # Plan optimistically, commit serially
//
// As Nomad's plan-apply: the planner works against an in-memory index of
// the fleet (healthy, connected nodes; their healthy GPUs; the bookings),
// built from fleet_nodes, fleet_devices and fleet_bookings and refreshed
// incrementally by fleet_nodes.rev, and plans a whole batch at once. The
// commit then re-checks under locks and guards: reservations still open
// (row lock), nodes still healthy and unchanged (FOR SHARE), and every
// booking, placement and allocation an INSERT ... ON CONFLICT DO NOTHING,
// so no GPU can be booked twice and no reservation placed twice whatever
// the index believed. A plan that does not insert whole is undone and
// planned again (partial commit). The index and queue changed during a
// transaction are kept when the runner reports it committed
// (projection.Committer) and reloaded when it aborted.
//
// # Three projectors, one way to rows
//
// Placer is the live projector. Decisions (FLEET_PLACE) and Requests
// (FLEET_RESV) exist for replay: ApplyDecisions is the only code that
// turns a decision into rows, used by the live placer before it publishes
// and by Decisions when it replays, and record the only code that turns
// reservation events into fleet_reservations rows, so that a replay yields
// the live run's rows (Digest compares them).
//
// # Node identity
//
// Nodes are (pool, node id) everywhere (nodeKey): the index's node map,
// bookings, the lookups of allocations on unreachable nodes, the rows the
// commit guards lock, and the reports that count (those of the allocation's
// own pool and node; see README.md "Node identity").
//
// # Ids
//
// A placement's decision id is <reservation>/place/<n>, where n counts
// the reservation's placements (a reservation released to be placed again
// gets n+1); its allocations are <reservation>/<n>/<i>.<128 random bits in
// hex> (allocationID: a sibling's id says nothing of another's). The release of
// placement n is <reservation>/release/<n>, the end of a reservation
// cancelled while pending <reservation>/cancel, a failure
// <reservation>/fail. A decision id is the Nats-Msg-Id of its message, so a
// relay that publishes twice stores once.
//
// See README.md for the policies (best fit, repair, bind and pending
// timeouts) and their costs.
package placer
