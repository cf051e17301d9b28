package streams_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

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
