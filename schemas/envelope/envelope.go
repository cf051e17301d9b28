// Package envelope names the headers that millrace puts on every message it
// publishes to JetStream, and the schema versions of message bodies. Outside
// consumers rely on these names (docs/subjects.md); they change only with a
// new schema version.
package envelope

// Header names. Nats-Msg-Id is JetStream's own deduplication header.
const (
	// MsgID makes a resend of the same event a no-op inside the stream's
	// duplicate window.
	MsgID = "Nats-Msg-Id"
	// Schema names the body's schema and version, for example "bes.v1".
	Schema = "Millrace-Schema"
	// Kind says which of a schema's message kinds the body holds.
	Kind = "Millrace-Kind"
	// Project is the (authenticated) project the event belongs to.
	Project = "Millrace-Project"
	// BuildID and InvocationID are the BES stream identifiers.
	BuildID      = "Millrace-Build-Id"
	InvocationID = "Millrace-Invocation-Id"
	// Sequence is the event's sequence number within its BES stream.
	Sequence = "Millrace-Sequence"
	// Reason, on a dead-lettered message, says why it could not be applied;
	// Origin names the stream sequence it came from.
	Reason   = "Millrace-Dead-Reason"
	Consumer = "Millrace-Dead-Consumer"
	Origin   = "Millrace-Dead-Origin"
)

// BES schema: the body is a google.devtools.build.v1.OrderedBuildEvent in
// protobuf binary encoding, exactly as the client sent it (stream id,
// sequence number, event time and the event, whose bazel_event Any holds the
// client's build_event_stream.BuildEvent bytes untouched).
const (
	SchemaBESv1 = "bes.v1"

	// KindTool marks an event of a PublishBuildToolEventStream stream.
	KindTool = "tool"
	// KindLifecycle marks a PublishLifecycleEvent (build enqueued/finished,
	// invocation attempt started/finished).
	KindLifecycle = "lifecycle"
)

// Fleet schema: bodies are millrace.fleet.v1 messages (schemas/fleet) in
// protobuf binary encoding; Millrace-Kind says which.
const (
	SchemaFleetV1 = "fleet.v1"

	// KindNode marks a NodeEvent on fleet.node.<pool>.<node>.
	KindNode = "node"
	// KindLiveness marks a LivenessBatch on fleet.node.<pool>.
	KindLiveness = "liveness"
	// KindReservation marks a ReservationEvent on fleet.resv.<pool>.
	KindReservation = "reservation"
	// KindDecision marks a PlacementDecision on fleet.place.<pool>.
	KindDecision = "decision"
)

// Fleet headers.
const (
	// Pool and Node name the pool and node a fleet message is about
	// (decoded, as the ids were given).
	Pool = "Millrace-Pool"
	Node = "Millrace-Node"
	// Gateway names the gateway instance that published a node message.
	Gateway = "Millrace-Gateway"
	// Reservation names the reservation of a reservation event or decision.
	Reservation = "Millrace-Reservation"
)

// Commit log schema: a COMMITS message's body is the document's bytes
// exactly as put (empty for a tombstone); Millrace-Kind says which. The
// world and document are in the subject (commits.<world>.<doc>, encoded),
// never in headers: ids are any UTF-8.
const (
	SchemaCommitsV1 = "commits.v1"

	// KindPut marks a document version.
	KindPut = "put"
	// KindDelete marks a tombstone.
	KindDelete = "delete"
)
