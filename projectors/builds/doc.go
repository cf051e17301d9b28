// Package builds projects the BES stream (Bazel's build events, as the BES
// edge stored them in JetStream) into PostgreSQL: one row per invocation
// with its status, exit code and times, its targets and tests, its build
// metrics, its console output (zstd-compressed) and hourly rollups per
// project. It is a projection.Projector and projection.Sweeper; it has no
// goroutines and does not know NATS.
//
// # Identity
//
// A build is (project, invocation id): Bazel lets any client choose its
// invocation id, so two projects may send the same one. Every table, key,
// statement and in-memory map of the projector uses the pair, so that two
// such builds never merge and the events of one are never taken for
// resends of the other's.
//
// # Exactly-once effect
//
// The runner skips messages at or below its recorded position, and in
// addition each build records the highest BES tool sequence it has
// applied (invocations.last_sequence): a tool event at or below it is a
// resend (for example after Bazel reconnected beyond JetStream's duplicate
// window) and is skipped. Lifecycle events are idempotent. Rollups are kept
// as differences: each invocation records what it contributes to
// hourly_rollups (the counted_* columns) and every batch applies only the
// difference between that and the invocation's present state.
//
// # Replay yields the same rows
//
// Every value is derived from the events and from JetStream's storage time
// of each message, never from the wall clock, and every merge rule used
// inside a batch (in memory) is the one the SQL applies across batches, so
// the rows do not depend on batch boundaries. Console output is the one
// exception to plain upserts: while an invocation runs, each batch's output
// is stored as a compressed chunk in a scratch table, and when the tool
// stream ends (or the invocation is abandoned) the whole output is
// compressed again into one canonical row, deterministically.
//
// # Cost
//
// Apply decodes the BES envelope and each BuildEvent by walking the wire
// format and unmarshals only the payloads it reads; progress output is
// sliced from the message bytes. It merges the batch in memory per
// invocation and per target or test label. Then, per batch: one round trip
// reads which of the invocations, targets and tests exist, but for those a
// cache of the last batches' writes knows (cache.go); one pipeline
// INSERTs the new rows and UPDATEs the existing ones, one statement per
// table and kind over unnest() arrays (plain INSERT and UPDATE rather than
// INSERT ... ON CONFLICT, which costs two more WAL records per row), and
// reconciles the rollups of the invocations that finished. Each statement
// probes the tables by primary key whatever the plan cache holds
// (sqlKeyedPlans), and an invocation that a batch only moves on gets the
// narrow sqlUpdateProgress. With many slow builds (1,000 paced streams) a
// batch writes about one invocation row per event; with few fast ones, a
// few per thousand events.
package builds
