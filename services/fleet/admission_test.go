package fleet

import (
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams"
)

// Sessions without the right certificate are refused "unauthenticated"
// and publish nothing.
func TestUnauthenticatedSessionsRefused(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	otherCA, err := NewCA("another CA")
	if err != nil {
		t.Fatal(err)
	}
	noCert, err := NodeTLS(testCA().CertPEM(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name  string
		conn  func(t *testing.T) *client
		code  codes.Code
		words string
	}{
		{"no client certificate", func(t *testing.T) *client {
			return openSession(t, gw.dial(t, noCert), helloMsg(testHello("n1", "p")))
		}, codes.Unauthenticated, "no client certificate"},
		{"certificate from another CA", func(t *testing.T) *client {
			return openSession(t, gw.nodeConn(t, otherCA, "n1", "p"), helloMsg(testHello("n1", "p")))
		}, codes.Unauthenticated, "not accepted"},
		{"certificate for another node", func(t *testing.T) *client {
			return openSession(t, gw.nodeConn(t, nil, "n2", "p"), helloMsg(testHello("n1", "p")))
		}, codes.PermissionDenied, "certificate is for node"},
		{"certificate for another pool", func(t *testing.T) *client {
			return openSession(t, gw.nodeConn(t, nil, "n1", "q"), helloMsg(testHello("n1", "p")))
		}, codes.PermissionDenied, "certificate is for node"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r, err := tc.conn(t).refused()
			checkRefusal(t, r, err, CodeUnauthenticated, tc.code)
			if !strings.Contains(r.GetReason(), tc.words) {
				t.Errorf("reason %q does not say %q", r.GetReason(), tc.words)
			}
		})
	}
	if evs := b.nodeEvents(t); len(evs) != 0 {
		t.Fatalf("%d events stored for refused sessions", len(evs))
	}
}

// Malformed sessions are refused "invalid".
func TestMalformedSessionsRefused(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{HelloTimeout: 300 * time.Millisecond})
	tooManyGPUs := testHello("n1", "p")
	tooManyGPUs.Gpus = nil
	for i := range MaxGPUs + 1 {
		tooManyGPUs.Gpus = append(tooManyGPUs.Gpus, &fleetpb.Gpu{Index: uint32(i)})
	}
	dupIndex := testHello("n1", "p")
	dupIndex.Gpus[1].Index = 0
	tooManyLabels := testHello("n1", "p")
	for i := range MaxLabels + 1 {
		tooManyLabels.Labels["k"+itoa(i)] = "v"
	}
	badID := testHello("n1", "p")
	badID.NodeId = "n1\x07"
	emptyPool := testHello("n1", "p")
	emptyPool.Pool = ""
	longModel := testHello("n1", "p")
	longModel.Gpus[0].Model = strings.Repeat("m", MaxModelLen+1)
	badAlloc := testHello("n1", "p")
	badAlloc.Allocations = []string{""}

	for _, tc := range []struct {
		name  string
		first *fleetpb.NodeMessage
		words string
	}{
		{"first message not a Hello", &fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Heartbeat{Heartbeat: &fleetpb.Heartbeat{Seq: 1}}}, "must be a Hello"},
		{"empty first message", &fleetpb.NodeMessage{}, "must be a Hello"},
		{"control character in node id", helloMsg(badID), "control character"},
		{"empty pool", helloMsg(emptyPool), "pool is empty"},
		{"too many GPUs", helloMsg(tooManyGPUs), "GPUs"},
		{"duplicate GPU index", helloMsg(dupIndex), "appears twice"},
		{"too many labels", helloMsg(tooManyLabels), "labels"},
		{"long model", helloMsg(longModel), "model"},
		{"empty allocation id", helloMsg(badAlloc), "allocation id"},
		{"no Hello in time", nil, "no Hello within"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := openSession(t, gw.nodeConn(t, nil, "n1", "p"), tc.first)
			r, err := c.refused()
			checkRefusal(t, r, err, CodeInvalid, codes.InvalidArgument)
			if !strings.Contains(r.GetReason(), tc.words) {
				t.Errorf("reason %q does not say %q", r.GetReason(), tc.words)
			}
		})
	}

	t.Run("message over the size limit", func(t *testing.T) {
		big := testHello("n1", "p")
		big.AgentVersion = strings.Repeat("v", DefaultMaxMessageBytes)
		err := openSession(t, gw.nodeConn(t, nil, "n1", "p"), helloMsg(big)).end()
		if status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("status %v, want RESOURCE_EXHAUSTED from gRPC", err)
		}
	})

	t.Run("invalid message after the Hello", func(t *testing.T) {
		c, _ := gw.connect(t, "n1", "p")
		c.send(allocMsg("a1", fleetpb.AllocationState_ALLOCATION_STATE_PENDING))
		r, err := c.refused()
		checkRefusal(t, r, err, CodeInvalid, codes.InvalidArgument)
		got := b.waitEvents(t, "disconnect", 1, is(kindDisconnected))
		if got[0].ev.GetDisconnected().GetReason() != reasonError {
			t.Fatalf("disconnect %v", got[0].ev)
		}
	})
}

// Beyond MaxSessions a session is refused "sessions_full" with RetryInfo.
func TestSessionsFull(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{MaxSessions: 2})
	first, _ := gw.connect(t, "n1", "p")
	gw.connect(t, "n2", "p")
	c := openSession(t, gw.nodeConn(t, nil, "n3", "p"), helloMsg(testHello("n3", "p")))
	r, err := c.refused()
	checkRefusal(t, r, err, CodeSessionsFull, codes.ResourceExhausted)
	base := refusalBase[CodeSessionsFull]
	if d := r.GetRetryAfter().AsDuration(); d < base || d > DefaultMaxRetryAfter {
		t.Fatalf("retry_after %s, want within [%s, %s]", d, base, DefaultMaxRetryAfter)
	}
	// A session that ends makes room.
	first.st.CloseSend()
	first.end()
	poll.Until(t, "room", func() bool { return gw.srv.Sessions() < 2 })
	gw.connect(t, "n3", "p")
}

// The handshake token bucket refuses "handshake_rate".
func TestHandshakeRate(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{HandshakeRate: 0.001, HandshakeBurst: 2})
	gw.connect(t, "n1", "p")
	gw.connect(t, "n2", "p")
	r, err := openSession(t, gw.nodeConn(t, nil, "n3", "p"), helloMsg(testHello("n3", "p"))).refused()
	checkRefusal(t, r, err, CodeHandshakeRate, codes.ResourceExhausted)
	if d := r.GetRetryAfter().AsDuration(); d < time.Second || d > DefaultMaxRetryAfter {
		t.Fatalf("retry_after %s", d)
	}
}

// gatedPublisher holds Connected events until released.
type gatedPublisher struct {
	*streams.Publisher
	once    sync.Once
	held    chan struct{}
	release chan struct{}
}

func (g *gatedPublisher) PublishAsync(m *nats.Msg) (*streams.Future, error) {
	if m.Header.Get(envelope.Kind) == envelope.KindNode {
		g.once.Do(func() { close(g.held) })
		<-g.release
	}
	return g.Publisher.PublishAsync(m)
}

// Hellos beyond MaxHellosInFlight (waiting for the backbone here) are
// refused "hellos_in_flight".
func TestHellosInFlight(t *testing.T) {
	b := newBackbone(t)
	gate := &gatedPublisher{Publisher: b.pub, held: make(chan struct{}), release: make(chan struct{})}
	gw := startGateway(t, b, Config{MaxHellosInFlight: 1}, withPublisher(gate))
	slow := openSession(t, gw.nodeConn(t, nil, "n1", "p"), helloMsg(testHello("n1", "p")))
	<-gate.held
	r, err := openSession(t, gw.nodeConn(t, nil, "n2", "p"), helloMsg(testHello("n2", "p"))).refused()
	checkRefusal(t, r, err, CodeHellosInFlight, codes.ResourceExhausted)
	close(gate.release)
	slow.welcome()
}

// The retry_after of load refusals grows with the load and is spread out.
func TestRetryAfterSpreads(t *testing.T) {
	s := &Server{cfg: Config{HandshakeRate: 100, MaxRetryAfter: DefaultMaxRetryAfter}}
	seen := map[time.Duration]bool{}
	var last time.Duration
	for range 1000 {
		d := s.retryAfter(CodeHandshakeRate)
		if d < time.Second || d > DefaultMaxRetryAfter {
			t.Fatalf("retry_after %s out of range", d)
		}
		seen[d] = true
		last = max(last, d)
	}
	if len(seen) < 900 {
		t.Fatalf("only %d distinct retry_after values of 1000", len(seen))
	}
	// 1000 refusals in well under a second at 100/s: up to ~10 s of spread.
	if last < 5*time.Second {
		t.Fatalf("largest retry_after %s under a storm of 1000 refusals at 100/s", last)
	}
	for range 100 {
		if d := s.retryAfter(CodeDraining); d < 0 || d >= maxDrainRetry {
			t.Fatalf("draining retry_after %s", d)
		}
	}
}

// Join exchanges a good token and CSR for a certificate that opens a
// session; a bad token is UNAUTHENTICATED, a bad CSR INVALID_ARGUMENT.
func TestJoin(t *testing.T) {
	b := newBackbone(t)
	tokens, err := ParseJoinTokens("gpu=tok-0123456789abcdef, cpu = tok-fedcba9876543210")
	if err != nil {
		t.Fatal(err)
	}
	gw := startGateway(t, b, Config{JoinTokens: tokens, NodeCertValidity: 48 * time.Hour})
	noCert, err := NodeTLS(testCA().CertPEM(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	api := fleetpb.NewGatewayClient(gw.dial(t, noCert))
	ctx := t.Context()

	csr, key, err := NewNodeCSR("node-j")
	if err != nil {
		t.Fatal(err)
	}
	res, err := api.Join(ctx, &fleetpb.JoinRequest{Token: "tok-0123456789abcdef", NodeId: "node-j", Csr: csr})
	if err != nil {
		t.Fatal(err)
	}
	if res.GetPool() != "gpu" || string(res.GetCa()) != string(testCA().CertPEM()) {
		t.Fatalf("join response pool %q", res.GetPool())
	}
	if left := time.Until(res.GetNotAfter().AsTime()); left < 47*time.Hour || left > 48*time.Hour {
		t.Fatalf("certificate valid for %s more, want 48h", left)
	}
	tc, err := NodeTLS(res.GetCa(), res.GetCertificate(), key)
	if err != nil {
		t.Fatal(err)
	}
	c := openSession(t, gw.dial(t, tc), helloMsg(testHello("node-j", "gpu")))
	c.welcome()

	for _, tc := range []struct {
		name string
		req  *fleetpb.JoinRequest
		code codes.Code
	}{
		{"bad token", &fleetpb.JoinRequest{Token: "tok-0123456789abcdeX", NodeId: "node-j", Csr: csr}, codes.Unauthenticated},
		{"no token", &fleetpb.JoinRequest{NodeId: "node-j", Csr: csr}, codes.Unauthenticated},
		{"garbage csr", &fleetpb.JoinRequest{Token: "tok-0123456789abcdef", NodeId: "node-j", Csr: []byte("not a csr")}, codes.InvalidArgument},
		{"bad signature", &fleetpb.JoinRequest{Token: "tok-0123456789abcdef", NodeId: "node-j", Csr: tamper(t, csr)}, codes.InvalidArgument},
		{"bad node id", &fleetpb.JoinRequest{Token: "tok-0123456789abcdef", NodeId: "a\nb", Csr: csr}, codes.InvalidArgument},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := api.Join(ctx, tc.req)
			if status.Code(err) != tc.code {
				t.Fatalf("status %v, want %s", err, tc.code)
			}
		})
	}
}
