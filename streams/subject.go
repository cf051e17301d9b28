package streams

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// StoredMsg is one stored message of a subject as ReadSubject hands it
// over: every field JetStream stored. Header is the message's own map:
// the callee may keep it.
type StoredMsg struct {
	Seq     uint64
	Time    time.Time
	Subject string
	Header  map[string][]string
	Data    []byte
}

// ReadSubject calls fn with every message of s on subject, in stream
// order, from the first to the last stored when it starts (what arrives
// meanwhile may or may not be included). It reads with an ordered
// consumer, in batches bounded in bytes, so memory does not grow with the
// subject's size; an error of fn ends it.
func ReadSubject(ctx context.Context, s jetstream.Stream, subject string, fn func(StoredMsg) error) error {
	last, err := s.GetLastMsgForSubject(ctx, subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", subject, err)
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}})
	if err != nil {
		return fmt.Errorf("read %s: %w", subject, err)
	}
	// Pulls of at most 8 MiB: a subject of large events is not taken in
	// at once.
	it, err := cons.Messages(jetstream.PullMaxBytes(8 << 20))
	if err != nil {
		return fmt.Errorf("read %s: %w", subject, err)
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	for {
		m, err := it.Next()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("read %s: %w", subject, err)
		}
		md, err := m.Metadata()
		if err != nil {
			return fmt.Errorf("read %s: %w", subject, err)
		}
		if err := fn(StoredMsg{Seq: md.Sequence.Stream, Time: md.Timestamp, Subject: m.Subject(), Header: m.Headers(), Data: m.Data()}); err != nil {
			return err
		}
		if md.Sequence.Stream >= last.Sequence {
			return nil
		}
	}
}
