package streams

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// DefaultMaxPending bounds the asynchronous publishes in flight on one
// connection. With StallWait below, a full window blocks the caller (back
// pressure to the client) instead of failing after JetStream's 200 ms.
const DefaultMaxPending = 4096

// stallWait is how long a publish may wait for room in the window.
const stallWait = 5 * time.Second

// ErrBackbone wraps every failure to store a message: the caller should tell
// its client to retry.
var ErrBackbone = errors.New("backbone unavailable")

// Publisher publishes messages asynchronously; every message carries a
// Nats-Msg-Id so a resend is a no-op.
type Publisher struct {
	js jetstream.JetStream
	m  *Metrics
}

// NewPublisher wraps js.
func NewPublisher(js jetstream.JetStream, m *Metrics) *Publisher {
	return &Publisher{js: js, m: m}
}

// Future is one publish in flight.
type Future struct {
	f     jetstream.PubAckFuture
	start time.Time
	p     *Publisher
}

// PublishAsync sends msg and returns at once (or when the window has room).
// The message must carry a Nats-Msg-Id header.
func (p *Publisher) PublishAsync(msg *nats.Msg) (*Future, error) {
	if msg.Header.Get(jetstream.MsgIDHeader) == "" {
		return nil, fmt.Errorf("publish to %s: message has no %s", msg.Subject, jetstream.MsgIDHeader)
	}
	start := time.Now()
	f, err := p.js.PublishMsgAsync(msg, jetstream.WithStallWait(stallWait))
	if err != nil {
		p.m.published(msg.Subject, "error", 0)
		return nil, fmt.Errorf("%w: publish to %s: %v", ErrBackbone, msg.Subject, err)
	}
	return &Future{f: f, start: start, p: p}, nil
}

// Wait blocks until JetStream stored the message (or refused it) and
// reports whether it was a duplicate of one stored before.
func (f *Future) Wait(ctx context.Context) (duplicate bool, err error) {
	ack, err := f.WaitAck(ctx)
	if err != nil {
		return false, err
	}
	return ack.Duplicate, nil
}

// WaitAck is Wait with JetStream's acknowledgement. For a duplicate, its
// Sequence is that of the message stored first under the same Nats-Msg-Id:
// a caller whose resend may differ from the first (a reused request id)
// reads that message to see what was stored.
func (f *Future) WaitAck(ctx context.Context) (*jetstream.PubAck, error) {
	select {
	case ack := <-f.f.Ok():
		return f.Stored(ack), nil
	case err := <-f.f.Err():
		return nil, f.Failed(err)
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Ok and Err are the channels WaitAck selects on, for a caller that waits
// for other things in the same select; it then passes what it received to
// Stored or Failed.
func (f *Future) Ok() <-chan *jetstream.PubAck { return f.f.Ok() }

// Err: see Ok.
func (f *Future) Err() <-chan error { return f.f.Err() }

// Stored records ack, received from Ok, as WaitAck does, and returns it.
func (f *Future) Stored(ack *jetstream.PubAck) *jetstream.PubAck {
	f.p.m.published(f.f.Msg().Subject, outcome(ack.Duplicate), time.Since(f.start))
	return ack
}

// Failed records err, received from Err, and returns it as WaitAck would.
func (f *Future) Failed(err error) error {
	subject := f.f.Msg().Subject
	f.p.m.published(subject, "error", time.Since(f.start))
	return fmt.Errorf("%w: store %s: %v", ErrBackbone, subject, err)
}

func outcome(dup bool) string {
	if dup {
		return "duplicate"
	}
	return "stored"
}

// Publish sends msg and waits until it is stored.
func (p *Publisher) Publish(ctx context.Context, msg *nats.Msg) error {
	_, err := p.PublishAck(ctx, msg)
	return err
}

// PublishAck is Publish with JetStream's acknowledgement (see WaitAck).
func (p *Publisher) PublishAck(ctx context.Context, msg *nats.Msg) (*jetstream.PubAck, error) {
	f, err := p.PublishAsync(msg)
	if err != nil {
		return nil, err
	}
	return f.WaitAck(ctx)
}
