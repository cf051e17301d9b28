package fleet

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

const (
	// maxQueued bounds messages waiting to be sent to one node; a node
	// that stops reading its session is cut off beyond it.
	maxQueued = 1024
	// replaceWait bounds how long a new session waits for the one it
	// replaces to end, so that the old session's disconnect is stored
	// before the new session's connect.
	replaceWait = 2 * time.Second
)

// session is one node's session.
//
// An idle session costs two goroutines of ours besides gRPC's three per
// connection: the gRPC handler, which only waits for the session to close
// and then ends the stream, and a receiver, which spends its life in Recv.
// Neither does deep work, so their stacks stay at the runtime's minimum
// (measured: a goroutine whose stack once grew to 8 KiB for a handshake or
// a Send keeps it while it waits). The handshake runs on a goroutine of
// its own that starts the receiver and exits; every Send runs on a
// short-lived sender goroutine started when something is queued (acks,
// commands, the Welcome), one at a time per session, so a node that reads
// slowly delays nobody but itself.
type session struct {
	s      *Server
	stream fleetpb.Gateway_SessionServer

	// Set during the handshake, read-only once established.
	id         string
	key        nodeKey
	inventory  []byte // labels, GPUs, agent version (see inventory)
	certNode   string // from the client certificate, set by establish
	certPool   string
	certSerial string // serialKey of the client certificate (the deny list's key)
	// reports is the session's token bucket of status and allocation
	// reports (Config.ReportRate); share holds one token per event of the
	// session waiting in the shared publish queue (Config.SessionQueueShare).
	reports *rate.Limiter
	share   chan struct{}

	events   atomic.Uint64 // event counter for Nats-Msg-Ids
	lastSeen atomic.Int64  // s.now() of the last message, unix ns (liveness ages)
	lastMono atomic.Int64  // monotonic ns since s.epoch of the last message (timeouts)
	heard    atomic.Bool   // in s.heard; changed under s.liveMu
	refs     atomic.Int32  // goroutines still running; the last one finishes

	done     chan struct{} // closed by close
	finished chan struct{} // closed when the session is over

	mu       sync.Mutex
	queue    []*fleetpb.GatewayMessage
	sending  bool // a sender goroutine is running
	closing  bool
	reason   string   // disconnect reason
	final    *refusal // sent before the stream ends (nil: none)
	finalErr error    // the stream's status when final is nil
	timer    *time.Timer

	sendMu   sync.Mutex // held around every Send
	sendDone bool       // guarded by sendMu: the stream is ending

	// Guarded by s.mu.
	established bool
	connected   bool                // Connected queued: a disconnect must follow
	held        map[string]struct{} // allocations the node holds
	resyncAt    time.Time

	lastHash string // receiver only
}

// Session serves one node's session: it admits it, starts the handshake,
// and waits until the session closes to end the stream.
func (s *Server) Session(stream fleetpb.Gateway_SessionServer) error {
	sess, err := s.admit(stream)
	if sess == nil || err != nil {
		return err
	}
	defer sess.exit()
	sess.refs.Add(1)
	go sess.establish()
	<-sess.done
	return sess.end()
}

// admit makes the session and checks what is cheap to check: draining,
// the session limit, the handshake rate. A refusal returns its status and
// a nil session (exit was called). The certificate is verified by
// establish, off the handler's stack.
func (s *Server) admit(stream fleetpb.Gateway_SessionServer) (*session, error) {
	sess := &session{
		s:        s,
		stream:   stream,
		done:     make(chan struct{}),
		finished: make(chan struct{}),
	}
	s.mu.Lock()
	if s.draining {
		s.mu.Unlock()
		return nil, s.refuse(sess, s.newRefusal(CodeDraining, codes.Unavailable, "this gateway is shutting down; connect to another one"))
	}
	s.all[sess] = struct{}{}
	s.active.Add(1)
	s.mu.Unlock()
	sess.refs.Store(1)
	s.m.sessionsOpen.Set(float64(s.open.Add(1)))

	var rf *refusal
	switch {
	case s.open.Load() > int64(s.cfg.MaxSessions):
		rf = s.newRefusal(CodeSessionsFull, codes.ResourceExhausted, "this gateway holds its limit of %d sessions", s.cfg.MaxSessions)
	case !s.limiter.Allow():
		rf = s.newRefusal(CodeHandshakeRate, codes.ResourceExhausted, "more than %g new sessions per second", s.cfg.HandshakeRate)
	}
	if rf != nil {
		err := s.refuse(sess, rf)
		sess.exit()
		return nil, err
	}
	sess.setTimer(s.cfg.HelloTimeout, func() {
		sess.close(reasonError, s.newRefusal(CodeInvalid, codes.InvalidArgument, "no Hello within %s", s.cfg.HelloTimeout), nil)
	})
	return sess, nil
}

// establish reads the Hello and runs the handshake; on success it starts
// the receiver. It runs on a goroutine of its own that ends with it, so
// that the deep calls of a handshake leave no large stack behind.
func (sess *session) establish() {
	defer sess.exit()
	s := sess.s
	var err error
	if sess.certNode, sess.certPool, sess.certSerial, err = s.peerNode(sess.stream.Context()); err != nil {
		sess.close(reasonError, s.newRefusal(CodeUnauthenticated, codes.Unauthenticated, "%v", err), nil)
		return
	}
	m, err := sess.stream.Recv()
	if !sess.stopTimer() {
		return // the Hello timeout closed the session
	}
	if err != nil {
		sess.recvFailed(err)
		return
	}
	hello := m.GetHello()
	if hello == nil {
		sess.close(reasonError, s.newRefusal(CodeInvalid, codes.InvalidArgument, "the first message must be a Hello, not %s", bodyName(m)), nil)
		return
	}
	s.m.messages.WithLabelValues("hello").Inc()
	if err := checkHello(hello); err != nil {
		sess.close(reasonError, s.newRefusal(CodeInvalid, codes.InvalidArgument, "Hello: %v", err), nil)
		return
	}
	select {
	case s.hellos <- struct{}{}:
	default:
		sess.close(reasonError, s.newRefusal(CodeHellosInFlight, codes.ResourceExhausted, "%d Hellos are being handled", s.cfg.MaxHellosInFlight), nil)
		return
	}
	rf := s.handshake(sess, hello, sess.certNode, sess.certPool)
	<-s.hellos
	if rf != nil {
		sess.close(reasonError, rf, nil)
		return
	}
	if sess.isClosing() {
		return
	}
	s.m.handshakes.WithLabelValues("accepted").Inc()
	s.log.Debug("session open", "node", sess.key.node, "pool", sess.key.pool, "session", sess.id)
	sess.touch()
	sess.setTimer(s.cfg.HeartbeatTimeout, sess.checkIdle)
	sess.refs.Add(1)
	go sess.receive()
}

// peerNode verifies the client certificate of the call and returns the
// node and pool it names, and its serial.
func (s *Server) peerNode(ctx context.Context) (node, pool, serial string, err error) {
	p, ok := peer.FromContext(ctx)
	if !ok {
		return "", "", "", errors.New("no peer information")
	}
	info, ok := p.AuthInfo.(credentials.TLSInfo)
	if !ok {
		return "", "", "", errors.New("the session is not over TLS")
	}
	node, pool, err = s.cfg.CA.verifyNode(info.State.PeerCertificates, time.Now())
	if err != nil {
		return "", "", "", err
	}
	return node, pool, serialKey(info.State.PeerCertificates[0].SerialNumber), nil
}

func bodyName(m *fleetpb.NodeMessage) string {
	switch m.GetBody().(type) {
	case *fleetpb.NodeMessage_Hello:
		return "Hello"
	case *fleetpb.NodeMessage_Heartbeat:
		return "Heartbeat"
	case *fleetpb.NodeMessage_Status:
		return "StatusReport"
	case *fleetpb.NodeMessage_Allocation:
		return "AllocationReport"
	default:
		return "an empty message"
	}
}

// handshake makes sess the node's live session: it replaces an older
// one, stores the Connected event, and queues the Welcome and then the
// binds pending for the node. A nil refusal with sess closed means it was
// closed meanwhile.
func (s *Server) handshake(sess *session, hello *fleetpb.Hello, certNode, certPool string) *refusal {
	if hello.GetNodeId() != certNode || hello.GetPool() != certPool {
		return s.newRefusal(CodeUnauthenticated, codes.PermissionDenied,
			"the Hello names node %q in pool %q but the certificate is for node %q in pool %q",
			hello.GetNodeId(), hello.GetPool(), certNode, certPool)
	}
	if n := len(hello.GetAllocations()); n > s.cfg.MaxHeldAllocations {
		return s.newRefusal(CodeInvalid, codes.InvalidArgument,
			"the Hello lists %d allocations, over this gateway's limit of %d per node", n, s.cfg.MaxHeldAllocations)
	}
	sess.key = nodeKey{pool: hello.GetPool(), node: hello.GetNodeId()}
	sess.inventory = inventory(hello)
	sess.id = s.newSessionID()
	sess.reports = rate.NewLimiter(rate.Limit(s.cfg.ReportRate), s.cfg.ReportBurst)
	sess.share = make(chan struct{}, s.cfg.SessionQueueShare)

	s.mu.Lock()
	// Checked under s.mu, where applyDenyList's sweep looks: a revocation
	// either finds this session registered or is seen here.
	if rf := s.revokedLocked(sess); rf != nil {
		s.mu.Unlock()
		return rf
	}
	old := s.sessions[sess.key]
	s.sessions[sess.key] = sess
	if len(hello.GetAllocations()) > 0 {
		sess.held = make(map[string]struct{}, len(hello.GetAllocations()))
		for _, a := range hello.GetAllocations() {
			// A node claiming an allocation placed on another node would
			// receive its Unbind (and keep the real holder from it): the
			// claim is left out.
			if s.binds.foreign(a, sess.key) {
				s.m.reportsRefused.WithLabelValues(refusedForeign).Inc()
				continue
			}
			sess.held[a] = struct{}{}
		}
	}
	s.mu.Unlock()
	if old != nil {
		old.close(reasonReplaced, s.newRefusal(CodeReplaced, codes.Aborted,
			"node %s opened a newer session %s", sess.key.node, sess.id), nil)
		t := time.NewTimer(replaceWait)
		select {
		case <-old.finished:
		case <-t.C:
		case <-sess.done:
		}
		t.Stop()
	}

	s.mu.Lock()
	if s.sessions[sess.key] != sess || sess.isClosing() {
		s.mu.Unlock()
		return nil
	}
	connected := s.connectedEvent(sess, kindConnected)
	connected.done = make(chan error, 1)
	if !s.tryEnqueue(connected) {
		s.mu.Unlock()
		s.m.publishErrors.WithLabelValues(kindConnected).Inc()
		return s.newRefusal(CodeUnavailable, codes.Unavailable, "the gateway's publish queue is full")
	}
	sess.connected = true
	s.mu.Unlock()

	t := time.NewTimer(s.cfg.PublishTimeout)
	defer t.Stop()
	select {
	case err := <-connected.done:
		if err != nil {
			return s.newRefusal(CodeUnavailable, codes.Unavailable, "the backbone did not store the session: %v", err)
		}
	case <-t.C:
		return s.newRefusal(CodeUnavailable, codes.Unavailable, "the backbone did not store the session within %s", s.cfg.PublishTimeout)
	case <-sess.done:
		return nil
	}

	s.mu.Lock()
	defer s.mu.Unlock()
	if s.sessions[sess.key] != sess || sess.isClosing() {
		return nil
	}
	sess.established = true
	// Welcome first, then the binds pending for the node.
	sess.send(&fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Welcome{Welcome: &fleetpb.Welcome{
		GatewayId:         s.cfg.GatewayID,
		SessionId:         sess.id,
		HeartbeatInterval: durationpb.New(s.cfg.HeartbeatInterval),
	}}})
	// The first resync comes after [0.5, 1) x ResyncEvery, so that a
	// fleet that connected at once does not resync at once.
	sess.resyncAt = s.now().Add(jitter(s.cfg.ResyncEvery, 0.5, 1))
	for a := range sess.held {
		s.binds.hold(a, sess)
	}
	// Reconciliation: unbinds of what it holds and must drop, first; then
	// the binds placed on it that it lacks.
	s.reconcileLocked(sess)
	if !s.caughtUp {
		return nil // the binds go at catchUp
	}
	cmds := s.binds.pendingFor(sess.key, sess.held, s.now())
	for _, c := range cmds {
		if sess.send(c) {
			s.m.binds.WithLabelValues("bind").Inc()
			s.m.reconciled.WithLabelValues("bind").Inc()
		}
	}
	return nil
}

func jitter(d time.Duration, lo, hi float64) time.Duration {
	return time.Duration(float64(d) * (lo + (hi-lo)*rand.Float64()))
}

// refuse closes sess with r and ends the stream (the handler's part).
func (s *Server) refuse(sess *session, r *refusal) error {
	sess.close(reasonError, r, nil)
	return sess.end()
}

// end sends the final Refusal, if any, and returns the stream's status.
// It waits for a Send in progress and stops any later one: the handler
// returns right after it.
func (sess *session) end() error {
	sess.sendMu.Lock()
	defer sess.sendMu.Unlock()
	sess.sendDone = true
	sess.mu.Lock()
	r, err := sess.final, sess.finalErr
	sess.mu.Unlock()
	if r == nil {
		return err
	}
	if !sess.isEstablished() {
		sess.s.m.handshakes.WithLabelValues(r.code).Inc()
		sess.s.log.Debug("session refused", "code", r.code, "reason", r.reason, "retry_after", r.retry)
	}
	sess.stream.Send(r.message())
	return r.err()
}

func (sess *session) isEstablished() bool {
	sess.s.mu.Lock()
	defer sess.s.mu.Unlock()
	return sess.established
}

func (sess *session) isClosing() bool {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	return sess.closing
}

// close ends the session: the handler sends final (if any) and ends the
// stream with final's status, or with err. The first close wins.
func (sess *session) close(reason string, final *refusal, err error) {
	sess.mu.Lock()
	if sess.closing {
		sess.mu.Unlock()
		return
	}
	sess.closing, sess.reason, sess.final, sess.finalErr = true, reason, final, err
	sess.queue = nil
	if sess.timer != nil {
		sess.timer.Stop()
	}
	sess.mu.Unlock()
	close(sess.done)
}

// setTimer replaces the session's timer (the Hello timeout, then the
// heartbeat timeout); its function runs on a goroutine of its own when it
// fires.
func (sess *session) setTimer(d time.Duration, f func()) {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	if sess.timer != nil {
		sess.timer.Stop()
	}
	if !sess.closing {
		sess.timer = time.AfterFunc(d, f)
	}
}

// stopTimer stops the timer; false if it has fired already.
func (sess *session) stopTimer() bool {
	sess.mu.Lock()
	defer sess.mu.Unlock()
	return sess.timer == nil || sess.timer.Stop()
}

// checkIdle runs when the heartbeat timer fires: it closes a session that
// sent nothing for HeartbeatTimeout, or sets the timer for the rest.
func (sess *session) checkIdle() {
	s := sess.s
	idle := time.Since(s.epoch) - time.Duration(sess.lastMono.Load())
	if idle < s.cfg.HeartbeatTimeout {
		sess.setTimer(s.cfg.HeartbeatTimeout-idle, sess.checkIdle)
		return
	}
	sess.close(reasonHeartbeatTimeout, nil, status.Errorf(codes.DeadlineExceeded,
		"millrace fleet: no message for %s (heartbeat timeout %s); open a new session", idle.Round(time.Millisecond), s.cfg.HeartbeatTimeout))
}

// send queues m and makes sure a sender goroutine runs; false if the
// session is closing.
func (sess *session) send(m *fleetpb.GatewayMessage) bool {
	sess.mu.Lock()
	if sess.closing {
		sess.mu.Unlock()
		return false
	}
	if len(sess.queue) >= maxQueued {
		sess.mu.Unlock()
		sess.close(reasonError, nil, status.Errorf(codes.ResourceExhausted,
			"millrace fleet: more than %d messages waiting: the node does not read its session", maxQueued))
		return false
	}
	sess.queue = append(sess.queue, m)
	start := !sess.sending
	sess.sending = true
	sess.mu.Unlock()
	if start {
		go sess.sendQueued()
	}
	return true
}

// sendQueued is a sender goroutine: it sends what is queued, in order,
// and exits when the queue is empty.
func (sess *session) sendQueued() {
	sess.sendMu.Lock()
	defer sess.sendMu.Unlock()
	for {
		sess.mu.Lock()
		q := sess.queue
		sess.queue = nil
		if len(q) == 0 || sess.closing || sess.sendDone {
			sess.sending = false
			sess.mu.Unlock()
			return
		}
		sess.mu.Unlock()
		for _, m := range q {
			if err := sess.stream.Send(m); err != nil {
				sess.close(reasonError, nil, err)
				sess.mu.Lock()
				sess.sending = false
				sess.mu.Unlock()
				return
			}
		}
	}
}

// receive is the receiving goroutine, started once the session is
// established. It spends its life blocked in Recv; the work is done in
// functions that return before the next Recv, so its stack stays small.
func (sess *session) receive() {
	defer sess.exit()
	for sess.receiveNext() {
	}
}

// receiveNext receives and handles one message; false ends the session.
//
//go:noinline
func (sess *session) receiveNext() bool {
	m, err := sess.stream.Recv()
	if err != nil {
		sess.recvFailed(err)
		return false
	}
	return sess.dispatch(m)
}

//go:noinline
func (sess *session) recvFailed(err error) {
	switch {
	case errors.Is(err, io.EOF):
		sess.close(reasonClosed, nil, nil)
	case status.Code(err) == codes.Canceled:
		sess.close(reasonClosed, nil, err)
	default:
		sess.close(reasonError, nil, err)
	}
}

//go:noinline
func (sess *session) dispatch(m *fleetpb.NodeMessage) bool {
	if err := sess.handle(m); err != nil {
		sess.close(reasonError, sess.s.newRefusal(CodeInvalid, codes.InvalidArgument, "%v", err), nil)
		return false
	}
	return true
}

func ack(seq uint64) *fleetpb.GatewayMessage {
	return &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Ack{Ack: &fleetpb.Ack{Seq: seq}}}
}

// handle acts on one message of an established session; an error closes
// the session as invalid.
func (sess *session) handle(m *fleetpb.NodeMessage) error {
	s := sess.s
	sess.touch()
	switch b := m.GetBody().(type) {
	case *fleetpb.NodeMessage_Heartbeat:
		s.m.heartbeats.Inc()
		sess.send(ack(b.Heartbeat.GetSeq()))
		return nil
	case *fleetpb.NodeMessage_Status:
		if !sess.allowReport() {
			return errRefused
		}
		return offStack(func() error { return sess.status(b.Status) })
	case *fleetpb.NodeMessage_Allocation:
		if !sess.allowReport() {
			return errRefused
		}
		return offStack(func() error { return sess.allocation(b.Allocation) })
	case *fleetpb.NodeMessage_Hello:
		return errors.New("a Hello within an open session: open a new session instead")
	default:
		return errors.New("an empty message")
	}
}

// errRefused ends a session that was closed with a refusal of its own
// (dispatch's close with "invalid" is then a no-op: the first close wins).
var errRefused = errors.New("fleet: session refused")

// Reasons of millrace_fleet_reports_refused_total.
const (
	refusedForeign    = "foreign"
	refusedRate       = "rate"
	refusedHeld       = "allocations_full"
	refusedQueueShare = "queue_share"
)

// allowReport takes a token of the session's report bucket; a session
// without one is closed "report_rate". A node that floods its session
// thus costs the gateway one refusal, and every other session's reports
// keep their room in the publish queue.
func (sess *session) allowReport() bool {
	if sess.reports.Allow() {
		return true
	}
	s := sess.s
	s.m.reportsRefused.WithLabelValues(refusedRate).Inc()
	sess.close(reasonError, s.newRefusal(CodeReportRate, codes.ResourceExhausted,
		"node %s of pool %s sent reports faster than %g per second (burst %d)",
		sess.key.node, sess.key.pool, s.cfg.ReportRate, s.cfg.ReportBurst), nil)
	return false
}

// enqueueOwn queues one of the session's own events within its share of
// the publish queue: at its share it waits up to enqueueWait for its
// earlier events to be stored. False: not queued (counted).
func (sess *session) enqueueOwn(o *outgoing) bool {
	select {
	case sess.share <- struct{}{}:
	default:
		t := time.NewTimer(enqueueWait)
		defer t.Stop()
		select {
		case sess.share <- struct{}{}:
		case <-t.C:
			sess.s.m.reportsRefused.WithLabelValues(refusedQueueShare).Inc()
			return false
		case <-sess.done:
			return false
		}
	}
	o.share = sess.share
	if !sess.s.enqueue(o) {
		<-sess.share
		return false
	}
	return true
}

// offStack runs f on a fresh goroutine and waits for it. The receiver
// spends its life in Recv: hashing and encoding a report on its own stack
// would grow that stack for good (a goroutine keeps a stack it used a
// quarter of), so the deep work runs where the stack is thrown away after.
func offStack(f func() error) error {
	done := make(chan error, 1)
	go func() { done <- f() }()
	return <-done
}

// status publishes a status report whose hash changed, and acks it.
func (sess *session) status(r *fleetpb.StatusReport) error {
	s := sess.s
	s.m.messages.WithLabelValues("status").Inc()
	if err := checkStatus(r); err != nil {
		return fmt.Errorf("status report %d: %w", r.GetSeq(), err)
	}
	if h := StatusHash(r); h != sess.lastHash {
		// On a full queue (or share) the hash stays, so the next report
		// retries.
		if sess.enqueueOwn(s.statusEvent(sess, r, h)) {
			sess.lastHash = h
		}
	}
	sess.send(ack(r.GetSeq()))
	return nil
}

// allocation publishes an allocation report and updates what the node
// holds. A report on an allocation this gateway knows to be placed on
// another node, or a BOUND beyond the session's limit, is refused: the
// session is closed and nothing is published or changed.
func (sess *session) allocation(r *fleetpb.AllocationReport) error {
	s := sess.s
	s.m.messages.WithLabelValues("allocation").Inc()
	if err := checkAllocation(r); err != nil {
		return err
	}
	switch s.allocationReport(sess, r) {
	case refusedForeign:
		s.m.reportsRefused.WithLabelValues(refusedForeign).Inc()
		s.log.Warn("allocation report from a node the allocation is not placed on; refused",
			"node", sess.key.node, "pool", sess.key.pool, "allocation", r.GetAllocationId(), "state", r.GetState())
		sess.close(reasonError, s.newRefusal(CodeForeignAllocation, codes.PermissionDenied,
			"allocation %s is not placed on node %s of pool %s", r.GetAllocationId(), sess.key.node, sess.key.pool), nil)
		return errRefused
	case refusedHeld:
		s.m.reportsRefused.WithLabelValues(refusedHeld).Inc()
		sess.close(reasonError, s.newRefusal(CodeAllocationsFull, codes.ResourceExhausted,
			"node %s of pool %s would hold more than %d allocations", sess.key.node, sess.key.pool, s.cfg.MaxHeldAllocations), nil)
		return errRefused
	}
	if !sess.enqueueOwn(s.allocationEvent(sess, r)) {
		// Not stored: a new session reports again (its Hello lists what
		// the node holds).
		sess.close(reasonError, s.newRefusal(CodeUnavailable, codes.Unavailable,
			"the backbone is not storing this node's events fast enough; report again on a new session"), nil)
		return errRefused
	}
	return nil
}

// touch records that the node was heard from now.
func (sess *session) touch() {
	s := sess.s
	sess.lastSeen.Store(s.now().UnixNano())
	sess.lastMono.Store(int64(time.Since(s.epoch)))
	if sess.heard.Load() {
		return
	}
	s.liveMu.Lock()
	if !sess.heard.Load() {
		sess.heard.Store(true)
		s.heard = append(s.heard, sess)
	}
	s.liveMu.Unlock()
}

// heldLocked lists the allocations the node holds, sorted (s.mu held).
func (sess *session) heldLocked() []string {
	if len(sess.held) == 0 {
		return nil
	}
	out := make([]string, 0, len(sess.held))
	for a := range sess.held {
		out = append(out, a)
	}
	slices.Sort(out)
	return out
}

// exit is called by each of the session's goroutines as it ends; the last
// one removes the session and queues its disconnected event, so that the
// event follows everything the session published.
func (sess *session) exit() {
	if sess.refs.Add(-1) > 0 {
		return
	}
	s := sess.s
	sess.close(reasonError, nil, nil)
	sess.mu.Lock()
	reason := sess.reason
	sess.mu.Unlock()

	s.mu.Lock()
	if s.sessions[sess.key] == sess {
		delete(s.sessions, sess.key)
	}
	for a := range sess.held {
		s.binds.unhold(a, sess)
	}
	connected, established := sess.connected, sess.established
	delete(s.all, sess)
	s.mu.Unlock()

	if connected {
		s.enqueue(s.disconnectedEvent(sess, reason))
	}
	if established {
		s.m.closed.WithLabelValues(reason).Inc()
		s.log.Debug("session closed", "node", sess.key.node, "pool", sess.key.pool, "session", sess.id, "reason", reason)
	}
	s.m.sessionsOpen.Set(float64(s.open.Add(-1)))
	close(sess.finished)
	s.active.Done()
}
