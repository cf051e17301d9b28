// Package streams owns millrace's backbone on NATS JetStream: subject names
// and their encoding, the stream and consumer specs (applied idempotently at
// start), the embedded server used when no external NATS is configured, the
// asynchronous deduplicating publisher the edges use, and the one consumer
// loop every projector runs under (fetch a batch, apply it in a PostgreSQL
// transaction that also records the consumer position, commit, then ack).
package streams
