package commits

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
	"github.com/millrace/millrace/internal/testenv"
	commitspb "github.com/millrace/millrace/schemas/commits"
	"github.com/millrace/millrace/streams"
)

func parseOptions(t *testing.T, args ...string) Options {
	t.Helper()
	envflagtest.Clean(t)
	var o Options
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	o.RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return o
}

// Start serves what the flags say: without keys it refuses to start, a
// certificate without its key is a usage error, and with DevSecrets it
// makes a key for every world that then opens both APIs.
func TestStart(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	bb := &streams.Backbone{JS: connect(t, testenv.NATS(t).ClientURL(), 1)}
	start := func(o Options) (*Edge, error) {
		return Start(ctx, o, bb, nil, prometheus.NewRegistry(), nil, nil)
	}
	if e, err := start(parseOptions(t, "-commits-listen", "127.0.0.1:0")); err == nil || !strings.Contains(err.Error(), "no API keys") {
		if e != nil {
			e.Stop(ctx)
		}
		t.Fatalf("no keys: %v", err)
	}
	half := parseOptions(t, "-commits-listen", "127.0.0.1:0", "-commits-api-keys", "*="+keyAll, "-commits-tls-cert", "cert.pem")
	if _, err := start(half); !errors.As(err, new(envflag.UsageError)) || !strings.Contains(err.Error(), "--commits-tls-cert and --commits-tls-key go together") {
		t.Fatalf("a certificate without its key: %v", err)
	}

	o := parseOptions(t, "-commits-listen", "127.0.0.1:0")
	o.DevSecrets = t.TempDir()
	e, err := start(o)
	if err != nil {
		t.Fatal(err)
	}
	go e.Serve(ctx)
	defer e.Stop(context.Background())
	b, err := os.ReadFile(filepath.Join(o.DevSecrets, "commits-api-keys"))
	if err != nil {
		t.Fatal(err)
	}
	key := strings.TrimPrefix(strings.TrimSpace(string(b)), "*=")
	conn, err := grpc.NewClient(e.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := commitspb.NewCommitsClient(conn).Put(as(key), &commitspb.PutRequest{World: "w", Id: "d", Body: []byte("v")}); err != nil {
		t.Fatalf("gRPC Put with the development key: %v", err)
	}
	mux := http.NewServeMux()
	e.Mount(mux)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	res, body := httpClient{t: t, srv: srv, key: key}.do("GET", "/v1/worlds/w/docs/d", "")
	if res.StatusCode != http.StatusOK || body != "v" {
		t.Fatalf("HTTP Get of the version put over gRPC: %d %q", res.StatusCode, body)
	}
}

// TestStartFitsStockMaxPayload: against a server left at NATS's stock
// max_payload of 1 MiB the edge starts with its body limit lowered (its
// default of 1 MiB does not fit beside the headers), warns naming the
// server's setting, and refuses a larger body over gRPC and HTTP with a
// message that names it.
func TestStartFitsStockMaxPayload(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ns := testenv.NATSWith(t, func(o *server.Options) { o.MaxPayload = 1 << 20 })
	bb, err := streams.Open(ctx, streams.Config{URL: ns.ClientURL()}, t.Name(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer bb.Close()
	var logs bytes.Buffer
	e, err := Start(ctx, parseOptions(t, "-commits-listen", "127.0.0.1:0", "-commits-api-keys", "*="+keyAll),
		bb, nil, prometheus.NewRegistry(), nil, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatalf("the edge on a server at 1 MiB: %v", err)
	}
	for _, want := range []string{"level=WARN", "lowered from 1048576 to 983040 bytes", "max_payload (1048576 bytes)"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the log lacks %q:\n%s", want, logs.String())
		}
	}
	go e.Serve(ctx)
	defer e.Stop(context.Background())
	conn, err := grpc.NewClient(e.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := commitspb.NewCommitsClient(conn)
	if _, err := client.Put(as(keyAll), &commitspb.PutRequest{World: "w", Id: "fits", Body: bytes.Repeat([]byte("x"), 900<<10)}); err != nil {
		t.Fatalf("a body of 900 KiB: %v", err)
	}
	_, err = client.Put(as(keyAll), &commitspb.PutRequest{World: "w", Id: "over", Body: bytes.Repeat([]byte("x"), 1000<<10)})
	if msg := status.Convert(err).Message(); status.Code(err) != codes.InvalidArgument || !strings.Contains(msg, "limit of 983040") || !strings.Contains(msg, "max_payload") {
		t.Fatalf("a body of 1000 KiB over gRPC: %v, want INVALID_ARGUMENT naming the limit and max_payload", err)
	}
	mux := http.NewServeMux()
	e.Mount(mux)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	res, body := httpClient{t: t, srv: srv, key: keyAll}.do("PUT", "/v1/worlds/w/docs/over", strings.Repeat("x", 1000<<10))
	if res.StatusCode != http.StatusRequestEntityTooLarge || !strings.Contains(body, "max_payload") {
		t.Fatalf("a body of 1000 KiB over HTTP: %d %s, want 413 naming max_payload", res.StatusCode, body)
	}
}
