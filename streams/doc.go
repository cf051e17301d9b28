// Package streams owns millrace's backbone on NATS JetStream: the stream and
// consumer specs (applied idempotently at start; the stream and subject
// names they use are in package subjects), the embedded server used when no
// external NATS is configured, the asynchronous deduplicating publisher the
// edges use, the one consumer loop every projector runs under (fetch a
// batch, apply it in a PostgreSQL transaction that also records the
// consumer position, commit, then ack), the outbox relay, the export
// runner, and the raw JetStream API requests the client lacks
// (DeleteMsgs).
//
// # What each consumer never does
//
// Every consumer of a stream keeps one invariant: it never acknowledges,
// and never records as its position, a message whose effect is not durable
// where that consumer's position lives. Each states it in its own terms,
// and a test pins each failure path that could break it.
//
// Runner (projections; position in PostgreSQL, consumer_positions): the
// position moves only in the transaction that applied every message at or
// below it, or parked it in the DEAD stream; AckAll is sent only after
// that commit. Any failure inside a batch (a dead letter that cannot be
// stored, a projector naming a sequence not in its batch, an isolation
// that fails) re-points the durable consumer at the committed position,
// or gives up the lead when it cannot, so the next delivery is the first
// unapplied message. A lost connection during isolation gives up the lead.
// Pinned by TestRunnerNeverMovesPastAFailedDeadLetter (DEAD deleted, DEAD
// full), TestRunnerForeignPoisonLosesNothing,
// TestRunnerIsolationSurvivesPostgresRestart,
// TestRunnerCommittedButUnackedIsNotAppliedTwice and TestRunnerGuards.
//
// Outbox (rows in PostgreSQL, published to JetStream): a row is deleted
// only after JetStream stored it, and stored at most once. A message
// published again inside the duplicate window is dropped by its msg id;
// after the window, the relay finds the row that is the stream's last
// message and skips it and every row of that stream before it. Pinned by
// TestOutboxCrashBetweenPublishAndDelete,
// TestOutboxResumesAfterTheDuplicateWindow, TestOutboxFailsMidwayThenRecovers
// and TestOutboxBackboneRestarts.
//
// ExportRunner (Kafka; position is the consumer's ack floor): a message is
// acknowledged only when it and every message before it were acknowledged
// by the other system; a failed record ends the session and the next one
// starts from the ack floor. Pinned by TestExportSurvivesBrokerRestartAndCrash
// and TestCommitsExportWhileCompacting (projectors/kafka).
//
// The commit log's fold, a consumer of COMMITS whose position lives in the
// bucket, is a user of the backbone, not part of it: package commitlog
// states its invariant and the tests that pin it.
package streams
