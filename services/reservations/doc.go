// Package reservations is the users' edge of the GPU fleet: it serves the
// millrace.fleet.v1.Reservations API (Create, Get, List, Cancel) over gRPC
// and the same calls as JSON over HTTP under /v1/reservations.
//
// Like every edge it validates, publishes and acknowledges: Create and
// Cancel publish a ReservationEvent to fleet.resv.<pool> (stream
// FLEET_RESV) and answer only once JetStream stored it. The placer and the
// fleet projectors take it from there; this package reads what they wrote
// (the fleet_reservation_status view, fleet_allocations and
// fleet_allocation_reports) with its own SQL and never imports them.
//
// # Identity
//
// Every call carries an API key ("authorization: Bearer KEY" or
// "x-millrace-api-key: KEY", in gRPC metadata or as HTTP headers). A key
// belongs to one owner, and may be limited to pools (ParseKeys). An owner
// sees and cancels only its own reservations: another owner's id is
// NOT_FOUND, exactly like an id that does not exist.
//
// # Ids and retries
//
// With request_id, the reservation id is "r-" and 26 base32hex characters
// of SHA-256(owner, request_id): a retried Create names the same
// reservation, its event carries the same Nats-Msg-Id ("<id>/requested", a
// no-op inside the stream's duplicate window), and once the projector has
// the reservation a retry returns it without publishing at all. The same
// request_id with a different spec is ALREADY_EXISTS, before projection
// too: the ack of a duplicate publish names the sequence of the event
// stored first, which Create reads back and compares. Without request_id
// the id is random (a uuid v7 in the same encoding, so ids sort by time),
// and a Create retried after an UNAVAILABLE may create a second
// reservation.
//
// # Waiting
//
// A Create with wait holds the call until the reservation is decided (the
// placer placed it or gave up: any state but PENDING) or wait passes, and
// returns the reservation as it is then. One core NATS subscription per
// Server on fleet.place.> wakes waiters by reservation id; the waiter is
// registered before the request is published, and the database is read
// once more after registering, every RecheckInterval and at the end, so a
// decision the subscription did not see still ends the wait. A wait ends
// 250 ms before the client's own deadline, and at once when the Server is
// closed; either way the call returns the reservation, not an error.
//
// # States
//
// State and timestamps come from the fleet_reservation_status view:
// PENDING (not placed, or requeued after a release), PLACED (GPUs booked,
// not every node confirmed the bind), ACTIVE (every allocation bound),
// CANCELLED, FAILED (reason says why). Allocations are those the
// reservation holds now; released ones are left out.
package reservations
