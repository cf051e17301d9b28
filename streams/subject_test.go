package streams_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// ReadSubject reads one subject's messages in stream order, every header
// value and the stored time included, and none of another subject's.
func TestReadSubject(t *testing.T) {
	ns := testenv.NATS(t)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	s, _ := js.Stream(ctx, subjects.StreamBES)
	if err := streams.ReadSubject(ctx, s, subjects.BES("p", "none"), func(streams.StoredMsg) error {
		t.Fatal("a message of an empty subject")
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	want := subjects.BES("p", "i1")
	for i := range 700 {
		for _, subj := range []string{want, subjects.BES("p", "i2")} {
			m := &nats.Msg{Subject: subj, Data: []byte(fmt.Sprint(i)), Header: nats.Header{"A": {"1", "2"}, "B": {fmt.Sprint(i)}}}
			if _, err := js.PublishMsg(ctx, m); err != nil {
				t.Fatal(err)
			}
		}
	}
	var n int
	var prev uint64
	err = streams.ReadSubject(ctx, s, want, func(m streams.StoredMsg) error {
		if m.Subject != want || string(m.Data) != fmt.Sprint(n) || m.Seq <= prev || len(m.Header["A"]) != 2 ||
			m.Header["B"][0] != fmt.Sprint(n) || m.Time.IsZero() {
			t.Fatalf("message %d: %+v", n, m)
		}
		prev, n = m.Seq, n+1
		return nil
	})
	if err != nil || n != 700 {
		t.Fatalf("read %d messages, %v; want 700", n, err)
	}
}

// Follow hands over one subject's messages after a sequence, those stored
// before it starts and those that arrive while it runs, once each and in
// order; when it ends the server holds no consumer for it.
func TestFollow(t *testing.T) {
	ns := testenv.NATS(t)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	s, _ := js.Stream(ctx, subjects.StreamBES)
	want, other := subjects.BES("p", "i1"), subjects.BES("p", "i2")
	var seqs []uint64 // of want's messages
	publish := func(i int) {
		t.Helper()
		for _, subj := range []string{want, other} {
			ack, err := js.Publish(ctx, subj, []byte(fmt.Sprint(i)))
			if err != nil {
				t.Fatal(err)
			}
			if subj == want {
				seqs = append(seqs, ack.Sequence)
			}
		}
	}
	for i := range 10 {
		publish(i)
	}
	fctx, stop := context.WithCancel(ctx)
	got := make(chan string, 100)
	done := make(chan error, 1)
	// After the fourth message of want: the fifth is the first handed over.
	// Read before the goroutine starts: publish appends to seqs meanwhile.
	after := seqs[3]
	go func() {
		done <- streams.SubjectReader{Stream: s}.Follow(fctx, want, after, func(seq uint64, data []byte) error {
			got <- fmt.Sprintf("%d:%s", seq, data)
			return nil
		})
	}()
	for i := 10; i < 15; i++ {
		publish(i)
	}
	for i := 4; i < 15; i++ {
		select {
		case m := <-got:
			if w := fmt.Sprintf("%d:%d", seqs[i], i); m != w {
				t.Fatalf("message %d: got %s, want %s", i, m, w)
			}
		case <-ctx.Done():
			t.Fatalf("message %d never came", i)
		}
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("Follow ended with %v after its context", err)
	}
	select {
	case m := <-got:
		t.Fatalf("a message past the end: %s", m)
	default:
	}
	poll.NoError(t, "the follow's consumer gone", func() error {
		info, err := s.Info(ctx)
		if err != nil {
			return err
		}
		if info.State.Consumers != 0 {
			return fmt.Errorf("%d consumers left on the stream", info.State.Consumers)
		}
		return nil
	}, poll.Within(10*time.Second))
}
