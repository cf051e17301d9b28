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
