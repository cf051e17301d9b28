// Package replay is a Build Event Service client that replays recorded Bazel
// builds (loadtest/besrecord) against a BES server as many concurrent
// invocations, for load tests.
//
// Each replayed invocation behaves on the wire as Bazel 4 does: the
// lifecycle events BuildEnqueued and InvocationAttemptStarted, each a unary
// PublishLifecycleEvent; then one PublishBuildToolEventStream per
// invocation that sends every event without waiting for acks, half-closes,
// and takes one ack per event, in order, checking each ack's stream id and
// sequence number; then InvocationAttemptFinished and BuildFinished. Every
// replay gets fresh build and invocation ids (the stream ids are rewritten;
// the Build Event Protocol bytes inside keep the recorded ones, as the
// server keys on the stream id) and may be filed under another project id.
// Requests are encoded once per recording and patched with the new ids per
// replay, so the client spends its CPU on gRPC rather than on protobuf.
//
// Like Bazel, the client reads acks concurrently with sending (Bazel's gRPC
// observer does), so the server's ack stream never stalls on flow control,
// and it retries as Bazel does (Config.Retries): a failed stream is resumed
// on a new stream from its first unacknowledged event, a failed lifecycle
// call sent again, after 1 s × 1.6^n; INVALID_ARGUMENT and
// FAILED_PRECONDITION, a wrong ack and an early close are not retried.
// What the retries did not get past is counted as an error, and the worker
// goes on with its next invocation.
//
// Two modes: flat out (Config.Rate 0), where each of Config.Streams workers
// replays invocations back to back, and paced, where Config.Rate events per
// second are spread over the workers, each at its own rate. The ack latency
// of an event is the time its ack arrived minus the time it was handed to
// gRPC.
package replay
