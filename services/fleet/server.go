package fleet

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"log/slog"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/timestamppb"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Server is one fleet gateway instance: it serves the Gateway API, holds
// node sessions in memory and publishes what matters to JetStream.
type Server struct {
	fleetpb.UnimplementedGatewayServer

	cfg     Config
	pub     Publisher
	js      jetstream.JetStream
	m       *Metrics
	log     *slog.Logger
	tickets *ticketKeys

	// now is the clock of events and heartbeat ages (tests replace it);
	// timeouts use the monotonic clock since epoch.
	now   func() time.Time
	epoch time.Time
	// nonce makes this process's session and batch ids unique: a restarted
	// gateway must not reuse the Nats-Msg-Ids of its previous life.
	nonce    string
	nextID   atomic.Uint64
	limiter  *rate.Limiter // session handshakes
	joins    *joinLimiter
	hellos   chan struct{} // semaphore of Hellos in flight
	open     atomic.Int64  // sessions admitted and not yet finished
	pressure pressure
	outbox   chan *outgoing

	mu       sync.Mutex
	draining bool
	sessions map[nodeKey]*session // the live session of each node
	all      map[*session]struct{}
	active   sync.WaitGroup // one per entry in all; Drain waits for it
	binds    bindTable
	// caughtUp says the decision reader has read FLEET_PLACE up to its
	// head as of the gateway's start (decisionsHead). Until then no bind
	// is sent: the window's Placed decisions are read before their
	// Released ones, and a bind sent before its release is read would go
	// to a node whose GPUs were freed and booked again since.
	caughtUp      bool
	decisionsHead uint64
	// decisionHook, when set (tests), is called with each decision before
	// it is applied.
	decisionHook func(*fleetpb.PlacementDecision)

	// The deny list in force; denyAt and denyErr belong to watchDenyList.
	denied  atomic.Pointer[DenyList]
	denyAt  denyFile
	denyErr string

	liveMu sync.Mutex
	heard  []*session // sessions heard from since the last liveness flush

	flushMu       sync.Mutex // one flush at a time (ticker and Drain)
	flushSeq      uint64
	livenessChunk int

	running  atomic.Bool
	runDone  chan struct{} // closed when Run has returned
	stopped  chan struct{} // closed when Drain has finished: Run returns
	stopOnce sync.Once
}

// nodeKey names a node: its pool and id, as in its subject.
type nodeKey struct{ pool, node string }

// New makes a gateway. pub stores node events; js (may be nil: no bind
// delivery) is read for placement decisions. Call Run for the background
// loops, Register to serve, and Drain to stop.
func New(cfg Config, pub Publisher, js jetstream.JetStream, m *Metrics, log *slog.Logger) (*Server, error) {
	cfg = cfg.withDefaults()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if pub == nil {
		return nil, errors.New("fleet: a publisher is required")
	}
	if m == nil {
		m = NewMetrics(nil)
	}
	if log == nil {
		log = slog.Default()
	}
	tickets, err := newTicketKeys(cfg.CA, time.Now)
	if err != nil {
		return nil, err
	}
	nonce := make([]byte, 4)
	rand.Read(nonce)
	s := &Server{
		tickets:       tickets,
		cfg:           cfg,
		pub:           pub,
		js:            js,
		m:             m,
		log:           log,
		now:           time.Now,
		epoch:         time.Now(),
		nonce:         hex.EncodeToString(nonce),
		limiter:       rate.NewLimiter(rate.Limit(cfg.HandshakeRate), cfg.HandshakeBurst),
		joins:         newJoinLimiter(cfg.JoinRatePerClient, cfg.JoinBurstPerClient, cfg.JoinRate, cfg.JoinBurst),
		hellos:        make(chan struct{}, cfg.MaxHellosInFlight),
		outbox:        make(chan *outgoing, cfg.PublishQueue),
		sessions:      map[nodeKey]*session{},
		all:           map[*session]struct{}{},
		binds:         newBindTable(),
		caughtUp:      js == nil, // no decisions to read: no binds either
		livenessChunk: MaxLivenessBatch,
		runDone:       make(chan struct{}),
		stopped:       make(chan struct{}),
	}
	if err := s.loadDenyList(); err != nil {
		return nil, err
	}
	return s, nil
}

// Config is the configuration in effect (defaults filled in).
func (s *Server) Config() Config { return s.cfg }

// Register adds the Gateway service to a gRPC server made with
// ServerOptions.
func (s *Server) Register(g *grpc.Server) { fleetpb.RegisterGatewayServer(g, s) }

// maxStreamsPerConn bounds the calls on one connection. A node holds one
// session (and sometimes a Join) per connection; other services served on
// the same gRPC server (reservations) may multiplex more.
const maxStreamsPerConn = 100

// ServerOptions are the gRPC options the gateway needs: TLS that requests
// client certificates (handshakes admitted a few at a time, see
// limitedCreds), the message size limit, and the settings that keep a
// session small: no per-connection read buffer (the write buffer is shared
// between connections, gRPC's default), no dynamic table for the request
// headers (a node sends one request per connection), node messages decoded
// off the receiver's stack (see codec). Keepalive finds vanished peers.
func (s *Server) ServerOptions() []grpc.ServerOption {
	tc := s.cfg.TLS.Clone()
	if tc.ClientAuth == tls.NoClientCert {
		tc.ClientAuth = tls.RequestClientCert
	}
	if s.cfg.DisableResumption {
		tc.SessionTicketsDisabled = true
	} else {
		s.tickets.install(tc)
	}
	creds := newLimitedCreds(credentials.NewTLS(tc), s.m, s.cfg.MaxSessions)
	creds.deadline, creds.setup = s.cfg.TLSHandshakeTimeout, s.cfg.HelloTimeout
	return []grpc.ServerOption{
		grpc.Creds(creds),
		grpc.MaxRecvMsgSize(s.cfg.MaxMessageBytes),
		grpc.MaxConcurrentStreams(maxStreamsPerConn),
		grpc.MaxHeaderListSize(16 << 10),
		grpc.ReadBufferSize(0),
		grpc.HeaderTableSize(0),
		grpc.ForceServerCodecV2(newCodec()),
		grpc.ConnectionTimeout(s.cfg.HelloTimeout),
		grpc.KeepaliveParams(keepalive.ServerParameters{
			Time:    max(time.Minute, 2*s.cfg.HeartbeatInterval),
			Timeout: 20 * time.Second,
		}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
	}
}

// Run runs the background loops until ctx ends or Drain has finished: the
// publishing queue, the liveness flush, inventory resyncs, expiry of
// pending binds, and the placement-decision reader. Sessions need Run: a
// Hello waits for its Connected event, which Run publishes. Call Drain
// before cancelling ctx, so that the last events are published.
func (s *Server) Run(ctx context.Context) error {
	if !s.running.CompareAndSwap(false, true) {
		return errors.New("fleet: Run called twice")
	}
	defer close(s.runDone)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var wg sync.WaitGroup
	futures := make(chan inFlight, s.cfg.PublishQueue)
	wg.Add(2)
	go func() { defer wg.Done(); s.publishLoop(ctx, futures) }()
	go func() { defer wg.Done(); s.waitLoop(futures) }()
	if s.js != nil {
		wg.Add(1)
		go func() { defer wg.Done(); s.consumeDecisions(ctx) }()
	}
	if s.cfg.DenyListFile != "" {
		wg.Add(1)
		go func() { defer wg.Done(); s.watchDenyList(ctx) }()
	}
	t := time.NewTicker(s.cfg.FlushInterval)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			s.flushLiveness(ctx)
			now := s.now()
			s.resync(now)
			s.expireBinds(now)
			s.joins.sweep(time.Now())
		case <-ctx.Done():
			cancel()
			wg.Wait()
			return nil
		case <-s.stopped:
			cancel()
			wg.Wait()
			return nil
		}
	}
}

// Drain stops the gateway gracefully: it refuses new sessions, publishes
// the last liveness batches, sends every session a "draining" Refusal
// (retry_after 0-2 s, so nodes re-home to another gateway at once), waits
// for the sessions to end, and for their disconnected events to be stored.
// Then Run returns. The gRPC server's GracefulStop finds no session left.
func (s *Server) Drain(ctx context.Context) error {
	select {
	case <-s.stopped:
		return nil // drained before
	default:
	}
	s.mu.Lock()
	s.draining = true
	all := make([]*session, 0, len(s.all))
	for sess := range s.all {
		all = append(all, sess)
	}
	s.mu.Unlock()
	s.flushLiveness(ctx)
	for _, sess := range all {
		sess.close(reasonDraining, s.newRefusal(CodeDraining, codes.Unavailable, "this gateway is shutting down; connect to another one"), nil)
	}
	ended := make(chan struct{})
	go func() { s.active.Wait(); close(ended) }()
	var err error
	select {
	case <-ended:
		err = s.barrier(ctx)
	case <-ctx.Done():
		err = ctx.Err()
	}
	s.stopOnce.Do(func() { close(s.stopped) })
	if err != nil {
		return errors.Join(errors.New("fleet: drain did not finish"), err)
	}
	return nil
}

// Sessions is the number of sessions open (including handshakes).
func (s *Server) Sessions() int { return int(s.open.Load()) }

// newSessionID is "<gateway>-<nonce>-<n>": unique across gateways (each has
// its own id) and across restarts of one (the nonce).
func (s *Server) newSessionID() string {
	return s.cfg.GatewayID + "-" + s.nonce + "-" + strconv.FormatUint(s.nextID.Add(1), 10)
}

// Join exchanges a pool's join token for a node certificate.
func (s *Server) Join(ctx context.Context, req *fleetpb.JoinRequest) (*fleetpb.JoinResponse, error) {
	s.mu.Lock()
	draining := s.draining
	s.mu.Unlock()
	if draining {
		return nil, s.newRefusal(CodeDraining, codes.Unavailable, "this gateway is shutting down; join through another one").err()
	}
	// Joins draw on buckets of their own, never the sessions' (see
	// joinlimit.go).
	if addr := clientAddr(ctx); !s.joins.allow(addr, time.Now()) {
		s.m.joins.WithLabelValues("rate_limited").Inc()
		return nil, s.newRefusal(CodeJoinRate, codes.ResourceExhausted, "too many Joins from %s (at most %g a second per client address)", addr, s.cfg.JoinRatePerClient).err()
	}
	pool, ok := s.cfg.JoinTokens.Pool(req.GetToken())
	if !ok {
		s.m.joins.WithLabelValues("unauthenticated").Inc()
		if s.cfg.JoinTokens.Len() == 0 {
			return nil, status.Error(codes.Unauthenticated, "millrace fleet: this gateway has no join tokens configured; ask an operator for a node certificate")
		}
		return nil, status.Error(codes.Unauthenticated, "millrace fleet: the join token is not valid")
	}
	if err := CheckID("node_id", req.GetNodeId()); err != nil {
		s.m.joins.WithLabelValues("invalid").Inc()
		return nil, status.Errorf(codes.InvalidArgument, "millrace fleet: %v", err)
	}
	if why, denied := s.denied.Load().denies("", nodeKey{pool: pool, node: req.GetNodeId()}); denied {
		s.m.joins.WithLabelValues("revoked").Inc()
		s.m.revoked.WithLabelValues("join_refused").Inc()
		return nil, status.Errorf(codes.PermissionDenied, "millrace fleet: %s; ask an operator", why)
	}
	csr, err := parseCSR(req.GetCsr())
	if err != nil {
		s.m.joins.WithLabelValues("invalid").Inc()
		return nil, status.Errorf(codes.InvalidArgument, "millrace fleet: %v", err)
	}
	certPEM, cert, err := s.cfg.CA.issueNode(req.GetNodeId(), pool, csr.PublicKey, s.cfg.NodeCertValidity)
	if err != nil {
		s.m.joins.WithLabelValues("invalid").Inc()
		return nil, status.Errorf(codes.InvalidArgument, "millrace fleet: %v", err)
	}
	s.m.joins.WithLabelValues("issued").Inc()
	s.log.Info("node joined", "node", req.GetNodeId(), "pool", pool, "serial", serialKey(cert.SerialNumber), "not_after", cert.NotAfter)
	return &fleetpb.JoinResponse{
		Certificate: certPEM,
		Ca:          s.cfg.CA.CertPEM(),
		NotAfter:    timestamppb.New(cert.NotAfter),
		Pool:        pool,
	}, nil
}
