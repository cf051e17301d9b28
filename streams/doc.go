// Package streams owns millrace's backbone on NATS JetStream: the stream and
// consumer specs (applied idempotently at start; the stream and subject
// names they use are in package subjects), the embedded server used when no
// external NATS is configured, the asynchronous deduplicating publisher the
// edges use, the consumer core every consumer of a stream runs under and
// its users here (the projection runner, the outbox relay, the export
// runner; the commit log's fold, in package commitlog, is the other), and
// the raw JetStream API requests the client lacks (DeleteMsgs).
//
// # The consumer core
//
// One file says how every consumer behaves (consumer.go, with the leases
// in lease.go): a Loop takes a Lease (standing by while another process
// holds it), attaches its durable consumer at its position (Attach:
// created if missing, updated, reset in place with ResetConsumerToSequence;
// recreated only when an immutable field forbids that), runs its steps,
// retries a failed one in place with one backoff (internal/backoff) while
// the lease holds, and releases the lease under one deadline. The ack
// policy of each Kind is stated once (Kind.AckPolicy), and one set of
// metrics, labelled by consumer and kind, counts them all. A lease is a
// PostgreSQL advisory lock on the connection the holder's transactions use
// where the position lives in PostgreSQL (PGLease: the runner, the outbox,
// replays), and a key-value entry taken by compare-and-set where it does
// not (KVLease: the export, and the fold in package commitlog), whose
// holder checks Fence before an effect (projection.Fence for code that
// only has the context). The users say only where their position lives
// and what an ack means: Runner (projections: fetch a batch, apply it in a
// PostgreSQL transaction that also records the position, commit, then
// ack), Outbox, ExportRunner, commitlog.FoldRunner. TestConsumerCoreFaults
// runs every fault against each.
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
// that fails, a failed fetch) re-points the durable consumer at the
// committed position, or gives up the lead when it cannot, so the next
// delivery is the first unapplied message. A lost connection during
// isolation gives up the lead.
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
// by the other system, and only while the export holds its lease (Fence
// before each ack); a failed record ends the session and the next one
// starts from the ack floor. Pinned by TestExportSurvivesBrokerRestartAndCrash
// and TestCommitsExportWhileCompacting (projectors/kafka), and by the
// export's cases of TestConsumerCoreFaults (lease taken: no ack after it).
//
// Every user of the core, under every fault of TestConsumerCoreFaults
// (durable consumer deleted, lease lost or taken, backbone or database
// restarted, shutdown mid-batch, two instances): nothing lost, nothing
// effected twice beyond what the user's contract allows, position never
// going back.
//
// The commit log's fold, a consumer of COMMITS whose position lives in the
// bucket, is a user of the core, not part of this package: package
// commitlog states its invariant and the tests that pin it. Its cases of
// TestConsumerCoreFaults import it from this package's external tests.
package streams
