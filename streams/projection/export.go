package projection

import (
	"context"
	"time"
)

// The export contract. An Exporter copies a stream's messages to another
// system (Kafka) instead of building a projection: its position is the
// JetStream consumer's ack floor, so a message is acknowledged only after
// the Exporter reports it durable there. streams.ExportRunner drives it.

// Record is one stream message as an Exporter sees it.
type Record struct {
	Stream  string
	Subject string
	Seq     uint64 // the stream sequence
	Time    time.Time
	MsgID   string              // Nats-Msg-Id, if the publisher set one
	Headers map[string][]string // the message's headers, Nats-Msg-Id included
	Data    []byte
}

// Exporter sends records to another system, in the order given for
// records of one subject.
type Exporter interface {
	// Send queues r. done is called exactly once, from any goroutine: nil
	// once the other system holds r durably, or the error that made the
	// exporter give up on it. Send blocks while the exporter's buffer is
	// full (the backpressure that pauses export during an outage); it
	// returns an error without calling done only if ctx ends first or r
	// can never be sent (no route takes its subject).
	Send(ctx context.Context, r *Record, done func(error)) error
}
