package commits

import (
	"context"
	"errors"
	"flag"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

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
