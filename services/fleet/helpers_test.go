package fleet

import (
	"context"
	"crypto/tls"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The tests run real gateways over TLS against an embedded JetStream
// server, with nodes as real gRPC clients holding certificates from a test
// CA; what they assert is what reached the streams.

// testCA is one CA per test binary: making keys is the slow part of a test.
var testCA = sync.OnceValue(func() *CA {
	ca, err := NewCA("millrace test fleet CA")
	if err != nil {
		panic(err)
	}
	return ca
})

type backbone struct {
	ns  *server.Server
	nc  *nats.Conn
	js  jetstream.JetStream
	pub *streams.Publisher
}

func newBackbone(t testing.TB) *backbone {
	t.Helper()
	ns := testenv.NATS(t)
	nc, err := streams.Connect(ns.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncMaxPending(streams.DefaultMaxPending),
		jetstream.WithPublishAsyncTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	return &backbone{ns: ns, nc: nc, js: js, pub: streams.NewPublisher(js, nil)}
}

// stored returns every message of a stream, in order.
func (b *backbone) stored(t testing.TB, stream string) []*jetstream.RawStreamMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	st, err := b.js.Stream(ctx, stream)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []*jetstream.RawStreamMsg
	if info.State.Msgs == 0 {
		return nil
	}
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, m)
	}
	return out
}

// storedEvent is a NodeEvent with its message.
type storedEvent struct {
	msg *jetstream.RawStreamMsg
	ev  *fleetpb.NodeEvent
}

func (b *backbone) nodeEvents(t testing.TB) []storedEvent {
	t.Helper()
	var out []storedEvent
	for _, m := range b.stored(t, subjects.StreamFleetNodes) {
		if m.Header.Get(envelope.Kind) != envelope.KindNode {
			continue
		}
		ev := &fleetpb.NodeEvent{}
		if err := proto.Unmarshal(m.Data, ev); err != nil {
			t.Fatalf("stored NodeEvent %d: %v", m.Sequence, err)
		}
		out = append(out, storedEvent{msg: m, ev: ev})
	}
	return out
}

func (b *backbone) liveness(t testing.TB) []*fleetpb.LivenessBatch {
	t.Helper()
	var out []*fleetpb.LivenessBatch
	for _, m := range b.stored(t, subjects.StreamFleetNodes) {
		if m.Header.Get(envelope.Kind) != envelope.KindLiveness {
			continue
		}
		lb := &fleetpb.LivenessBatch{}
		if err := proto.Unmarshal(m.Data, lb); err != nil {
			t.Fatalf("stored LivenessBatch %d: %v", m.Sequence, err)
		}
		out = append(out, lb)
	}
	return out
}

// waitEvents polls until at least n stored node events match and returns
// the matching ones.
func (b *backbone) waitEvents(t testing.TB, what string, n int, match func(*fleetpb.NodeEvent) bool) []storedEvent {
	t.Helper()
	var got []storedEvent
	poll.Until(t, what, func() bool {
		got = got[:0]
		for _, e := range b.nodeEvents(t) {
			if match(e.ev) {
				got = append(got, e)
			}
		}
		return len(got) >= n
	})
	return got
}

func (b *backbone) publishDecision(t testing.TB, d *fleetpb.PlacementDecision) {
	t.Helper()
	data, err := proto.Marshal(d)
	if err != nil {
		t.Fatal(err)
	}
	msg := &nats.Msg{Subject: subjects.FleetPlace(d.GetPool()), Data: data, Header: nats.Header{
		envelope.MsgID:       {d.GetDecisionId()},
		envelope.Schema:      {envelope.SchemaFleetV1},
		envelope.Kind:        {envelope.KindDecision},
		envelope.Pool:        {d.GetPool()},
		envelope.Reservation: {d.GetReservationId()},
	}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := b.pub.Publish(ctx, msg); err != nil {
		t.Fatal(err)
	}
}

func is(kind string) func(*fleetpb.NodeEvent) bool {
	return func(ev *fleetpb.NodeEvent) bool {
		switch kind {
		case kindConnected:
			return ev.GetConnected() != nil
		case kindDisconnected:
			return ev.GetDisconnected() != nil
		case kindStatus:
			return ev.GetStatusChanged() != nil
		case kindAllocation:
			return ev.GetAllocation() != nil
		}
		return false
	}
}

// gateway is one gateway serving on a loopback port with Run going.
type gateway struct {
	srv     *Server
	g       *grpc.Server
	addr    string
	b       *backbone
	reg     *prometheus.Registry
	cancel  context.CancelFunc
	runDone chan error
	stopped atomic.Bool
}

type option func(*Server)

// fakeClock is a settable clock for heartbeat ages.
type fakeClock struct{ ns atomic.Int64 }

func (c *fakeClock) Now() time.Time    { return time.Unix(0, c.ns.Load()) }
func (c *fakeClock) Set(t time.Time)   { c.ns.Store(t.UnixNano()) }
func withClock(c *fakeClock) option    { return func(s *Server) { s.now = c.Now } }
func withPublisher(p Publisher) option { return func(s *Server) { s.pub = p } }

func startGateway(t testing.TB, b *backbone, cfg Config, opts ...option) *gateway {
	t.Helper()
	if cfg.CA == nil {
		cfg.CA = testCA()
	}
	if cfg.TLS == nil {
		tc, err := cfg.CA.ServerTLS([]string{"127.0.0.1"})
		if err != nil {
			t.Fatal(err)
		}
		cfg.TLS = tc
	}
	if cfg.GatewayID == "" {
		cfg.GatewayID = "gw-test"
	}
	reg := prometheus.NewRegistry()
	srv, err := New(cfg, b.pub, b.js, NewMetrics(reg), nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range opts {
		o(srv)
	}
	g := grpc.NewServer(srv.ServerOptions()...)
	srv.Register(g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	ctx, cancel := context.WithCancel(context.Background())
	gw := &gateway{srv: srv, g: g, addr: lis.Addr().String(), b: b, reg: reg, cancel: cancel, runDone: make(chan error, 1)}
	go func() { gw.runDone <- srv.Run(ctx) }()
	t.Cleanup(gw.stop)
	return gw
}

// stop drains the gateway (if a test did not) and stops it.
func (gw *gateway) stop() {
	if gw.stopped.Swap(true) {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	gw.srv.Drain(ctx)
	gw.g.Stop()
	gw.cancel()
	<-gw.runDone
}

// dial connects to the gateway with a client TLS configuration.
func (gw *gateway) dial(t testing.TB, tc *tls.Config) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient(gw.addr, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return conn
}

// nodeConn dials as node id of pool, with a certificate from ca (the test
// CA when nil).
func (gw *gateway) nodeConn(t testing.TB, ca *CA, id, pool string) *grpc.ClientConn {
	t.Helper()
	if ca == nil {
		ca = testCA()
	}
	certPEM, keyPEM, err := ca.NodeCredentials(id, pool)
	if err != nil {
		t.Fatal(err)
	}
	tc, err := NodeTLS(testCA().CertPEM(), certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	return gw.dial(t, tc)
}

// client is a node's side of a session: a goroutine reads every message,
// and then the end of the stream, in order.
type client struct {
	t   testing.TB
	st  fleetpb.Gateway_SessionClient
	in  chan received
	seq uint64
}

// received is a message or, last, the stream's end (err; io.EOF for OK).
type received struct {
	msg *fleetpb.GatewayMessage
	err error
}

func openSession(t testing.TB, conn *grpc.ClientConn, first *fleetpb.NodeMessage) *client {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st, err := fleetpb.NewGatewayClient(conn).Session(ctx)
	if err != nil {
		t.Fatal(err)
	}
	c := &client{t: t, st: st, in: make(chan received, 4096)}
	go func() {
		for {
			m, err := st.Recv()
			c.in <- received{msg: m, err: err}
			if err != nil {
				return
			}
		}
	}()
	if first != nil {
		c.send(first)
	}
	return c
}

func helloMsg(h *fleetpb.Hello) *fleetpb.NodeMessage {
	return &fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Hello{Hello: h}}
}

func testHello(id, pool string) *fleetpb.Hello {
	return &fleetpb.Hello{
		NodeId:       id,
		Pool:         pool,
		Labels:       map[string]string{"zone": "a", "rack": "r1"},
		AgentVersion: "test/1",
		Gpus: []*fleetpb.Gpu{
			{Index: 0, Model: "H100", MemoryMib: 81920, Health: fleetpb.GpuHealth_GPU_HEALTH_OK, Uuid: "GPU-0"},
			{Index: 1, Model: "H100", MemoryMib: 81920, Health: fleetpb.GpuHealth_GPU_HEALTH_OK, Uuid: "GPU-1"},
		},
	}
}

// connect opens a session for node id of pool and waits for its Welcome.
func (gw *gateway) connect(t testing.TB, id, pool string) (*client, *fleetpb.Welcome) {
	t.Helper()
	c := openSession(t, gw.nodeConn(t, nil, id, pool), helloMsg(testHello(id, pool)))
	return c, c.welcome()
}

func (c *client) recv() received {
	c.t.Helper()
	select {
	case r := <-c.in:
		return r
	case <-time.After(15 * time.Second):
		c.t.Fatal("nothing from the gateway")
	}
	return received{}
}

// next is the next message from the gateway (failing on the end of the
// stream).
func (c *client) next() *fleetpb.GatewayMessage {
	c.t.Helper()
	r := c.recv()
	if r.err != nil {
		c.t.Fatalf("session ended: %v", r.err)
	}
	return r.msg
}

func (c *client) welcome() *fleetpb.Welcome {
	c.t.Helper()
	m := c.next()
	if m.GetWelcome() == nil {
		c.t.Fatalf("expected Welcome, got %v", m)
	}
	return m.GetWelcome()
}

// refused expects a Refusal and then the end of the stream.
func (c *client) refused() (*fleetpb.Refusal, error) {
	c.t.Helper()
	r := c.recv()
	if r.err != nil {
		c.t.Fatalf("stream ended without a Refusal: %v", r.err)
	}
	if r.msg.GetRefusal() == nil {
		c.t.Fatalf("expected a Refusal, got %v", r.msg)
	}
	return r.msg.GetRefusal(), c.end()
}

// end waits for the end of the stream, skipping messages; io.EOF means OK.
func (c *client) end() error {
	c.t.Helper()
	for {
		if r := c.recv(); r.err != nil {
			return r.err
		}
	}
}

func (c *client) heartbeat() {
	c.t.Helper()
	c.seq++
	c.send(&fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Heartbeat{Heartbeat: &fleetpb.Heartbeat{Seq: c.seq}}})
}

func (c *client) send(m *fleetpb.NodeMessage) {
	c.t.Helper()
	// io.EOF: the gateway ended the stream; Recv tells why.
	if err := c.st.Send(m); err != nil && !errors.Is(err, io.EOF) {
		c.t.Fatal(err)
	}
}

// expectAck waits for the ack of seq.
func (c *client) expectAck(seq uint64) {
	c.t.Helper()
	m := c.next()
	if m.GetAck() == nil || m.GetAck().GetSeq() != seq {
		c.t.Fatalf("expected Ack %d, got %v", seq, m)
	}
}

// sync sends a heartbeat and waits for its ack: everything the gateway
// sent before has then been received, and everything sent before has been
// handled. Messages before the ack are returned.
func (c *client) sync() []*fleetpb.GatewayMessage {
	c.t.Helper()
	c.heartbeat()
	var before []*fleetpb.GatewayMessage
	for {
		m := c.next()
		if a := m.GetAck(); a != nil && a.GetSeq() == c.seq {
			return before
		}
		before = append(before, m)
	}
}

// checkRefusal checks a refusal and the status that followed it.
func checkRefusal(t testing.TB, r *fleetpb.Refusal, err error, code string, grpcCode codes.Code) {
	t.Helper()
	if r.GetCode() != code {
		t.Fatalf("refusal code %q (%s), want %q", r.GetCode(), r.GetReason(), code)
	}
	if status.Code(err) != grpcCode {
		t.Fatalf("status %v, want %s", err, grpcCode)
	}
	d, ok := RetryAfter(err)
	if !ok {
		t.Fatalf("status %v carries no RetryInfo", err)
	}
	if d != r.GetRetryAfter().AsDuration() {
		t.Fatalf("RetryInfo %s differs from the Refusal's retry_after %s", d, r.GetRetryAfter().AsDuration())
	}
	if !strings.Contains(status.Convert(err).Message(), code) {
		t.Fatalf("status message %q does not name %q", status.Convert(err).Message(), code)
	}
}

// counter reads a counter of the gateway's metrics by name and the value of
// its one label (or the sum over all when label is "").
func counter(t testing.TB, reg *prometheus.Registry, name, label string) float64 {
	t.Helper()
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, f := range families {
		if f.GetName() != name {
			continue
		}
		for _, m := range f.GetMetric() {
			if label == "" || (len(m.GetLabel()) == 1 && m.GetLabel()[0].GetValue() == label) {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}
