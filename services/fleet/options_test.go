package fleet

import (
	"context"
	"crypto/x509"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
)

func parseOptions(t *testing.T, args ...string) Options {
	t.Helper()
	var o Options
	envflagtest.Parse(t, o.RegisterFlags, args...)
	return o
}

// Load turns the operator's knobs into a Config: a rate sets its burst,
// the listen port names the gateway, the listen host is in the issued
// certificate, and a half pair of CA or TLS files is a usage error naming
// its flags.
func TestOptionsLoad(t *testing.T) {
	dir := t.TempDir()
	o := parseOptions(t, "-fleet-ca-dir", filepath.Join(dir, "ca"), "-fleet-listen", "127.0.0.2:4321",
		"-fleet-join-tokens", "gpu=tok-0123456789abcdef", "-fleet-tls-hosts", "gw.example, 10.0.0.9",
		"-fleet-handshake-rate", "7", "-fleet-join-rate", "3", "-fleet-join-rate-per-client", "2",
		"-fleet-report-rate", "9", "-fleet-tls-resumption=false", "-fleet-max-sessions", "11")
	c, err := o.Load(t.Context(), nil, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	host, _ := os.Hostname()
	if c.GatewayID != host+"-4321" {
		t.Errorf("gateway id %q, want %q", c.GatewayID, host+"-4321")
	}
	if c.HandshakeRate != 7 || c.HandshakeBurst != 7 || c.JoinRate != 3 || c.JoinBurst != 6 || c.JoinRatePerClient != 2 || c.ReportRate != 9 {
		t.Errorf("rates: handshake %v/%d, join %v/%d, per client %v, reports %v", c.HandshakeRate, c.HandshakeBurst, c.JoinRate, c.JoinBurst, c.JoinRatePerClient, c.ReportRate)
	}
	if !c.DisableResumption || c.MaxSessions != 11 {
		t.Errorf("DisableResumption %v, MaxSessions %d", c.DisableResumption, c.MaxSessions)
	}
	if pool, _ := c.JoinTokens.Pool("tok-0123456789abcdef"); pool != "gpu" {
		t.Errorf("the join token admits to %q", pool)
	}
	cert, err := x509.ParseCertificate(c.TLS.Certificates[0].Certificate[0])
	if err != nil {
		t.Fatal(err)
	}
	var ips []string
	for _, ip := range cert.IPAddresses {
		ips = append(ips, ip.String())
	}
	if !slices.Contains(cert.DNSNames, "gw.example") || !slices.Contains(ips, "10.0.0.9") || !slices.Contains(ips, "127.0.0.2") {
		t.Errorf("the server certificate names %v and %v", cert.DNSNames, ips)
	}

	o = parseOptions(t, "-fleet-ca-cert", filepath.Join(dir, "ca.crt"))
	_, err = o.Load(t.Context(), nil, slog.Default())
	var usage envflag.UsageError
	if !errors.As(err, &usage) || usage.Msg != "--fleet-ca-cert and --fleet-ca-key go together" {
		t.Fatalf("a CA certificate without its key: %v, want the usage error", err)
	}
	for _, half := range [][]string{{"-fleet-tls-cert", "x.pem"}, {"-fleet-tls-key", "x.key"}} {
		o = parseOptions(t, append([]string{"-fleet-ca-dir", filepath.Join(dir, "ca")}, half...)...)
		_, err = o.Load(t.Context(), nil, slog.Default())
		if !errors.As(err, &usage) || usage.Msg != "--fleet-tls-cert and --fleet-tls-key go together" {
			t.Fatalf("%v without the rest of its pair: %v, want the usage error", half, err)
		}
	}
}

// A started gateway serves sessions, and Stop drains them while its loops
// still run: the disconnect is stored before Stop returns.
func TestStartServesAndStopDrains(t *testing.T) {
	ns := testenv.NATS(t)
	bb, err := streams.Open(t.Context(), streams.Config{URL: ns.ClientURL()}, t.Name(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(bb.Close)
	dir := t.TempDir()
	o := parseOptions(t, "-fleet-ca-dir", dir, "-fleet-listen", "127.0.0.1:0", "-fleet-gateway-id", "gw-start")
	gw, err := Start(t.Context(), o, bb, prometheus.NewRegistry(), nil, slog.Default())
	if err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- gw.Serve(context.Background()) }()

	ca, err := LoadOrCreateCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	certPEM, keyPEM, err := ca.NodeCredentials("node-s", "gpu")
	if err != nil {
		t.Fatal(err)
	}
	tc, err := NodeTLS(ca.CertPEM(), certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(gw.Addr().String(), grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	c := openSession(t, conn, helloMsg(testHello("node-s", "gpu")))
	if w := c.welcome(); w.GetGatewayId() != "gw-start" {
		t.Fatalf("welcomed by %q", w.GetGatewayId())
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := gw.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve: %v", err)
	}
	b := &backbone{ns: ns, nc: bb.Conn, js: bb.JS, pub: bb.Publisher()}
	var disconnected int
	for _, e := range b.nodeEvents(t) {
		if e.ev.GetDisconnected() != nil && e.ev.GetNodeId() == "node-s" {
			disconnected++
		}
	}
	if disconnected != 1 {
		t.Fatalf("%d disconnects of node-s stored when Stop returned, want 1", disconnected)
	}
}
