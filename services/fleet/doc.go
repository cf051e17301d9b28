// Package fleet is the fleet gateway: GPU nodes hold one long gRPC session
// with a gateway (service millrace.fleet.v1.Gateway), and the gateway
// publishes what matters to JetStream (FLEET_NODES) and delivers placement
// decisions (FLEET_PLACE) to the nodes it holds. Many gateways run at once,
// each with its own id; they share nothing but JetStream, and a node may use
// any of them.
//
// # Authentication
//
// Every call is TLS. A session needs a client certificate signed by the
// fleet CA whose CommonName is the node id and whose single
// OrganizationalUnit is the pool; the Hello must name the same node and
// pool. A node without a certificate calls Join with its pool's join token
// and a PEM certificate request (NewNodeCSR) and receives a certificate
// valid Config.NodeCertValidity (30 days); it must Join again before the
// certificate expires. The listener requests client certificates without
// requiring them (Join needs none) and the gateway verifies them per call,
// so a bad certificate gets a Refusal that says what is wrong.
//
// # Protocol
//
// A node opens Session and sends Hello first (within HelloTimeout): its
// inventory (labels, GPUs), agent version, and the allocations it holds
// bound right now. The gateway answers Welcome (gateway id, a fresh session
// id, the heartbeat interval) once the node's Connected event is stored, or
// a Refusal followed by the end of the stream. Then the node sends a
// Heartbeat every heartbeat interval (each is acked), a StatusReport when
// it likes (acked; published only when its GPUs' health or conditions
// change, never for gauges), and an AllocationReport for every Command.
// A session that sends nothing for HeartbeatTimeout (3 intervals) is closed.
//
// A node must:
//
//   - after a Refusal (or a status whose details carry google.rpc.RetryInfo,
//     see RetryAfter), wait at least retry_after before dialling any
//     gateway again; the gateway jitters it so that a reconnect storm
//     spreads out. After "draining" it re-homes to another gateway at once
//     (retry_after is 0-2 s);
//   - after any other end of its session, open a new one (to any gateway)
//     with backoff, and list in its Hello every allocation it holds bound,
//     so that the gateway resends only the binds it has not yet carried out;
//   - treat Commands idempotently: a Bind for an allocation already bound
//     answers BOUND again, an Unbind for one it does not hold answers
//     UNBOUND. The same bind can arrive twice (from two gateways' pending
//     lists, or after a re-home) and reports are deduplicated by
//     <pool>/<node>/alloc/<allocation>/<state>;
//   - keep one session at a time: a newer session for the same node
//     replaces the older (which gets Refusal "replaced");
//   - report only on allocations placed on it (a report on one placed on
//     another node ends the session "foreign_allocation"), at most
//     ReportRate reports a second (beyond the burst: "report_rate"), and
//     hold at most MaxHeldAllocations ("allocations_full"; a Hello listing
//     more is "invalid").
//
// # Per-session bounds
//
// Besides those limits, a session's events take at most SessionQueueShare
// places in the gateway's one publish queue: a node that floods waits for
// its own events to be stored, and others' (and every new session's
// Connected) keep their room. README.md ("Reports") has the details and
// the measured effect.
//
// # What is published
//
// On fleet.node.<pool>.<node> (kind node): Connected when a session opens
// (stored before Welcome, so the projection never misses a connect) and
// again every ResyncEvery (jittered per session) with the allocations held
// now, so that the 7-day stream always holds every live node's inventory;
// StatusChanged when the status hash changes; every AllocationReport; and
// Disconnected when the session ends, with reason closed,
// heartbeat_timeout, replaced, draining or error. Disconnects are
// published on every end, including a graceful drain: they name their
// session, and a projector ignores events of a session that is not the
// node's current one, so a disconnect stored after the node's new session
// on another gateway is harmless. A node's events are stored in the order
// they happened on one gateway (one FIFO publishing queue); a replaced
// session's disconnect is stored before its successor's connect when both
// are on the same gateway.
//
// On fleet.node.<pool> (kind liveness): every FlushInterval, one
// LivenessBatch per pool with the nodes heard from since the last flush
// and their ages at observed_at (chunked at 10,000 nodes). Heartbeats are
// never published one by one.
//
// Nats-Msg-Ids make republishing a no-op: "<session_id>/<n>" for a
// session's events (session ids carry a per-process nonce),
// "<pool>/<node>/alloc/<allocation>/<state>" for allocation reports,
// "<gateway>-<nonce>/live/<flush>/<pool>/<chunk>" for liveness batches.
//
// # Binds
//
// Every gateway reads all of FLEET_PLACE with an ordered consumer starting
// BindWindow ago and keeps each Placed decision's binds for BindWindow
// after it was stored. A bind for a node connected here is sent at once
// (unless the node holds it); for another node it waits in case the node
// connects here within the window. Released sends Unbind to a node here
// that holds or was sent the allocation, and drops the pending bind.
//
// # Admission and shutdown
//
// MaxSessions, a token bucket on new sessions and Joins, and a bound on
// Hellos in flight keep a reconnect storm from toppling a gateway; each
// refusal is a Refusal message followed by RESOURCE_EXHAUSTED (UNAVAILABLE
// for "draining" and "unavailable") with RetryInfo. Drain refuses new
// sessions, publishes the last liveness batches, sends every session
// "draining", and waits for their disconnects to be stored.
//
// # Memory
//
// A session costs gRPC's three goroutines per connection (reader, writer,
// keepalive) and two of ours: the gRPC handler, which only waits for the
// session to close and then ends the stream, and a receiver, which spends
// its life in Recv. Work that needs a deep stack runs on goroutines that
// end with it (the handshake; each batch of Sends; decoding and handling a
// status or allocation report), because the runtime keeps a goroutine's
// stack at the largest size it needed until it uses less than a quarter of
// it: this keeps both long-lived goroutines at 4 KiB. ServerOptions turns
// off the per-connection read buffer and the request header table. Measured
// by BenchmarkSessions (TLS 1.3, a typical eight-GPU Hello, one heartbeat
// and one status report per session): about 51 KB of heap and stacks and
// 54 KB of resident memory per session, 790 MiB for 15,000 sessions.
package fleet
