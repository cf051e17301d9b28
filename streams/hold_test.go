package streams_test

import (
	"context"
	"fmt"
	"math"
	"slices"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/schemas/envelope"

	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// ackTo makes a durable consumer on filter and acknowledges its first n
// messages.
func ackTo(t *testing.T, s jetstream.Stream, name, filter string, n int) {
	t.Helper()
	ctx := context.Background()
	c, err := s.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: name, FilterSubject: filter, AckPolicy: jetstream.AckAllPolicy})
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		return
	}
	batch, err := c.Fetch(n)
	if err != nil {
		t.Fatal(err)
	}
	var last jetstream.Msg
	for m := range batch.Messages() {
		last = m
	}
	if err := last.DoubleAck(ctx); err != nil {
		t.Fatal(err)
	}
}

func TestHoldFloorAndTrimSubject(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	for i := range 2 { // another build's, seqs 1 and 2
		m := nats.NewMsg(subjects.BES("p", "other"))
		m.Header.Set(envelope.MsgID, fmt.Sprintf("other-%d", i))
		if err := e.pub.Publish(ctx, m); err != nil {
			t.Fatal(err)
		}
	}
	e.publish(t, bodies(10, "a")...) // bes.p.inv, seqs 3..12
	s, err := e.js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	filter := subjects.BES("p", "inv")
	ackTo(t, s, "builds", "bes.>", 6)
	ackTo(t, s, "export", "bes.>", 3)
	ackTo(t, s, "elsewhere", "bes.q.>", 0) // another project's subjects: does not hold these back

	cases := []struct {
		holders []string
		every   bool
		want    uint64
		missing []string
	}{
		{nil, false, math.MaxUint64, nil},
		{[]string{"builds"}, false, 6, nil},
		{[]string{"builds"}, true, 3, nil},
		{[]string{"builds", "gone"}, false, 0, []string{"gone"}},
		{[]string{"elsewhere"}, false, math.MaxUint64, nil},
	}
	for _, c := range cases {
		floor, missing, err := streams.HoldFloor(ctx, s, filter, c.holders, c.every)
		if err != nil || floor != c.want || !slices.Equal(missing, c.missing) {
			t.Errorf("HoldFloor(%v, every %v) = %d, missing %v, %v; want %d, missing %v", c.holders, c.every, floor, missing, err, c.want, c.missing)
		}
	}

	if err := streams.TrimSubject(ctx, s, filter, 8); err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 6 || info.State.FirstSeq != 1 || info.State.NumDeleted != 6 {
		t.Fatalf("after trimming the build up to 8: %d messages from %d, %d deleted; want 6 (the other build's 2, this one's 9..12) from 1, 6 deleted",
			info.State.Msgs, info.State.FirstSeq, info.State.NumDeleted)
	}

	// The archive's Trimmer: every durable holds, and a trim counts what
	// left.
	tr := streams.SubjectTrimmer{Stream: s}
	if floor, _, err := tr.Floor(ctx, filter, []string{"builds"}); err != nil || floor != 3 {
		t.Errorf("SubjectTrimmer.Floor = %d, %v; want 3 (the export's)", floor, err)
	}
	if n, err := tr.Trim(ctx, filter, 10); err != nil || n != 2 {
		t.Errorf("SubjectTrimmer.Trim up to 10 = %d, %v; want 2 (9 and 10)", n, err)
	}
	if n, err := tr.Trim(ctx, subjects.BES("p", "none"), 10); err != nil || n != 0 {
		t.Errorf("SubjectTrimmer.Trim of a subject with no message = %d, %v", n, err)
	}
}
