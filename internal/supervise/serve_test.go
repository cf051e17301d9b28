package supervise

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"io"
	"math/big"
	"net"
	"net/http"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

func healthServer(t *testing.T, c GRPCConfig) *GRPCServer {
	t.Helper()
	c.Addr = "127.0.0.1:0"
	s, err := NewGRPC(c)
	if err != nil {
		t.Fatal(err)
	}
	healthpb.RegisterHealthServer(s.Server, health.NewServer())
	return s
}

func dial(t *testing.T, addr string, creds credentials.TransportCredentials) healthpb.HealthClient {
	t.Helper()
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(creds))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return healthpb.NewHealthClient(conn)
}

// A stop lets a call in progress go on until the deadline, then cuts it;
// Serve then returns nil.
func TestGRPCStopCutsAtTheDeadline(t *testing.T) {
	s := healthServer(t, GRPCConfig{})
	served := make(chan error, 1)
	go func() { served <- s.Serve(context.Background()) }()
	client := dial(t, s.Addr().String(), insecure.NewCredentials())
	watch, err := client.Watch(context.Background(), &healthpb.HealthCheckRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := watch.Recv(); err != nil { // the stream is open
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := s.Stop(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Stop with a stream open: %v, want a cut at the deadline", err)
	}
	if _, err := watch.Recv(); err == nil {
		t.Fatal("the open stream survived the stop")
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve after Stop: %v", err)
	}
	if err := s.Stop(context.Background()); err != nil {
		t.Fatalf("a second Stop: %v", err)
	}
}

// With nothing in progress a stop is graceful and prompt.
func TestGRPCStopGraceful(t *testing.T) {
	s := healthServer(t, GRPCConfig{})
	served := make(chan error, 1)
	go func() { served <- s.Serve(context.Background()) }()
	if _, err := dial(t, s.Addr().String(), insecure.NewCredentials()).Check(context.Background(), &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatal(err)
	}
	if err := s.Stop(context.Background()); err != nil {
		t.Fatalf("graceful Stop: %v", err)
	}
	if err := <-served; err != nil {
		t.Fatalf("Serve: %v", err)
	}
}

// Stop before Serve: Serve returns nil at once and the listener closes.
func TestGRPCStopBeforeServe(t *testing.T) {
	s := healthServer(t, GRPCConfig{})
	s.Stop(context.Background())
	if err := s.Serve(context.Background()); err != nil {
		t.Fatalf("Serve after Stop: %v", err)
	}
	if c, err := net.Dial("tcp", s.Addr().String()); err == nil {
		c.Close()
		t.Fatal("the listener is still open")
	}
}

// With TLS configured the server speaks only TLS; Listener wraps the
// listener.
func TestGRPCTLS(t *testing.T) {
	cert, pool := selfSigned(t)
	wrapped := false
	s := healthServer(t, GRPCConfig{
		TLS:      &tls.Config{Certificates: []tls.Certificate{cert}},
		Listener: func(l net.Listener) (net.Listener, error) { wrapped = true; return l, nil },
	})
	if !wrapped {
		t.Fatal("Listener was not applied")
	}
	go s.Serve(context.Background())
	defer s.Stop(context.Background())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	tlsClient := dial(t, s.Addr().String(), credentials.NewTLS(&tls.Config{RootCAs: pool}))
	if _, err := tlsClient.Check(ctx, &healthpb.HealthCheckRequest{}); err != nil {
		t.Fatalf("TLS client: %v", err)
	}
	plain := dial(t, s.Addr().String(), insecure.NewCredentials())
	if _, err := plain.Check(ctx, &healthpb.HealthCheckRequest{}, grpc.WaitForReady(false)); err == nil {
		t.Fatal("a plaintext client was served")
	}
}

func selfSigned(t *testing.T) (tls.Certificate, *x509.CertPool) {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")}, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, _ := x509.ParseCertificate(der)
	pool := x509.NewCertPool()
	pool.AddCert(leaf)
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, pool
}

// As a component under Run: an HTTP request in progress at the signal
// runs until the deadline, then its connection is closed, and Run returns.
func TestHTTPUnderRun(t *testing.T) {
	inHandler := make(chan struct{})
	release := make(chan struct{})
	defer close(release)
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		close(inHandler)
		<-release
	})
	servers := make(chan *HTTPServer, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{ShutdownTimeout: 50 * time.Millisecond}, Serve("HTTP", func(context.Context) (*HTTPServer, error) {
			s, err := NewHTTP("127.0.0.1:0", &http.Server{Handler: mux}, nil)
			servers <- s
			return s, err
		}))
	}()
	s := <-servers
	reqDone := make(chan error, 1)
	go func() {
		res, err := http.Get("http://" + s.Addr().String() + "/")
		if err == nil {
			_, err = io.ReadAll(res.Body)
			res.Body.Close()
		}
		reqDone <- err
	}()
	<-inHandler
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if err := <-reqDone; err == nil {
		t.Fatal("the request in progress was answered, not cut")
	}
}

// A Listener that fails closes what was listened on, and its error is
// NewGRPC's.
func TestGRPCListenerError(t *testing.T) {
	boom := errors.New("bad cap")
	var addr string
	_, err := NewGRPC(GRPCConfig{Addr: "127.0.0.1:0", Listener: func(l net.Listener) (net.Listener, error) {
		addr = l.Addr().String()
		return nil, boom
	}})
	if !errors.Is(err, boom) {
		t.Fatalf("NewGRPC: %v, want the Listener's error", err)
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		t.Fatalf("the address is still held: %v", err)
	}
	l.Close()
}
