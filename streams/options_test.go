package streams_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// parsed registers the backbone's flags and parses args.
func parsed(t *testing.T, args ...string) streams.Options {
	t.Helper()
	var o streams.Options
	envflagtest.Parse(t, o.RegisterFlags, args...)
	return o
}

// The flags land in Config in its units: days of retention as a max age,
// the sync word as SyncAlways or an interval, the caller's consumers as
// the ones the reader may not touch.
func TestOptionsConfig(t *testing.T) {
	c, err := parsed(t).Config([]string{"a", "b"})
	if err != nil {
		t.Fatal(err)
	}
	if c.URL != "" || c.DataDir != streams.DefaultDataDir || c.Listen != streams.DefaultListen ||
		c.SyncInterval != time.Second || c.SyncAlways || c.Replicas != 1 || c.BESMaxAge != 30*24*time.Hour ||
		c.DuplicateWindow != streams.DefaultDuplicateWindow || c.MaxPayload != streams.DefaultMaxPayload ||
		c.LeaseTTL != streams.DefaultLeaseTTL || !slices.Equal(c.ServiceConsumers, []string{"a", "b"}) {
		t.Fatalf("defaults gave %+v", c)
	}
	// The client's files must exist (ClientAuth.Validate).
	dir := t.TempDir()
	file := func(name string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, nil, 0o600); err != nil {
			t.Fatal(err)
		}
		return p
	}
	want := streams.ClientAuth{NKeySeedFile: file("n"), TLSCA: file("ca"), TLSCert: file("crt"), TLSKey: file("k")}
	c, err = parsed(t, "-nats-url", "nats://x:4222", "-nats-sync", "always", "-retention-raw-days", "7", "-nats-max-payload", "1MiB",
		"-nats-nkey", want.NKeySeedFile, "-nats-tls-ca", want.TLSCA, "-nats-tls-cert", want.TLSCert, "-nats-tls-key", want.TLSKey).Config(nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.URL != "nats://x:4222" || !c.SyncAlways || c.BESMaxAge != 7*24*time.Hour || c.MaxPayload != 1<<20 || c.Auth != want {
		t.Fatalf("flags gave %+v", c)
	}
	creds := file("c")
	if c, err = parsed(t, "-nats-url", "nats://x:4222", "-nats-creds", creds).Config(nil); err != nil || c.Auth != (streams.ClientAuth{CredsFile: creds}) {
		t.Fatalf("-nats-creds gave %+v, %v", c.Auth, err)
	}
	if c, err = parsed(t, "-nats-sync", "250ms").Config(nil); err != nil || c.SyncInterval != 250*time.Millisecond || c.SyncAlways {
		t.Fatalf("-nats-sync 250ms gave %v, %v, %v", c.SyncInterval, c.SyncAlways, err)
	}
}

// A sync word or a retention no Config can hold is a usage error naming
// the flag; what Config.Validate refuses is refused too.
func TestOptionsConfigRefuses(t *testing.T) {
	for _, c := range []struct {
		args  []string
		want  string
		usage bool
	}{
		{[]string{"-nats-sync", "sometimes"}, `--nats-sync ($MILLRACE_NATS_SYNC) "sometimes": want a duration like 1s or "always"`, true},
		{[]string{"-nats-sync", "0s"}, `--nats-sync ($MILLRACE_NATS_SYNC) "0s"`, true},
		{[]string{"-nats-sync", "-1s"}, `--nats-sync ($MILLRACE_NATS_SYNC) "-1s"`, true},
		{[]string{"-retention-raw-days", "0"}, "--retention-raw-days ($RETENTION_RAW_DAYS) must be at least 1", true},
		{[]string{"-nats-lease-ttl", "10ms"}, "lease TTL 10ms is below 1s", false},
	} {
		_, err := parsed(t, c.args...).Config(nil)
		if err == nil || !strings.Contains(err.Error(), c.want) || errors.As(err, new(envflag.UsageError)) != c.usage {
			t.Errorf("%v: %v; want %q (usage error: %v)", c.args, err, c.want, c.usage)
		}
	}
}

// Open opens the backbone the flags name, with the Config it used; a
// configuration it refuses opens nothing.
func TestOptionsOpen(t *testing.T) {
	ns := testenv.NATS(t)
	bb, c, err := parsed(t, "-nats-url", ns.ClientURL()).Open(context.Background(), "test", nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer bb.Close()
	if bb.URL != ns.ClientURL() || c.URL != ns.ClientURL() || !bb.Conn.IsConnected() {
		t.Fatalf("opened %s (config %s, connected %v), want %s", bb.URL, c.URL, bb.Conn.IsConnected(), ns.ClientURL())
	}
	if _, err := bb.JS.Stream(context.Background(), streams.StreamSpecs(c)[0].Name); err != nil {
		t.Fatalf("streams not applied: %v", err)
	}
	// Stream and Reader open one of them, their error naming the stream.
	if r, err := bb.Reader(context.Background(), subjects.StreamBES); err != nil || r.Stream.CachedInfo().Config.Name != subjects.StreamBES {
		t.Fatalf("Reader(%s): %v", subjects.StreamBES, err)
	}
	if _, err := bb.Stream(context.Background(), "NOPE"); !errors.Is(err, jetstream.ErrStreamNotFound) || !strings.HasPrefix(err.Error(), "stream NOPE: ") {
		t.Fatalf("a stream that is not there: %v", err)
	}
	if bb, _, err := parsed(t, "-nats-url", ns.ClientURL(), "-retention-raw-days", "0").Open(context.Background(), "test", nil, nil); err == nil || bb != nil {
		t.Fatalf("a refused configuration opened %v, %v", bb, err)
	}
}
