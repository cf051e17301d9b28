package streams

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// CountSubjects counts the messages of s on filter, and the distinct
// subjects they are on (for the BES stream: the invocations).
func CountSubjects(ctx context.Context, s jetstream.Stream, filter string) (messages uint64, subjects int, err error) {
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(filter))
	if err != nil {
		return 0, 0, err
	}
	for _, c := range info.State.Subjects {
		messages += c
	}
	return messages, len(info.State.Subjects), nil
}

// EraseSubjects deletes every message of s on filter with JetStream's
// secure delete, which overwrites the message's bytes in its block: a
// plain purge leaves them on disk until the block is compacted, which a
// block shared with other subjects' messages may never be. It reads the
// sequences headers-only, then erases them, calling progress (when not
// nil) about once a second with the messages erased so far and the total.
// It returns the messages erased, also when it fails part way.
func EraseSubjects(ctx context.Context, s jetstream.Stream, filter string, progress func(erased, total uint64)) (uint64, error) {
	seqs, err := sequences(ctx, s, filter)
	if err != nil {
		return 0, err
	}
	var erased uint64
	last := time.Now()
	for _, seq := range seqs {
		if err := s.SecureDeleteMsg(ctx, seq); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
			return erased, fmt.Errorf("erase message %d: %w", seq, err)
		}
		erased++
		if progress != nil && time.Since(last) >= time.Second {
			progress(erased, uint64(len(seqs)))
			last = time.Now()
		}
	}
	return erased, nil
}

// sequences lists the stream sequences of the messages on filter.
func sequences(ctx context.Context, s jetstream.Stream, filter string) ([]uint64, error) {
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{filter}, HeadersOnly: true})
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", filter, err)
	}
	var seqs []uint64
	for {
		batch, err := cons.FetchNoWait(1000)
		if err != nil {
			return nil, fmt.Errorf("read %s: %w", filter, err)
		}
		n, left := 0, uint64(0)
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				return nil, err
			}
			seqs = append(seqs, md.Sequence.Stream)
			n, left = n+1, md.NumPending
		}
		if err := batch.Error(); err != nil {
			return nil, fmt.Errorf("read %s: %w", filter, err)
		}
		if n == 0 || left == 0 {
			return seqs, nil
		}
	}
}
