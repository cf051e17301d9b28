package fleetsim_test

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/subjects"
)

// testCA is a throwaway fleet CA, also written to files for Config.CACert
// and CAKey.
type testCA struct {
	cert              *x509.Certificate
	key               *ecdsa.PrivateKey
	certPEM           []byte
	pool              *x509.CertPool
	certFile, keyFile string
	serial            atomic.Int64
}

func newTestCA(t *testing.T) *testCA {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test fleet CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature, BasicConstraintsValid: true, IsCA: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	ca := &testCA{cert: cert, key: key, certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), pool: x509.NewCertPool()}
	ca.pool.AddCert(cert)
	ca.serial.Store(1)
	dir := t.TempDir()
	ca.certFile, ca.keyFile = filepath.Join(dir, "ca.pem"), filepath.Join(dir, "ca-key.pem")
	kder, _ := x509.MarshalPKCS8PrivateKey(key)
	if err := os.WriteFile(ca.certFile, ca.certPEM, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(ca.keyFile, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600); err != nil {
		t.Fatal(err)
	}
	return ca
}

func (ca *testCA) sign(tmpl *x509.Certificate, pub any) ([]byte, error) {
	tmpl.SerialNumber = big.NewInt(ca.serial.Add(1))
	tmpl.NotBefore, tmpl.NotAfter = time.Now().Add(-time.Hour), time.Now().Add(24*time.Hour)
	return x509.CreateCertificate(rand.Reader, tmpl, ca.cert, pub, ca.key)
}

func (ca *testCA) serverTLS(t *testing.T) *tls.Config {
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	der, err := ca.sign(&x509.Certificate{
		Subject: pkix.Name{CommonName: "gateway"}, IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}, &key.PublicKey)
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Config{
		Certificates: []tls.Certificate{{Certificate: [][]byte{der}, PrivateKey: key}},
		ClientCAs:    ca.pool, ClientAuth: tls.VerifyClientCertIfGiven, MinVersion: tls.VersionTLS12,
	}
}

// fakeFleet is a gateway, a reservations API and a placer in one: enough
// of the real services for the simulator to measure something. It writes
// fleet_nodes.last_seen the way the liveness projector would (batched),
// publishes PlacementDecisions on NATS and binds through the sessions.
type fakeFleet struct {
	fleetpb.UnimplementedGatewayServer
	fleetpb.UnimplementedReservationsServer
	t        *testing.T
	ca       *testCA
	pool     string
	gpus     int
	interval time.Duration
	addr     string
	resvAddr string
	nc       *nats.Conn
	db       *pgxpool.Pool

	refuseFirst atomic.Int64 // refuse this many Hellos (handshake_rate)
	joins       atomic.Int64
	// markUnreachable, when set, is a node the fake marks unreachable in
	// fleet_nodes on its first heartbeat (it never was down).
	markUnreachable string

	mu       sync.Mutex
	sessions map[string]*fakeSession // node -> live session
	heard    map[string]time.Time
	used     map[string]map[uint32]string // node -> gpu -> allocation
	resv     map[string][]*fleetpb.Allocation
	live     map[string]*fleetpb.Allocation // allocation id -> live allocation
	placed   int
	nextID   int
}

type fakeSession struct {
	out chan *fleetpb.GatewayMessage
}

func startFleet(t *testing.T, ca *testCA, pool string, gpus int, interval time.Duration, nc *nats.Conn, db *pgxpool.Pool) *fakeFleet {
	t.Helper()
	f := &fakeFleet{
		t: t, ca: ca, pool: pool, gpus: gpus, interval: interval, nc: nc, db: db,
		sessions: map[string]*fakeSession{}, heard: map[string]time.Time{},
		used: map[string]map[uint32]string{}, resv: map[string][]*fleetpb.Allocation{},
		live: map[string]*fleetpb.Allocation{},
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f.addr = lis.Addr().String()
	gs := grpc.NewServer(grpc.Creds(credentials.NewTLS(ca.serverTLS(t))))
	fleetpb.RegisterGatewayServer(gs, f)
	go gs.Serve(lis)
	t.Cleanup(gs.Stop)

	rl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	f.resvAddr = rl.Addr().String()
	rs := grpc.NewServer()
	fleetpb.RegisterReservationsServer(rs, f)
	go rs.Serve(rl)
	t.Cleanup(rs.Stop)

	if db != nil {
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go f.flushLiveness(ctx, done)
		t.Cleanup(func() { cancel(); <-done })
	}
	return f
}

func (f *fakeFleet) Join(_ context.Context, req *fleetpb.JoinRequest) (*fleetpb.JoinResponse, error) {
	if req.GetToken() != "tok" {
		return nil, status.Error(codes.Unauthenticated, "bad token")
	}
	block, _ := pem.Decode(req.GetCsr())
	if block == nil {
		return nil, status.Error(codes.InvalidArgument, "no CSR")
	}
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, status.Error(codes.InvalidArgument, err.Error())
	}
	// Refuse every other first call, as a rate-limited gateway would.
	if f.joins.Add(1)%2 == 1 {
		st, _ := status.New(codes.ResourceExhausted, "join rate").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(20 * time.Millisecond)})
		return nil, st.Err()
	}
	der, err := f.ca.sign(&x509.Certificate{
		Subject:  pkix.Name{CommonName: req.GetNodeId(), OrganizationalUnit: []string{f.pool}},
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}, csr.PublicKey)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return &fleetpb.JoinResponse{
		Certificate: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), Ca: f.ca.certPEM,
		NotAfter: timestamppb.New(time.Now().Add(24 * time.Hour)), Pool: f.pool,
	}, nil
}

func (f *fakeFleet) Session(stream fleetpb.Gateway_SessionServer) error {
	m, err := stream.Recv()
	if err != nil {
		return err
	}
	h := m.GetHello()
	p, _ := peer.FromContext(stream.Context())
	ti, _ := p.AuthInfo.(credentials.TLSInfo)
	if h == nil || len(ti.State.PeerCertificates) == 0 || ti.State.PeerCertificates[0].Subject.CommonName != h.GetNodeId() {
		return status.Error(codes.Unauthenticated, "Hello does not match the certificate")
	}
	if len(h.GetGpus()) != f.gpus || h.GetPool() != f.pool {
		return status.Errorf(codes.InvalidArgument, "Hello: %d GPUs, pool %q", len(h.GetGpus()), h.GetPool())
	}
	if f.refuseFirst.Add(-1) >= 0 {
		r := &fleetpb.Refusal{Code: "handshake_rate", Reason: "slow down", RetryAfter: durationpb.New(50 * time.Millisecond)}
		if err := stream.Send(&fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Refusal{Refusal: r}}); err != nil {
			return err
		}
		st, _ := status.New(codes.ResourceExhausted, "slow down").WithDetails(&errdetails.RetryInfo{RetryDelay: r.GetRetryAfter()})
		return st.Err()
	}
	node := h.GetNodeId()
	s := &fakeSession{out: make(chan *fleetpb.GatewayMessage, 256)}
	if f.db != nil {
		_, err := f.db.Exec(stream.Context(), `insert into fleet_nodes (node_id, pool, state, state_since, first_seen, last_seen)
			values ($1, $2, 'healthy', now(), now(), now())
			on conflict (pool, node_id) do update set last_seen = now()`, node, f.pool)
		if err != nil {
			return status.Error(codes.Internal, err.Error())
		}
	}
	// Register the session and reconcile, as the real gateway does after a
	// re-home: unbind what the node holds that is no longer live, resend
	// the binds it has not confirmed.
	f.mu.Lock()
	f.sessions[node] = s
	held := map[string]bool{}
	for _, id := range h.GetAllocations() {
		held[id] = true
		if f.live[id] == nil {
			s.out <- unbindMsg(id)
		}
	}
	for _, al := range f.live {
		if al.NodeId == node && !held[al.Id] {
			s.out <- bindMsg(al)
		}
	}
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		if f.sessions[node] == s {
			delete(f.sessions, node)
		}
		f.mu.Unlock()
	}()
	if err := stream.Send(&fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Welcome{Welcome: &fleetpb.Welcome{
		GatewayId: "fake", SessionId: node + "-" + fmt.Sprint(time.Now().UnixNano()), HeartbeatInterval: durationpb.New(f.interval),
	}}}); err != nil {
		return err
	}
	recvDone := make(chan error, 1)
	go func() {
		for {
			m, err := stream.Recv()
			if err != nil {
				recvDone <- err
				return
			}
			if hb := m.GetHeartbeat(); hb != nil {
				f.mu.Lock()
				f.heard[node] = time.Now()
				f.mu.Unlock()
				s.out <- &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Ack{Ack: &fleetpb.Ack{Seq: hb.GetSeq()}}}
			}
		}
	}()
	for {
		select {
		case m := <-s.out:
			if err := stream.Send(m); err != nil {
				return err
			}
		case <-recvDone:
			return nil
		}
	}
}

// flushLiveness writes the heartbeats heard into fleet_nodes.last_seen
// every 100 ms, as a liveness batch would.
func (f *fakeFleet) flushLiveness(ctx context.Context, done chan struct{}) {
	defer close(done)
	marked := false
	t := time.NewTicker(100 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		f.mu.Lock()
		var ids []string
		var ts []time.Time
		for id, at := range f.heard {
			ids, ts = append(ids, id), append(ts, at)
		}
		f.heard = map[string]time.Time{}
		f.mu.Unlock()
		if len(ids) == 0 {
			continue
		}
		if _, err := f.db.Exec(ctx, `update fleet_nodes n set last_seen = v.t
			from unnest($1::text[], $2::timestamptz[]) as v(id, t) where n.node_id = v.id`, ids, ts); err != nil && ctx.Err() == nil {
			f.t.Errorf("fake liveness: %v", err)
		}
		if !marked && f.markUnreachable != "" {
			// Once the node has a row (its first session).
			tag, err := f.db.Exec(ctx, `update fleet_nodes set state = 'unreachable', state_since = now() where node_id = $1`, f.markUnreachable)
			if err != nil && ctx.Err() == nil {
				f.t.Errorf("mark unreachable: %v", err)
			}
			marked = err == nil && tag.RowsAffected() == 1
		}
	}
}

func (f *fakeFleet) Create(ctx context.Context, req *fleetpb.CreateReservationRequest) (*fleetpb.Reservation, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	if a := md.Get("authorization"); len(a) != 1 || a[0] != "Bearer test-key" {
		return nil, status.Error(codes.Unauthenticated, "API key")
	}
	sp := req.GetSpec()
	if sp.GetPool() != f.pool || (sp.GetGpus() == 0) == (sp.GetNodes() == 0) || sp.GetGpus() > 8 || sp.GetNodes() > 2 {
		return nil, status.Errorf(codes.InvalidArgument, "spec %v", sp)
	}
	f.mu.Lock()
	f.nextID++
	rid := fmt.Sprintf("r-%d", f.nextID)
	// First fit over the nodes with a session, in id order.
	nodes := make([]string, 0, len(f.sessions))
	for id := range f.sessions {
		nodes = append(nodes, id)
	}
	sort.Strings(nodes)
	var allocs []*fleetpb.Allocation
	need := int(sp.GetNodes())
	for _, node := range nodes {
		if f.used[node] == nil {
			f.used[node] = map[uint32]string{}
		}
		used := f.used[node]
		var free []uint32
		for g := range uint32(f.gpus) {
			if used[g] == "" {
				free = append(free, g)
			}
		}
		al := &fleetpb.Allocation{Id: fmt.Sprintf("%s-a%d", rid, len(allocs)), NodeId: node}
		switch {
		case sp.GetNodes() > 0 && len(free) == f.gpus:
			al.GpuIndices, al.WholeNode = free, true
		case sp.GetGpus() > 0 && len(free) >= int(sp.GetGpus()):
			al.GpuIndices = free[:sp.GetGpus()]
		default:
			continue
		}
		allocs = append(allocs, al)
		if sp.GetGpus() > 0 || len(allocs) == need {
			break
		}
	}
	if len(allocs) == 0 || (sp.GetNodes() > 0 && len(allocs) < need) {
		f.mu.Unlock()
		return &fleetpb.Reservation{Id: rid, Spec: sp, State: fleetpb.ReservationState_RESERVATION_STATE_PENDING}, nil
	}
	for _, al := range allocs {
		for _, g := range al.GpuIndices {
			f.used[al.NodeId][g] = al.Id
		}
		f.live[al.Id] = al
	}
	f.resv[rid] = allocs
	f.placed++
	f.mu.Unlock()

	d := &fleetpb.PlacementDecision{DecisionId: "d-" + rid, ReservationId: rid, Pool: f.pool, At: timestamppb.Now(),
		Body: &fleetpb.PlacementDecision_Placed{Placed: &fleetpb.Placed{Allocations: allocs}}}
	b, _ := proto.Marshal(d)
	if err := f.nc.Publish(subjects.FleetPlace(f.pool), b); err != nil {
		return nil, status.Error(codes.Unavailable, err.Error())
	}
	f.mu.Lock()
	for _, al := range allocs {
		if s := f.sessions[al.NodeId]; s != nil {
			s.out <- bindMsg(al)
		}
	}
	f.mu.Unlock()
	return &fleetpb.Reservation{Id: rid, Spec: sp, State: fleetpb.ReservationState_RESERVATION_STATE_PLACED, Allocations: allocs}, nil
}

func (f *fakeFleet) Cancel(ctx context.Context, req *fleetpb.CancelReservationRequest) (*fleetpb.Reservation, error) {
	f.mu.Lock()
	allocs := f.resv[req.GetId()]
	delete(f.resv, req.GetId())
	var ids []string
	for _, al := range allocs {
		ids = append(ids, al.Id)
		for _, g := range al.GpuIndices {
			delete(f.used[al.NodeId], g)
		}
		delete(f.live, al.Id)
		if s := f.sessions[al.NodeId]; s != nil {
			s.out <- unbindMsg(al.Id)
		}
	}
	f.mu.Unlock()
	if len(ids) > 0 {
		d := &fleetpb.PlacementDecision{DecisionId: "d-c-" + req.GetId(), ReservationId: req.GetId(), Pool: f.pool, At: timestamppb.Now(),
			Body: &fleetpb.PlacementDecision_Released{Released: &fleetpb.Released{AllocationIds: ids, Reason: "cancelled"}}}
		b, _ := proto.Marshal(d)
		f.nc.Publish(subjects.FleetPlace(f.pool), b)
	}
	return &fleetpb.Reservation{Id: req.GetId(), State: fleetpb.ReservationState_RESERVATION_STATE_CANCELLED}, nil
}

func bindMsg(al *fleetpb.Allocation) *fleetpb.GatewayMessage {
	return &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Command{Command: &fleetpb.Command{
		AllocationId: al.Id, ReservationId: strings.Split(al.Id, "-a")[0],
		Action: &fleetpb.Command_Bind{Bind: &fleetpb.Bind{GpuIndices: al.GpuIndices, WholeNode: al.WholeNode}},
	}}}
}

func unbindMsg(id string) *fleetpb.GatewayMessage {
	return &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Command{Command: &fleetpb.Command{
		AllocationId: id, Action: &fleetpb.Command_Unbind{Unbind: &fleetpb.Unbind{Reason: "cancelled"}},
	}}}
}

func (f *fakeFleet) placements() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.placed
}
