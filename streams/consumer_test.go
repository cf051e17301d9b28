package streams_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// attachEnv is a BES stream holding n messages.
func attachEnv(t *testing.T, n int) (*env, jetstream.Stream) {
	t.Helper()
	e := setup(t)
	e.publish(t, bodies(n, "m")...)
	s, err := e.js.Stream(context.Background(), subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	return e, s
}

// fetchSeqs fetches up to n messages and returns their stream sequences,
// leaving them unacknowledged.
func fetchSeqs(t *testing.T, c jetstream.Consumer, n int) []uint64 {
	t.Helper()
	b, err := c.Fetch(n, jetstream.FetchMaxWait(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var out []uint64
	for m := range b.Messages() {
		md, err := m.Metadata()
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, md.Sequence.Stream)
	}
	return out
}

func info(t *testing.T, s jetstream.Stream, name string) *jetstream.ConsumerInfo {
	t.Helper()
	c, err := s.Consumer(context.Background(), name)
	if err != nil {
		t.Fatal(err)
	}
	return c.CachedInfo()
}

// TestResetConsumerToSequenceOnTheServer pins what Attach relies on of
// ResetConsumerToSequence on the embedded nats-server: it drops every
// delivery in flight at once, the next delivery is the sequence asked for,
// the ack floor is the one before it, an ack of a delivery made before the
// reset cannot move the floor past what was not delivered again, and a
// consumer made with DeliverByStartSequence refuses a reset below its
// start.
func TestResetConsumerToSequenceOnTheServer(t *testing.T) {
	_, s := attachEnv(t, 10)
	ctx := context.Background()
	c, err := s.CreateConsumer(ctx, streams.ConsumerSpec("raw", subjects.BESFilter, 10, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Fetch(5, jetstream.FetchMaxWait(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	var old []jetstream.Msg
	for m := range b.Messages() {
		old = append(old, m)
	}
	if len(old) != 5 || info(t, s, "raw").NumAckPending != 5 {
		t.Fatalf("fetched %d, %d pending; want 5 and 5", len(old), info(t, s, "raw").NumAckPending)
	}
	r, err := s.ResetConsumerToSequence(ctx, "raw", 3)
	if err != nil {
		t.Fatal(err)
	}
	ci := info(t, s, "raw")
	if r.ResetSeq != 3 || ci.NumAckPending != 0 || ci.AckFloor.Stream != 2 || ci.Delivered.Stream != 2 {
		t.Fatalf("after reset to 3: reset_seq %d, pending %d, ack floor %d, delivered %d; want 3, 0, 2, 2",
			r.ResetSeq, ci.NumAckPending, ci.AckFloor.Stream, ci.Delivered.Stream)
	}
	// An ack of the old delivery of 5 (AckAll) arrives late; the server
	// takes acks of a consumer in order, so once the ack of the new
	// delivery of 3 is confirmed the stale one was seen before it.
	if err := old[4].Ack(); err != nil {
		t.Fatal(err)
	}
	b, err = c.Fetch(1, jetstream.FetchMaxWait(time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for m := range b.Messages() {
		if md, _ := m.Metadata(); md.Sequence.Stream != 3 {
			t.Fatalf("first delivery after the reset to 3: %d", md.Sequence.Stream)
		}
		if err := m.DoubleAck(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if f := info(t, s, "raw").AckFloor.Stream; f != 3 {
		t.Fatalf("ack floor %d after a stale ack of 5 and an ack of 3; want 3", f)
	}
	if got := fetchSeqs(t, c, 2); fmt.Sprint(got) != "[4 5]" {
		t.Fatalf("after the reset: %v, want [4 5]", got)
	}
	// With seq 0, back to the ack floor.
	if r, err := s.ResetConsumer(ctx, "raw"); err != nil || r.ResetSeq != 4 {
		t.Fatalf("reset to the ack floor: %v, %+v; want reset_seq 4", err, r)
	}
	if got := fetchSeqs(t, c, 1); fmt.Sprint(got) != "[4]" {
		t.Fatalf("after a reset to the ack floor: %v, want [4]", got)
	}

	byStart := streams.ConsumerSpec("bystart", subjects.BESFilter, 10, time.Minute)
	byStart.DeliverPolicy, byStart.OptStartSeq = jetstream.DeliverByStartSequencePolicy, 5
	if _, err := s.CreateConsumer(ctx, byStart); err != nil {
		t.Fatal(err)
	}
	if _, err := s.ResetConsumerToSequence(ctx, "bystart", 3); !errors.Is(err, jetstream.ErrConsumerInvalidReset) {
		t.Fatalf("reset below OptStartSeq: %v, want ErrConsumerInvalidReset", err)
	}
	if _, err := s.ResetConsumerToSequence(ctx, "bystart", 7); err != nil {
		t.Fatalf("reset above OptStartSeq: %v", err)
	}
}

// TestAttachResetsInPlace: Attach creates a missing durable, resets one
// that has deliveries in flight without deleting it, leaves one that sits
// at the start alone, applies a changed limit by update, and recreates
// only a consumer whose immutable fields forbid the reset or differ.
func TestAttachResetsInPlace(t *testing.T) {
	e, s := attachEnv(t, 10)
	ctx := context.Background()
	spec := streams.ConsumerSpec("att", subjects.BESFilter, 10, time.Minute)
	attach := func(start uint64) (jetstream.Consumer, uint64) {
		t.Helper()
		c, from, err := streams.Attach(ctx, e.js, subjects.StreamBES, streams.KindProjection, spec, streams.Position{Next: start}, quietLog())
		if err != nil {
			t.Fatal(err)
		}
		return c, from
	}

	c, from := attach(4)
	created := c.CachedInfo().Created
	if got := fetchSeqs(t, c, 3); from != 4 || fmt.Sprint(got) != "[4 5 6]" {
		t.Fatalf("a new consumer from 4: from %d, delivers %v; want 4, [4 5 6]", from, got)
	}
	// In flight 4..6: attach at 5 drops them and delivers 5 next.
	c, from = attach(5)
	ci := info(t, s, "att")
	if !ci.Created.Equal(created) {
		t.Fatal("the consumer was recreated to move it; want a reset in place")
	}
	if got := fetchSeqs(t, c, 2); from != 5 || fmt.Sprint(got) != "[5 6]" {
		t.Fatalf("attached at 5: from %d, delivers %v; want 5, [5 6]", from, got)
	}
	// Acked up to 6, nothing in flight: attach at 7 finds it there.
	b, _ := c.Fetch(1, jetstream.FetchMaxWait(time.Second))
	for m := range b.Messages() { // 7, acked: the floor is 7
		m.DoubleAck(ctx)
	}
	delivered := info(t, s, "att").Delivered.Consumer
	c, from = attach(8)
	if ci := info(t, s, "att"); from != 8 || ci.Delivered.Consumer != delivered {
		t.Fatalf("attach where it sits: from %d, consumer sequence %d -> %d; want 8, untouched", from, delivered, ci.Delivered.Consumer)
	}
	// A limit changes by update, in place.
	spec.MaxAckPending = 12345
	attach(8)
	if ci := info(t, s, "att"); ci.Config.MaxAckPending != 12345 || !ci.Created.Equal(created) {
		t.Fatalf("max ack pending %d, recreated %v; want 12345 in place", ci.Config.MaxAckPending, !ci.Created.Equal(created))
	}

	// A consumer an older millrace made to start by sequence at 8: kept
	// for a start at or above 8, recreated (DeliverAll) for one below.
	old := streams.ConsumerSpec("older", subjects.BESFilter, 10, time.Minute)
	old.DeliverPolicy, old.OptStartSeq = jetstream.DeliverByStartSequencePolicy, 8
	if _, err := s.CreateConsumer(ctx, old); err != nil {
		t.Fatal(err)
	}
	created = info(t, s, "older").Created
	spec = streams.ConsumerSpec("older", subjects.BESFilter, 10, time.Minute)
	c, _ = attach(9)
	if ci := info(t, s, "older"); !ci.Created.Equal(created) || fmt.Sprint(fetchSeqs(t, c, 1)) != "[9]" {
		t.Fatal("a start-by-sequence consumer reset above its start was recreated, or delivers another sequence than 9")
	}
	c, _ = attach(2)
	// The deliver policy cannot be updated: DeliverAll means recreated.
	if ci := info(t, s, "older"); ci.Config.DeliverPolicy != jetstream.DeliverAllPolicy {
		t.Fatal("a start-by-sequence consumer was not recreated for a start below its own")
	}
	if got := fetchSeqs(t, c, 2); fmt.Sprint(got) != "[2 3]" {
		t.Fatalf("recreated from 2: delivers %v", got)
	}

	// Another ack policy than the kind's: recreated with the kind's.
	explicit := streams.ConsumerSpec("explicit", subjects.BESFilter, 10, time.Minute)
	explicit.AckPolicy = jetstream.AckExplicitPolicy
	if _, err := s.CreateConsumer(ctx, explicit); err != nil {
		t.Fatal(err)
	}
	spec = streams.ConsumerSpec("explicit", subjects.BESFilter, 10, time.Minute)
	attach(1)
	if p := info(t, s, "explicit").Config.AckPolicy; p != jetstream.AckAllPolicy {
		t.Fatalf("ack policy %v after attach as a projection, want AckAll", p)
	}
	if p := streams.KindFold.AckPolicy(); p != jetstream.AckExplicitPolicy {
		t.Fatalf("the fold's ack policy is %v, want AckExplicit", p)
	}
}
