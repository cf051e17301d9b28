package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/services/bes"
	"github.com/millrace/millrace/services/commits"
	"github.com/millrace/millrace/services/fleet"
	"github.com/millrace/millrace/services/reservations"
	"github.com/millrace/millrace/streams"
)

// testBackbone opens the backbone on a fresh embedded server.
func testBackbone(t *testing.T, tel *telemetry) *streams.Backbone {
	t.Helper()
	ns := testenv.NATS(t)
	var no streams.Options
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	no.RegisterFlags(fs)
	if err := fs.Parse([]string{"-nats-url", ns.ClientURL()}); err != nil {
		t.Fatal(err)
	}
	bb, _, err := no.Open(context.Background(), "test", serviceConsumers(), tel.sm)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(bb.Close)
	return bb
}

// parseFlags registers and parses args for one option group.
func parseFlags(t *testing.T, register func(*flag.FlagSet), args ...string) {
	t.Helper()
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	register(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	if err := envflag.Errors(fs); err != nil {
		t.Fatal(err)
	}
}

// replaceFile writes path anew and renames it into place, as an operator's
// tooling or a secret mount does.
func replaceFile(t *testing.T, path, text string) {
	t.Helper()
	if err := os.WriteFile(path+".tmp", []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(path+".tmp", path); err != nil {
		t.Fatal(err)
	}
}

func lifecycle(project string) *buildpb.PublishLifecycleEventRequest {
	return &buildpb.PublishLifecycleEventRequest{ProjectId: project, BuildEvent: &buildpb.OrderedBuildEvent{
		StreamId:       &buildpb.StreamId{BuildId: "b1", InvocationId: "i1"},
		SequenceNumber: 1,
		Event:          &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BuildEnqueued_{BuildEnqueued: &buildpb.BuildEvent_BuildEnqueued{}}},
	}}
}

// A key removed from the BES keys file is refused from the next request
// on, and one added is accepted, with no restart.
func TestBESKeysReloadWithoutRestart(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tel := newTelemetry()
	bb := testBackbone(t, tel)
	keys := filepath.Join(t.TempDir(), "bes-keys")
	const keyA, keyB = "alpha-key-0123456789", "bravo-key-0123456789"
	replaceFile(t, keys, "alpha="+keyA+"\n")
	var bo bes.Options
	parseFlags(t, bo.RegisterFlags, "-bes-listen", "127.0.0.1:0", "-bes-api-keys-file", keys)
	edge, err := bes.Start(ctx, bo, bb, tel.reg, tel.kf, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	go edge.Serve(ctx)
	defer edge.Stop(context.Background())
	conn, err := grpc.NewClient(edge.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := buildpb.NewPublishBuildEventClient(conn)
	publish := func(key string) codes.Code {
		ctx := metadata.AppendToOutgoingContext(ctx, bes.APIKeyHeader, key)
		_, err := client.PublishLifecycleEvent(ctx, lifecycle(""))
		return status.Code(err)
	}
	if c := publish(keyA); c != codes.OK {
		t.Fatalf("key A at start: %v", c)
	}
	if c := publish(keyB); c != codes.Unauthenticated {
		t.Fatalf("key B before it is added: %v", c)
	}
	replaceFile(t, keys, "bravo="+keyB+"\n")
	poll.Until(t, "key A refused", func() bool { return publish(keyA) == codes.Unauthenticated })
	if c := publish(keyB); c != codes.OK {
		t.Fatalf("key B after it was added: %v", c)
	}
	// A file that no longer parses, or holds no key, keeps B in force.
	replaceFile(t, keys, "not a key line\n")
	poll.Until(t, "the bad file counted", func() bool { return testenv.Metric(t, tel.reg, "millrace_keyfile_reload_errors_total") >= 1 })
	replaceFile(t, keys, "# every key removed\n")
	poll.Until(t, "the empty file counted", func() bool { return testenv.Metric(t, tel.reg, "millrace_keyfile_reload_errors_total") >= 2 })
	if c := publish(keyB); c != codes.OK {
		t.Fatalf("key B after a bad file: %v", c)
	}
}

// The real Bazel publishes to the edge over TLS (grpcs://, trusting the
// test's CA with --tls_certificate), and the build is projected as Bazel
// reported it; a plaintext client is not served.
func TestBazelOverTLS(t *testing.T) {
	needBazel(t)
	db := testenv.Database(t)
	dev := newDev(t, db)
	ca, cert, key := testCA(t, t.TempDir())
	dev.env = append(dev.env, "MILLRACE_BES_TLS_CERT="+cert, "MILLRACE_BES_TLS_KEY="+key)
	dev.start()

	conn, err := grpc.NewClient(dev.besAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	pctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := buildpb.NewPublishBuildEventClient(conn).PublishLifecycleEvent(pctx, lifecycle("")); status.Code(err) != codes.Unavailable {
		t.Fatalf("a plaintext client: %v, want UNAVAILABLE", err)
	}

	run := newBazelRun(t, 10, dev.besAddr)
	bazelTLSRC(t, run.opt.Dir)
	run.opt.Extra = append(run.opt.Extra, "--bes_backend=grpcs://"+dev.besAddr, "--tls_certificate="+ca)
	code, out := run.start(t)()
	run.checkExit(t, code, out, " over TLS", dev.output())
	run.checkProjection(t, db)
	dev.stop()
}

// Without keys, the edge will not listen beyond loopback unless told to,
// and the error says what to do.
func TestBESRefusesOpenListenerWithoutKeys(t *testing.T) {
	tel := newTelemetry()
	bb := testBackbone(t, tel)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var bo bes.Options
	parseFlags(t, bo.RegisterFlags, "-bes-listen", "0.0.0.0:0")
	_, err := bes.Start(ctx, bo, bb, tel.reg, tel.kf, slog.Default())
	if err == nil || !strings.Contains(err.Error(), "--bes-insecure-open") || !strings.Contains(err.Error(), "--bes-api-keys-file") {
		t.Fatalf("keyless edge on 0.0.0.0: %v; want a refusal naming --bes-api-keys-file and --bes-insecure-open", err)
	}
	var open bes.Options
	parseFlags(t, open.RegisterFlags, "-bes-listen", "0.0.0.0:0", "-bes-insecure-open")
	fresh := newTelemetry() // each edge registers its metrics: a registry of its own
	e, err := bes.Start(ctx, open, bb, fresh.reg, fresh.kf, slog.Default())
	if err != nil {
		t.Fatalf("with --bes-insecure-open: %v", err)
	}
	e.Stop(context.Background())
	var keyed bes.Options
	parseFlags(t, keyed.RegisterFlags, "-bes-listen", "0.0.0.0:0", "-bes-api-keys", "p=0123456789abcdef")
	fresh = newTelemetry()
	e, err = bes.Start(ctx, keyed, bb, fresh.reg, fresh.kf, slog.Default())
	if err != nil {
		t.Fatalf("with keys: %v", err)
	}
	e.Stop(context.Background())
}

// bazelTLSRC lets Debian's Bazel 4.2.3 speak TLS: its Netty finds no ALPN in
// the JDK ("JDK provider does not support ALPN protocol") and needs
// OpenSSL through netty-tcnative (package libnetty-tcnative-jni). Netty
// looks for libnetty_tcnative.so, Debian installs libnetty-tcnative.so,
// and the library refuses to run under a name it does not expect (a
// symbolic link resolves to the Debian name): a copy under Netty's name,
// on the library path of the Bazel server, set in the workspace's rc file.
func bazelTLSRC(t *testing.T, dir string) {
	t.Helper()
	libs, _ := filepath.Glob("/usr/lib/*/jni/libnetty-tcnative.so")
	if len(libs) == 0 {
		t.Skip("SKIPPED: no libnetty-tcnative.so -- Bazel over TLS did not run; apt-get install libnetty-tcnative-jni (scripts/deps.sh test does)")
	}
	lib, err := os.ReadFile(libs[0])
	if err != nil {
		t.Fatal(err)
	}
	jni := filepath.Join(t.TempDir(), "jni")
	if err := os.MkdirAll(jni, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(jni, "libnetty_tcnative.so"), lib, 0o755); err != nil {
		t.Fatal(err)
	}
	rc := "startup --host_jvm_args=-Djava.library.path=/usr/share/bazel:" + jni + "\n"
	// The workspace is a directory of dir: the one whose WORKSPACE names it.
	wss, _ := filepath.Glob(filepath.Join(dir, "*", "WORKSPACE"))
	for _, ws := range wss {
		if b, err := os.ReadFile(ws); err == nil && strings.Contains(string(b), "workspace(name") {
			if err := os.WriteFile(filepath.Join(filepath.Dir(ws), ".bazelrc"), []byte(rc), 0o644); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
	t.Fatal("no generated WORKSPACE found")
}

// The same for the commits API's keys, over its HTTP API.
func TestCommitsKeysReloadWithoutRestart(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tel := newTelemetry()
	bb := testBackbone(t, tel)
	keys := filepath.Join(t.TempDir(), "commits-keys")
	const keyA, keyB = "alpha-key-0123456789", "bravo-key-0123456789"
	replaceFile(t, keys, "*="+keyA+"\n")
	var co commits.Options
	parseFlags(t, co.RegisterFlags, "-commits-listen", "127.0.0.1:0", "-commits-api-keys-file", keys)
	ce, err := commits.Start(ctx, co, bb, nil, tel.reg, tel.kf, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	go ce.Serve(ctx)
	defer ce.Stop(context.Background())
	mux := http.NewServeMux()
	ce.Mount(mux)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	n := 0
	put := func(key string) int {
		n++
		req, _ := http.NewRequest("PUT", fmt.Sprintf("%s/v1/worlds/w/docs/d%d", srv.URL, n), strings.NewReader("v"))
		req.Header.Set("Authorization", "Bearer "+key)
		res, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		res.Body.Close()
		return res.StatusCode
	}
	if c := put(keyA); c/100 != 2 {
		t.Fatalf("key A at start: %d", c)
	}
	if c := put(keyB); c != http.StatusUnauthorized {
		t.Fatalf("key B before it is added: %d", c)
	}
	replaceFile(t, keys, "*="+keyB+"\n")
	poll.Until(t, "key A refused", func() bool { return put(keyA) == http.StatusUnauthorized })
	if c := put(keyB); c/100 != 2 {
		t.Fatalf("key B after it was added: %d", c)
	}
}

// Join tokens and reservation API keys reload from their files like the
// other keys: the gateway and the API hold the very sets the watcher swaps.
func TestJoinTokensAndReservationKeysReload(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tel := newTelemetry()
	dir := t.TempDir()
	tokens, keys := filepath.Join(dir, "join-tokens"), filepath.Join(dir, "api-keys")
	const tokA, tokB = "prod=token-a-0123456789abcdef", "prod=token-b-0123456789abcdef"
	replaceFile(t, tokens, tokA+"\n")
	replaceFile(t, keys, "ci=resv-key-a-0123456789\n")

	var fo fleet.Options
	parseFlags(t, fo.RegisterFlags, "-fleet-ca-dir", filepath.Join(dir, "ca"), "-fleet-join-tokens-file", tokens)
	fc, err := fo.Load(ctx, tel.kf, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	pool := func(line string) string {
		_, tok, _ := strings.Cut(line, "=")
		p, _ := fc.JoinTokens.Pool(tok)
		return p
	}
	if pool(tokA) != "prod" || pool(tokB) != "" {
		t.Fatalf("at start: token A admits to %q, token B to %q", pool(tokA), pool(tokB))
	}
	replaceFile(t, tokens, tokB+"\n")
	poll.Until(t, "token A refused", func() bool { return pool(tokA) == "" })
	if pool(tokB) != "prod" {
		t.Fatal("token B not admitted after it was added")
	}

	var ro reservations.Options
	parseFlags(t, ro.RegisterFlags, "-fleet-api-keys-file", keys)
	rc, err := ro.Load(ctx, tel.kf, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	if rc.Keys.Len() != 1 {
		t.Fatalf("%d reservation keys at start", rc.Keys.Len())
	}
	replaceFile(t, keys, "ci=resv-key-b-0123456789\nops=resv-key-c-0123456789\n")
	poll.Until(t, "the reservation keys reloaded", func() bool { return rc.Keys.Len() == 2 })
}
