package bes

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"log/slog"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/prometheus/client_golang/prometheus"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// parseOptions registers the edge's flags and parses args.
func parseOptions(t *testing.T, args ...string) Options {
	t.Helper()
	var o Options
	envflagtest.Parse(t, o.RegisterFlags, args...)
	return o
}

// Start refuses half a TLS pair as a mistake in the command line, naming
// both flags; with redaction off it serves, and its log says that events
// are stored with their secrets.
func TestStart(t *testing.T) {
	ctx := testCtx(t)
	bb, err := streams.Open(ctx, streams.Config{URL: testenv.NATS(t).ClientURL()}, t.Name(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer bb.Close()

	_, err = Start(ctx, parseOptions(t, "-bes-listen", "127.0.0.1:0", "-bes-tls-cert", "cert.pem"), bb, nil, nil, nil)
	var usage envflag.UsageError
	if !errors.As(err, &usage) || !strings.Contains(err.Error(), "--bes-tls-cert and --bes-tls-key go together") {
		t.Fatalf("a certificate without its key: %v, want a usage error naming both flags", err)
	}

	var logs bytes.Buffer
	log := slog.New(slog.NewTextHandler(&logs, nil))
	g, err := Start(ctx, parseOptions(t, "-bes-listen", "127.0.0.1:0", "-bes-api-keys", "p=0123456789abcdef", "-bes-redact=false"),
		bb, prometheus.NewRegistry(), nil, log)
	if err != nil {
		t.Fatal(err)
	}
	if err := g.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`msg="BES edge serving"`, "api_keys=1", "tls=false", "redaction=false", `msg="BES redaction is off`} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the log lacks %s:\n%s", want, logs.String())
		}
	}
}

// selfSigned writes a certificate for 127.0.0.1 and its key into dir.
func selfSigned(t *testing.T, dir string) (certFile, keyFile string, pool *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "127.0.0.1"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage:    x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	pool = x509.NewCertPool()
	pool.AddCert(cert)
	return certFile, keyFile, pool
}

// With --bes-tls-cert and --bes-tls-key the edge serves TLS only: a client
// that trusts the certificate publishes, a plaintext one is not served.
func TestStartServesTLS(t *testing.T) {
	ctx := testCtx(t)
	bb, err := streams.Open(ctx, streams.Config{URL: testenv.NATS(t).ClientURL()}, t.Name(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer bb.Close()
	cert, key, pool := selfSigned(t, t.TempDir())
	g, err := Start(ctx, parseOptions(t, "-bes-listen", "127.0.0.1:0", "-bes-tls-cert", cert, "-bes-tls-key", key), bb, nil, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(ctx)
	defer g.Stop(context.Background())
	publish := func(creds credentials.TransportCredentials) error {
		conn, err := grpc.NewClient(g.Addr().String(), grpc.WithTransportCredentials(creds))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		_, err = buildpb.NewPublishBuildEventClient(conn).PublishLifecycleEvent(cctx, enqueued(defaultIDs()))
		return err
	}
	if err := publish(credentials.NewTLS(&tls.Config{RootCAs: pool})); err != nil {
		t.Fatalf("a client trusting the certificate: %v", err)
	}
	if err := publish(insecure.NewCredentials()); status.Code(err) != codes.Unavailable {
		t.Fatalf("a plaintext client: %v, want UNAVAILABLE", err)
	}
}

// TestStartFitsStockMaxPayload: against a server left at NATS's stock
// max_payload of 1 MiB the edge starts (its default event limit of 4 MiB
// does not fit), warns naming the server's setting, stores an event that
// fits and refuses a larger one with a message that names that setting.
func TestStartFitsStockMaxPayload(t *testing.T) {
	ctx := testCtx(t)
	ns := testenv.NATSWith(t, func(o *server.Options) { o.MaxPayload = 1 << 20 })
	bb, err := streams.Open(ctx, streams.Config{URL: ns.ClientURL()}, t.Name(), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer bb.Close()
	b := connectBackbone(t, ns, 5*time.Second)

	var logs bytes.Buffer
	g, err := Start(ctx, parseOptions(t, "-bes-listen", "127.0.0.1:0"), bb, nil, nil, slog.New(slog.NewTextHandler(&logs, nil)))
	if err != nil {
		t.Fatalf("an edge on a server at 1 MiB: %v", err)
	}
	const limit = 1<<20 - streams.HeaderRoom
	for _, want := range []string{"level=WARN", "lowered from 4194304 to 983040 bytes", "max_payload (1048576 bytes)"} {
		if !strings.Contains(logs.String(), want) {
			t.Errorf("the log lacks %q:\n%s", want, logs.String())
		}
	}
	go g.Serve(ctx)
	defer g.Stop(context.Background())
	conn, err := grpc.NewClient(g.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := buildpb.NewPublishBuildEventClient(conn)

	for _, c := range []struct {
		invocation string
		size       int
		fits       bool
	}{{"fits", 900 << 10, true}, {"over", limit + 16<<10, false}} {
		id := defaultIDs()
		id.invocation = c.invocation
		ev := toolReqWith(id, 2, &buildpb.BuildEvent{EventTime: eventTime,
			Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: bazelEvent(2, strings.Repeat("x", c.size))}})
		r := publish(ctx, t, client, []*buildpb.PublishBuildToolEventStreamRequest{toolReq(id, 1), ev, finishReq(id, 3)})
		subject := subjects.BES(testProject, id.invocation)
		if c.fits {
			if r.err != nil {
				t.Fatalf("an event of %d bytes: %v", c.size, r.err)
			}
			if n := b.count(t, subject); n != 3 {
				t.Fatalf("%s holds %d events, want 3", subject, n)
			}
			continue
		}
		wantCode(t, r.err, codes.InvalidArgument, "over the limit of 983040 bytes", "max_payload")
		for _, s := range b.toolSeqs(t, subject) {
			if s > 1 {
				t.Fatalf("event %d of %s stored", s, subject)
			}
		}
	}
}
