package streams_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The embedded server admits only its identities: an anonymous connection
// is refused, the reader reads a stream (information, a message get, an
// ordered consumer, a subscription) but its publish to a data subject is a
// permissions violation and nothing is stored, and the service identity,
// which Open connects with, publishes.
func TestEmbeddedServerAuth(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dir := t.TempDir()
	bb, err := streams.Open(ctx, streams.Config{DataDir: dir, Listen: "127.0.0.1:0", ServiceConsumers: []string{"rows"}}, t.Name(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer bb.Close()
	if _, err := bb.JS.CreateOrUpdateConsumer(ctx, subjects.StreamBES, streams.ConsumerSpec("rows", subjects.BESFilter, 50, time.Minute)); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{bb.ServiceSeedFile, bb.ReaderSeedFile} {
		fi, err := os.Stat(f)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != 0o600 || !strings.HasPrefix(f, dir) {
			t.Fatalf("%s: mode %v, want 0600 under the data directory", f, fi.Mode().Perm())
		}
	}
	subject := subjects.BES("default", "inv-1")
	if err := bb.Publisher().Publish(ctx, &nats.Msg{Subject: subject, Data: []byte("real"),
		Header: nats.Header{jetstream.MsgIDHeader: {"default/inv-1/1"}}}); err != nil {
		t.Fatalf("the service identity's publish: %v", err)
	}
	// The process's own connection is in-process (no loopback socket per
	// message), still as the service identity; other processes on the
	// host reach the same server over TCP with its seed file.
	if addr := bb.Conn.ConnectedAddr(); addr != "pipe" {
		t.Fatalf("Open connected to the embedded server over %q, want in-process", addr)
	}
	svcSeed, err := nats.NkeyOptionFromSeed(bb.ServiceSeedFile)
	if err != nil {
		t.Fatal(err)
	}
	other, err := nats.Connect(bb.URL, svcSeed)
	if err != nil {
		t.Fatalf("the service identity over TCP: %v", err)
	}
	other.Close()

	if nc, err := nats.Connect(bb.URL); err == nil {
		nc.Close()
		t.Fatal("an anonymous connection was admitted")
	} else if !errors.Is(err, nats.ErrAuthorization) && !strings.Contains(strings.ToLower(err.Error()), "authorization") {
		t.Fatalf("anonymous connection: %v, want an authorization violation", err)
	}

	violations := make(chan error, 10)
	seed, err := nats.NkeyOptionFromSeed(bb.ReaderSeedFile)
	if err != nil {
		t.Fatal(err)
	}
	reader, err := nats.Connect(bb.URL, seed, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) {
		violations <- err
	}))
	if err != nil {
		t.Fatalf("reader: %v", err)
	}
	defer reader.Close()
	rjs, err := jetstream.New(reader)
	if err != nil {
		t.Fatal(err)
	}
	st, err := rjs.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatalf("reader: stream info: %v", err)
	}
	names := rjs.StreamNames(ctx)
	n := 0
	for range names.Name() {
		n++
	}
	if names.Err() != nil || n == 0 {
		t.Fatalf("reader: stream names: %d, %v", n, names.Err())
	}
	if m, err := st.GetMsg(ctx, 1); err != nil || string(m.Data) != "real" {
		t.Fatalf("reader: get message 1: %v", err)
	}
	oc, err := st.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{"bes.>"}})
	if err != nil {
		t.Fatalf("reader: ordered consumer: %v", err)
	}
	if m, err := oc.Next(jetstream.FetchMaxWait(5 * time.Second)); err != nil || string(m.Data()) != "real" {
		t.Fatalf("reader: read through an ordered consumer: %v", err)
	}
	live, err := reader.SubscribeSync("bes.>")
	if err != nil {
		t.Fatal(err)
	}
	if err := reader.Flush(); err != nil {
		t.Fatal(err)
	}

	// A forged event: refused by the server.
	if err := reader.Publish(subject, []byte("forged")); err != nil {
		t.Fatal(err)
	}
	reader.Flush()
	select {
	case err := <-violations:
		if !errors.Is(err, nats.ErrPermissionViolation) || !strings.Contains(err.Error(), subject) {
			t.Fatalf("reader's publish: %v, want a permissions violation naming %s", err, subject)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the reader's publish to a data subject was not refused")
	}
	// Nor through the JetStream API: a stream delete gets no answer (the
	// request itself is refused) and deletes nothing.
	dctx, dcancel := context.WithTimeout(ctx, time.Second)
	if err := rjs.DeleteStream(dctx, subjects.StreamBES); err == nil {
		t.Fatal("the reader deleted a stream")
	}
	dcancel()
	for len(violations) > 0 {
		<-violations
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if info.State.Msgs != 1 {
		t.Fatalf("BES holds %d messages, want the one real event", info.State.Msgs)
	}
	// Nor fetch from a service's consumer (and so acknowledge on it).
	next := "$JS.API.CONSUMER.MSG.NEXT." + subjects.StreamBES + ".rows"
	if err := reader.PublishRequest(next, reader.NewRespInbox(), []byte(`{"batch":1}`)); err != nil {
		t.Fatal(err)
	}
	reader.Flush()
	select {
	case err := <-violations:
		if !errors.Is(err, nats.ErrPermissionViolation) || !strings.Contains(err.Error(), next) {
			t.Fatalf("reader's fetch from a service consumer: %v, want a permissions violation naming %s", err, next)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the reader's fetch from a service consumer was not refused")
	}
	// The reader sees what the service publishes live.
	if err := bb.Publisher().Publish(ctx, &nats.Msg{Subject: subject, Data: []byte("real 2"),
		Header: nats.Header{jetstream.MsgIDHeader: {"default/inv-1/2"}}}); err != nil {
		t.Fatal(err)
	}
	if m, err := live.NextMsg(10 * time.Second); err != nil || string(m.Data) != "real 2" {
		t.Fatalf("reader: live subscription: %v", err)
	}

	// A second start finds the same identities.
	svc, rd := bb.ServiceSeedFile, bb.ReaderSeedFile
	bb.Close()
	bb2, err := streams.Open(ctx, streams.Config{DataDir: dir, Listen: "127.0.0.1:0"}, t.Name(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer bb2.Close()
	if bb2.ServiceSeedFile != svc || bb2.ReaderSeedFile != rd {
		t.Fatal("identities moved")
	}
}
