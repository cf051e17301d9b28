package commits

import (
	"context"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/millrace/millrace/internal/testenv"
	commitspb "github.com/millrace/millrace/schemas/commits"
	"github.com/millrace/millrace/streams"
)

const (
	keyW1  = "key-for-world-w1-0001"
	keyAll = "key-for-all-worlds-0002"
)

// edge is a commits edge on a real JetStream (one server, or the given
// ones), served over gRPC on loopback.
type edge struct {
	srv    *Server
	client commitspb.CommitsClient
	js     jetstream.JetStream
	reg    *prometheus.Registry
}

func testKeys(t testing.TB) Keys {
	t.Helper()
	k, err := ParseKeys("w1=" + keyW1 + ",*=" + keyAll)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

func connect(t testing.TB, url string, replicas int) jetstream.JetStream {
	t.Helper()
	nc, err := nats.Connect(url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{Replicas: replicas})); err != nil {
		t.Fatal(err)
	}
	return js
}

func startEdge(t testing.TB, cfg Config, ns ...*server.Server) *edge {
	t.Helper()
	replicas := 1
	if len(ns) == 0 {
		ns = []*server.Server{testenv.NATS(t)}
	} else if len(ns) >= 3 {
		replicas = 3
	}
	return serveEdge(t, cfg, connect(t, ns[0].ClientURL(), replicas))
}

// serveEdge is another edge on js.
func serveEdge(t testing.TB, cfg Config, js jetstream.JetStream) *edge {
	t.Helper()
	if cfg.Keys.Table == nil {
		cfg.Keys = testKeys(t)
	}
	reg := prometheus.NewRegistry()
	srv, err := New(context.Background(), cfg, js, NewMetrics(reg), nil)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	srv.Register(g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	t.Cleanup(srv.Close)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return &edge{srv: srv, client: commitspb.NewCommitsClient(conn), js: js, reg: reg}
}

// as is a context carrying key.
func as(key string) context.Context {
	return metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+key)
}

func ptr[T any](v T) *T { return &v }
