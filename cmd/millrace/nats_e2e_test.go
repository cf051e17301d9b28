package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// TestDevNATSIdentities: dev's embedded NATS server refuses anonymous
// connections; the reader identity it made under var/nats/auth reads the
// streams, and its publish of a forged build event is a permissions
// violation, and so is its delete of the compactor's durable consumer
// under the name --compactor-durable gives it.
func TestDevNATSIdentities(t *testing.T) {
	dev := newDev(t, testenv.Database(t))
	dev.args = append(dev.args, "--compactor-durable=folder")
	dev.start()
	reader := filepath.Join(filepath.Dir(dev.natsNKey), streams.ReaderSeedFile)
	waitUntil(t, "the reader identity", func() bool {
		_, err := os.Stat(reader)
		return err == nil
	})
	var err error
	waitUntil(t, "the embedded server refusing anonymous connections", func() bool {
		var nc *nats.Conn
		nc, err = nats.Connect(dev.natsURL, nats.Timeout(2*time.Second))
		if err == nil {
			nc.Close()
			t.Fatal("dev's embedded NATS admitted an anonymous connection")
		}
		return errors.Is(err, nats.ErrAuthorization) || strings.Contains(strings.ToLower(err.Error()), "authorization")
	})
	seed, err := nats.NkeyOptionFromSeed(reader)
	if err != nil {
		t.Fatal(err)
	}
	violations := make(chan error, 4)
	nc, err := nats.Connect(dev.natsURL, seed, nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { violations <- err }))
	if err != nil {
		t.Fatalf("reader: %v", err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	if _, err := js.Stream(ctx, subjects.StreamBES); err != nil {
		t.Fatalf("reader: stream info BES: %v", err)
	}
	subject := subjects.BES("default", "forged")
	if err := nc.Publish(subject, []byte("forged")); err != nil {
		t.Fatal(err)
	}
	nc.Flush()
	select {
	case err := <-violations:
		if !errors.Is(err, nats.ErrPermissionViolation) {
			t.Fatalf("reader's publish: %v, want a permissions violation", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the reader's publish of a forged event was not refused")
	}
	dctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	js.DeleteConsumer(dctx, subjects.StreamCommits, "folder") // the request is refused: it times out
	select {
	case err := <-violations:
		if !errors.Is(err, nats.ErrPermissionViolation) || !strings.Contains(err.Error(), "folder") {
			t.Fatalf("reader's delete of the compactor's consumer: %v, want a permissions violation", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the reader's delete of the compactor's consumer (--compactor-durable) was not refused")
	}
	dev.stop()
}
