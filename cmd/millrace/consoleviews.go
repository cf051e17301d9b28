package main

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/commitlog/layout"
	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// besFollower follows subjects of the process's BES stream for the
// console's live pages; the backbone is open before the HTTP server
// serves.
type besFollower struct{ p *process }

func (f besFollower) Follow(ctx context.Context, subject string, after uint64, fn func(seq uint64, data []byte) error) error {
	r, err := f.p.bb.Reader(ctx, subjects.StreamBES)
	if err != nil {
		return err
	}
	return r.Follow(ctx, subject, after, fn)
}

// commitLogView reads the commit log for the console's page: the worlds'
// checkpoints from the bucket, what the stream holds after each, and the
// lag of the consumers that follow streams on their own.
type commitLogView struct {
	p       *process
	durable string // the compactor's
}

// worldReads is how many worlds are read at once.
const worldReads = 8

func (v commitLogView) Worlds(ctx context.Context) ([]console.World, error) {
	if v.p.bk == nil {
		return nil, errors.New("the bucket is not open")
	}
	names, err := layout.Worlds(ctx, v.p.bk)
	if err != nil {
		return nil, err
	}
	s, err := v.p.bb.Stream(ctx, subjects.StreamCommits)
	if err != nil {
		return nil, err
	}
	out := make([]console.World, len(names))
	errs := make([]error, len(names))
	sem := make(chan struct{}, worldReads)
	var wg sync.WaitGroup
	for i, name := range names {
		wg.Go(func() {
			sem <- struct{}{}
			defer func() { <-sem }()
			out[i], errs[i] = v.world(ctx, s, name)
		})
	}
	wg.Wait()
	return out, errors.Join(errs...)
}

// world reads one world: its latest manifest, then how many versions
// the stream holds after it (from a consumer made for the count and
// deleted at once) and when the oldest was stored.
func (v commitLogView) world(ctx context.Context, s jetstream.Stream, name string) (console.World, error) {
	w := console.World{World: name}
	m, at, err := layout.LatestAt(ctx, v.p.bk, name)
	if err != nil || m == nil {
		return w, err
	}
	w.Documents, w.Checkpoint = m.Docs, m.Seq
	if !at.IsZero() {
		w.CheckpointAt = &at
	}
	for _, seg := range m.History {
		w.Versions += uint64(seg.Versions)
	}
	filter := subjects.CommitsWorldFilter(name)
	c, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{FilterSubject: filter, DeliverPolicy: jetstream.DeliverByStartSequencePolicy,
		OptStartSeq: m.Seq + 1, AckPolicy: jetstream.AckNonePolicy, InactiveThreshold: 10 * time.Second, MemoryStorage: true, Replicas: 1})
	if err != nil {
		return w, fmt.Errorf("world %s: %w", name, err)
	}
	info := c.CachedInfo()
	s.DeleteConsumer(context.WithoutCancel(ctx), info.Name) // else it goes when idle
	w.Pending = info.NumPending
	if w.Pending > 0 {
		msg, err := s.GetMsg(ctx, m.Seq+1, jetstream.WithGetMsgSubject(filter))
		if err == nil {
			t := msg.Time.UTC()
			w.OldestPending = &t
		}
	}
	return w, nil
}

func (v commitLogView) Consumers(ctx context.Context) ([]console.ConsumerLag, error) {
	want := []console.ConsumerLag{{Kind: "compactor", Stream: subjects.StreamCommits, Consumer: v.durable}}
	for _, name := range streams.Names() {
		want = append(want, console.ConsumerLag{Kind: "export", Stream: name, Consumer: kafka.Durable(name)})
	}
	var out []console.ConsumerLag
	for _, c := range want {
		s, err := v.p.bb.Stream(ctx, c.Stream)
		if err != nil {
			return nil, err
		}
		cons, err := s.Consumer(ctx, c.Consumer)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			continue // not running here (no Kafka export of the stream)
		}
		if err != nil {
			return nil, fmt.Errorf("consumer %s: %w", c.Consumer, err)
		}
		info := cons.CachedInfo()
		c.Position, c.Pending, c.AckPending = info.AckFloor.Stream, info.NumPending, uint64(info.NumAckPending)
		c.LastSeq = s.CachedInfo().State.LastSeq
		out = append(out, c)
	}
	return out, nil
}
