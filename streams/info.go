package streams

import (
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/nats-io/nats.go/jetstream"
)

// StreamInfo is the state of one stream and its consumers, as `millrace
// streams info` prints it (the JSON names are what --json prints).
type StreamInfo struct {
	Name      string         `json:"name"`
	Subjects  []string       `json:"subjects"`
	Messages  uint64         `json:"messages"`
	Bytes     uint64         `json:"bytes"`
	FirstSeq  uint64         `json:"first_seq"`
	LastSeq   uint64         `json:"last_seq"`
	Consumers []ConsumerInfo `json:"consumers"`
}

// ConsumerInfo is the position of one durable consumer.
type ConsumerInfo struct {
	Name       string `json:"name"`
	Pending    uint64 `json:"pending"`
	AckPending int    `json:"ack_pending"`
	AckFloor   uint64 `json:"ack_floor"`
}

// Describe reads the state of the streams of specs and of their consumers.
func Describe(ctx context.Context, js jetstream.JetStream, specs []jetstream.StreamConfig) ([]StreamInfo, error) {
	var out []StreamInfo
	for _, spec := range specs {
		s, err := js.Stream(ctx, spec.Name)
		if err != nil {
			return nil, fmt.Errorf("stream %s: %w", spec.Name, err)
		}
		st := s.CachedInfo().State
		si := StreamInfo{Name: spec.Name, Subjects: spec.Subjects, Messages: st.Msgs, Bytes: st.Bytes, FirstSeq: st.FirstSeq, LastSeq: st.LastSeq}
		lister := s.ListConsumers(ctx)
		for ci := range lister.Info() {
			si.Consumers = append(si.Consumers, ConsumerInfo{ci.Name, ci.NumPending, ci.NumAckPending, ci.AckFloor.Stream})
		}
		if err := lister.Err(); err != nil && !errors.Is(err, jetstream.ErrEndOfData) {
			return nil, err
		}
		out = append(out, si)
	}
	return out, nil
}

// WriteInfo writes streams for a person: a line per stream, one per
// consumer under it.
func WriteInfo(w io.Writer, streams []StreamInfo) error {
	for _, s := range streams {
		if _, err := fmt.Fprintf(w, "%-6s %v  messages=%d bytes=%d seq=%d..%d\n", s.Name, s.Subjects, s.Messages, s.Bytes, s.FirstSeq, s.LastSeq); err != nil {
			return err
		}
		for _, c := range s.Consumers {
			fmt.Fprintf(w, "  consumer %-12s pending=%d ack_pending=%d ack_floor=%d\n", c.Name, c.Pending, c.AckPending, c.AckFloor)
		}
	}
	return nil
}
