// Package backbone implements the console's views that read JetStream
// and the bucket rather than PostgreSQL: the live pages' follower of the
// BES stream and the commit-log page. The console package itself needs no
// backbone (its tests run on PostgreSQL alone); a process that has one
// hands these to console.Sources.
//
// Both take the backbone and the bucket as functions because a process
// opens them in its components, after it has registered its pages: each
// call reads them when a page is served, by which time they are open.
package backbone

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog/layout"
	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// Follower follows builds' events for the console's live pages
// (console.Follower), wherever the backbone's layout keeps them.
type Follower struct {
	Backbone func() *streams.Backbone
}

var _ console.Follower = Follower{}

// Follow calls fn with each message of subject after sequence after
// until ctx ends or fn fails.
func (f Follower) Follow(ctx context.Context, project, invocation string, after uint64, fn func(seq uint64, data []byte) error) error {
	bb := f.Backbone()
	r, err := bb.Reader(ctx, bb.Layout.StreamOf(project, invocation))
	if err != nil {
		return err
	}
	return r.Follow(ctx, bb.Layout.Subject(project, invocation), after, fn)
}

// CommitLog reads the commit log for the console's page
// (console.CommitLog): the worlds' checkpoints from the bucket, what the
// stream holds after each, and the lag of the consumers that follow
// streams on their own.
type CommitLog struct {
	Backbone func() *streams.Backbone
	Bucket   func() *bucket.Bucket
	// Compactor is the compactor's durable consumer.
	Compactor string
}

var _ console.CommitLog = CommitLog{}

// worldReads is how many worlds are read at once: each is a bucket read
// and two requests to the server, and a page lists every world.
const worldReads = 8

// Worlds lists every world that has a checkpoint in the bucket.
func (v CommitLog) Worlds(ctx context.Context) ([]console.World, error) {
	bk := v.Bucket()
	if bk == nil {
		return nil, errors.New("the bucket is not open")
	}
	names, err := layout.Worlds(ctx, bk)
	if err != nil {
		return nil, err
	}
	s, err := v.Backbone().Stream(ctx, subjects.StreamCommits)
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
			out[i], errs[i] = world(ctx, bk, s, name)
		})
	}
	wg.Wait()
	return out, errors.Join(errs...)
}

// world reads one world: its latest manifest, then how many versions
// the stream holds after it (from a consumer made for the count and
// deleted at once) and when the oldest was stored.
func world(ctx context.Context, bk *bucket.Bucket, s jetstream.Stream, name string) (console.World, error) {
	w := console.World{World: name}
	m, at, err := layout.LatestAt(ctx, bk, name)
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

// Consumers reports the compactor's consumer and the Kafka export's, one
// per stream, that exist on the server.
func (v CommitLog) Consumers(ctx context.Context) ([]console.ConsumerLag, error) {
	want := []console.ConsumerLag{{Kind: "compactor", Stream: subjects.StreamCommits, Consumer: v.Compactor}}
	for _, name := range streams.NamesIn(v.Backbone().Layout) {
		want = append(want, console.ConsumerLag{Kind: "export", Stream: name, Consumer: kafka.Durable(name)})
	}
	var out []console.ConsumerLag
	for _, c := range want {
		s, err := v.Backbone().Stream(ctx, c.Stream)
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
