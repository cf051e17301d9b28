// Package bes is the Build Event Service edge: it serves Bazel's
// google.devtools.build.v1.PublishBuildEvent API, checks each request,
// publishes every event to JetStream on bes.<project>.<invocation> and
// acknowledges an event to the client only once JetStream has stored it.
//
// Acks are pipelined: the receiving side publishes each event asynchronously
// and queues its future; a second goroutine waits for the futures in order
// and sends the acks, so a stream costs no round trip per event and the
// acks still arrive in sequence order, as Bazel requires.
//
// Bazel retries a stream on any status but INVALID_ARGUMENT and
// FAILED_PRECONDITION, resending from the first unacknowledged event, so the
// edge answers UNAVAILABLE for anything transient (the backbone is away)
// and INVALID_ARGUMENT only for input that would fail again. A resend is a
// no-op thanks to each event's Nats-Msg-Id (<project>/<invocation>/<sequence>).
package bes
