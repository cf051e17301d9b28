package agent_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"sync"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/agent"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// testCA is a throwaway CA that signs the fake gateway's server certificate
// and node certificates.
type testCA struct {
	cert    *x509.Certificate
	key     *ecdsa.PrivateKey
	certPEM []byte
	pool    *x509.CertPool
	ticket  [32]byte // the session ticket key every fake gateway of this CA shares, as real ones do
}

func newTestCA(t testing.TB) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "test fleet CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	ca := &testCA{cert: cert, key: key, certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pool: x509.NewCertPool()}
	ca.pool.AddCert(cert)
	rand.Read(ca.ticket[:])
	return ca
}

var serialMu sync.Mutex
var serialN int64 = 1

func nextSerial() *big.Int {
	serialMu.Lock()
	defer serialMu.Unlock()
	serialN++
	return big.NewInt(serialN)
}

func (ca *testCA) sign(t testing.TB, tmpl *x509.Certificate, pub any) []byte {
	t.Helper()
	der, err := ca.trySign(tmpl, pub)
	if err != nil {
		t.Fatal(err)
	}
	return der
}

func (ca *testCA) trySign(tmpl *x509.Certificate, pub any) ([]byte, error) {
	tmpl.SerialNumber = nextSerial()
	tmpl.NotBefore = time.Now().Add(-time.Hour)
	tmpl.NotAfter = time.Now().Add(24 * time.Hour)
	return x509.CreateCertificate(rand.Reader, tmpl, ca.cert, pub, ca.key)
}

func (ca *testCA) serverTLS(t testing.TB) *tls.Config {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	der := ca.sign(t, &x509.Certificate{
		Subject:     pkix.Name{CommonName: "gateway"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		DNSNames:    []string{"localhost"},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, &key.PublicKey)
	tc := &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}},
		ClientCAs:    ca.pool,
		ClientAuth:   tls.VerifyClientCertIfGiven, // Join needs no client certificate
		MinVersion:   tls.VersionTLS12,
	}
	tc.SetSessionTicketKeys([][32]byte{ca.ticket})
	return tc
}

func (ca *testCA) nodeCert(t testing.TB, nodeID, pool string) *tls.Certificate {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	der := ca.sign(t, &x509.Certificate{
		Subject:     pkix.Name{CommonName: nodeID, OrganizationalUnit: []string{pool}},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, &key.PublicKey)
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// received is one node message as the fake gateway got it.
type received struct {
	msg *fleetpb.NodeMessage
	at  time.Time
}

// fakeSession is one Session call on the fake gateway.
type fakeSession struct {
	hello    *fleetpb.Hello
	peerCN   string
	resumed  bool // the TLS session was resumed from a ticket
	start    time.Time
	refused  bool
	out      chan *fleetpb.GatewayMessage
	end      chan ending
	recvDone chan struct{} // the node half-closed or went away

	mu   sync.Mutex
	msgs []received
}

func (s *fakeSession) received() []received {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]received(nil), s.msgs...)
}

func (s *fakeSession) heartbeats() []received {
	var hb []received
	for _, r := range s.received() {
		if r.msg.GetHeartbeat() != nil {
			hb = append(hb, r)
		}
	}
	return hb
}

func (s *fakeSession) statuses() []*fleetpb.StatusReport {
	var st []*fleetpb.StatusReport
	for _, r := range s.received() {
		if m := r.msg.GetStatus(); m != nil {
			st = append(st, m)
		}
	}
	return st
}

func (s *fakeSession) reports() []*fleetpb.AllocationReport {
	var rs []*fleetpb.AllocationReport
	for _, r := range s.received() {
		if m := r.msg.GetAllocation(); m != nil {
			rs = append(rs, m)
		}
	}
	return rs
}

func (s *fakeSession) halfClosed() bool {
	select {
	case <-s.recvDone:
		return true
	default:
		return false
	}
}

// ending ends a session: msg (if any) is sent first, then the stream ends
// with err.
type ending struct {
	msg *fleetpb.GatewayMessage
	err error
}

// fakeGateway serves service Gateway over TLS the way the contract says,
// with knobs for refusing and for staying silent.
type fakeGateway struct {
	fleetpb.UnimplementedGatewayServer
	name     string
	ca       *testCA
	srv      *grpc.Server
	addr     string
	interval time.Duration

	mu sync.Mutex
	// refuse, when set, is asked for every session; a non-nil Refusal
	// refuses it. statusOnly sends no Refusal message, only the status.
	refuse     func(n int, h *fleetpb.Hello) *fleetpb.Refusal
	statusOnly bool
	noAcks     bool
	sessions   []*fakeSession
}

func startGateway(t *testing.T, ca *testCA, name string, interval time.Duration) *fakeGateway {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := &fakeGateway{name: name, ca: ca, addr: lis.Addr().String(), interval: interval}
	g.srv = grpc.NewServer(grpc.Creds(credentials.NewTLS(ca.serverTLS(t))))
	fleetpb.RegisterGatewayServer(g.srv, g)
	go g.srv.Serve(lis)
	t.Cleanup(g.srv.Stop)
	return g
}

func (g *fakeGateway) all() []*fakeSession {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]*fakeSession(nil), g.sessions...)
}

func (g *fakeGateway) count() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return len(g.sessions)
}

func (g *fakeGateway) last() *fakeSession {
	g.mu.Lock()
	defer g.mu.Unlock()
	if len(g.sessions) == 0 {
		return nil
	}
	return g.sessions[len(g.sessions)-1]
}

func (g *fakeGateway) Join(ctx context.Context, req *fleetpb.JoinRequest) (*fleetpb.JoinResponse, error) {
	if req.GetToken() != "good-token" {
		return nil, status.Error(codes.Unauthenticated, "bad join token")
	}
	block, _ := pem.Decode(req.GetCsr())
	if block == nil || block.Type != "CERTIFICATE REQUEST" {
		return nil, status.Error(codes.InvalidArgument, "csr: want a PEM CERTIFICATE REQUEST")
	}
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil || csr.CheckSignature() != nil {
		return nil, status.Error(codes.InvalidArgument, "csr: bad signature")
	}
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: req.GetNodeId(), OrganizationalUnit: []string{"pool-a"}},
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := g.ca.trySign(tmpl, csr.PublicKey)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &fleetpb.JoinResponse{
		Certificate: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		Ca:          g.ca.certPEM,
		NotAfter:    timestamppb.New(time.Now().Add(24 * time.Hour)),
		Pool:        "pool-a",
	}, nil
}

func (g *fakeGateway) Session(stream fleetpb.Gateway_SessionServer) error {
	first, err := stream.Recv()
	if err != nil {
		return err
	}
	hello := first.GetHello()
	if hello == nil {
		return status.Error(codes.InvalidArgument, "first message must be a Hello")
	}
	s := &fakeSession{
		hello: hello, start: time.Now(),
		out: make(chan *fleetpb.GatewayMessage, 1024), end: make(chan ending, 1), recvDone: make(chan struct{}),
	}
	if p, ok := peer.FromContext(stream.Context()); ok {
		if ti, ok := p.AuthInfo.(credentials.TLSInfo); ok && len(ti.State.PeerCertificates) > 0 {
			s.peerCN = ti.State.PeerCertificates[0].Subject.CommonName
			s.resumed = ti.State.DidResume
		}
	}
	g.mu.Lock()
	n := len(g.sessions)
	g.sessions = append(g.sessions, s)
	refuse, statusOnly, noAcks := g.refuse, g.statusOnly, g.noAcks
	g.mu.Unlock()
	if s.peerCN != hello.GetNodeId() {
		return status.Errorf(codes.Unauthenticated, "certificate names %q, Hello %q", s.peerCN, hello.GetNodeId())
	}
	if refuse != nil {
		if r := refuse(n, hello); r != nil {
			s.refused = true
			if !statusOnly {
				if err := stream.Send(&fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Refusal{Refusal: r}}); err != nil {
					return err
				}
			}
			st, _ := status.New(codes.ResourceExhausted, r.GetReason()).WithDetails(&errdetails.RetryInfo{RetryDelay: r.GetRetryAfter()})
			return st.Err()
		}
	}
	if err := stream.Send(&fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Welcome{Welcome: &fleetpb.Welcome{
		GatewayId: g.name, SessionId: fmt.Sprintf("%s-%d", g.name, n), HeartbeatInterval: durationpb.New(g.interval),
	}}}); err != nil {
		return err
	}
	go func() {
		defer close(s.recvDone)
		for {
			m, err := stream.Recv()
			if err != nil {
				return
			}
			s.mu.Lock()
			s.msgs = append(s.msgs, received{m, time.Now()})
			s.mu.Unlock()
			if noAcks {
				continue
			}
			var seq uint64
			switch {
			case m.GetHeartbeat() != nil:
				seq = m.GetHeartbeat().GetSeq()
			case m.GetStatus() != nil:
				seq = m.GetStatus().GetSeq()
			default:
				continue
			}
			s.out <- &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Ack{Ack: &fleetpb.Ack{Seq: seq}}}
		}
	}()
	for {
		select {
		case m := <-s.out:
			if err := stream.Send(m); err != nil {
				return err
			}
		case e := <-s.end:
			if e.msg != nil {
				if err := stream.Send(e.msg); err != nil {
					return err
				}
			}
			return e.err
		case <-s.recvDone:
			return nil
		case <-stream.Context().Done():
			return stream.Context().Err()
		}
	}
}

func bindCmd(id string, gpus ...uint32) *fleetpb.GatewayMessage {
	return &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Command{Command: &fleetpb.Command{
		AllocationId: id, ReservationId: "r-" + id, Action: &fleetpb.Command_Bind{Bind: &fleetpb.Bind{GpuIndices: gpus}},
	}}}
}

func unbindCmd(id string) *fleetpb.GatewayMessage {
	return &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Command{Command: &fleetpb.Command{
		AllocationId: id, Action: &fleetpb.Command_Unbind{Unbind: &fleetpb.Unbind{Reason: "cancelled"}},
	}}}
}

// recorder is an Observer that keeps every event.
type recorder struct {
	mu           sync.Mutex
	connected    []fakeEvent
	disconnected []fakeEvent
	refused      []fakeEvent
	bound        []fakeEvent
	unbound      []fakeEvent
	heartbeats   []time.Time
}

type fakeEvent struct {
	at time.Time
	ev any
}

func (r *recorder) add(list *[]fakeEvent, at time.Time, ev any) {
	r.mu.Lock()
	*list = append(*list, fakeEvent{at, ev})
	r.mu.Unlock()
}

func (r *recorder) get(list *[]fakeEvent) []fakeEvent {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]fakeEvent(nil), *list...)
}

func (r *recorder) beats() []time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]time.Time(nil), r.heartbeats...)
}

func (r *recorder) Connected(e agent.ConnectedEvent)       { r.add(&r.connected, e.At, e) }
func (r *recorder) Disconnected(e agent.DisconnectedEvent) { r.add(&r.disconnected, e.At, e) }
func (r *recorder) Refused(e agent.RefusedEvent)           { r.add(&r.refused, e.At, e) }
func (r *recorder) Bound(e agent.BoundEvent)               { r.add(&r.bound, e.At, e) }
func (r *recorder) Unbound(e agent.UnboundEvent)           { r.add(&r.unbound, e.At, e) }
func (r *recorder) HeartbeatSent(_ uint64, at time.Time) {
	r.mu.Lock()
	r.heartbeats = append(r.heartbeats, at)
	r.mu.Unlock()
}

var errBusy = errors.New("gpu busy")
