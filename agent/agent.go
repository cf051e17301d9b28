// Package agent is the node side of the fleet protocol (service Gateway in
// schemas/proto/millrace/fleet/v1/fleet.proto): one long session with a
// gateway over mTLS, Hello and Welcome, heartbeats, status reports, Bind
// and Unbind commands, refusals obeyed and re-homing to another gateway
// when a session ends. A GPU node's daemon runs one Agent; the fleet
// simulator (loadtest/fleetsim) runs thousands in one process, so an
// Agent's own cost is one goroutine and one timer besides its gRPC
// connection.
package agent

import (
	"cmp"
	"context"
	"crypto/tls"
	"errors"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/backoff"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	retry "github.com/millrace/millrace/internal/backoff"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Why the agent cancelled a session itself (context.Cause).
var (
	errHelloTimeout = errors.New("no Welcome in time")
	errSilence      = errors.New("gateway silent")
	errDropped      = errors.New("dropped by Reconnect")
	errNotWelcome   = errors.New("gateway's first message was not a Welcome or Refusal")
	errClosed       = errors.New("session closed")
)

// Agent is one node's agent. Create it with New, then Start; Stop ends it.
// Its methods are safe for concurrent use.
type Agent struct {
	cfg   Config
	set   *Settings
	obs   Observer
	log   *slog.Logger
	creds credentials.TransportCredentials
	order []uint16 // gateway indices, shuffled
	next  int      // run goroutine only

	ctx    context.Context
	cancel context.CancelFunc
	stopCh chan struct{}
	done   chan struct{}

	seq       atomic.Uint64
	suspended atomic.Bool

	mu       sync.Mutex
	held     map[string]*Allocation
	sess     *session
	resume   chan struct{} // closed by Resume
	started  bool
	stopped  bool
	startAt  time.Time
	stopOnce sync.Once
}

// New checks cfg and makes an agent; nothing is dialed before Start.
func New(cfg Config) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	tc := cfg.Settings.TLS.Clone()
	if cfg.Certificate != nil {
		tc.Certificates = []tls.Certificate{*cfg.Certificate}
	}
	if tc.ClientSessionCache == nil {
		tc.ClientSessionCache = new(lastSession)
	}
	a := &Agent{
		cfg:    cfg,
		set:    cfg.Settings,
		obs:    cfg.Observer,
		log:    cfg.Settings.Logger,
		creds:  credentials.NewTLS(tc),
		stopCh: make(chan struct{}),
		done:   make(chan struct{}),
		held:   make(map[string]*Allocation, len(cfg.Allocations)),
	}
	if a.obs == nil {
		a.obs = NopObserver{}
	}
	if a.log == nil {
		a.log = slog.New(slog.DiscardHandler)
	}
	for i := range cfg.Allocations {
		al := cfg.Allocations[i]
		a.held[al.ID] = &al
	}
	a.order = make([]uint16, len(a.set.Gateways))
	for i := range a.order {
		a.order[i] = uint16(i)
	}
	rand.Shuffle(len(a.order), func(i, j int) { a.order[i], a.order[j] = a.order[j], a.order[i] })
	a.ctx, a.cancel = context.WithCancel(context.Background())
	return a, nil
}

// NodeID is the node's id.
func (a *Agent) NodeID() string { return a.cfg.NodeID }

// Start begins dialing. It returns at once; the agent keeps a session (or
// tries to) until Stop. Start after Stop does nothing.
func (a *Agent) Start() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.started || a.stopped {
		return
	}
	a.started = true
	a.startAt = time.Now()
	go a.run()
}

// Stop ends the agent: it half-closes the session so that the gateway ends
// it cleanly (the gateway then records a "closed" disconnect), waits for
// that until ctx is done, then cancels whatever is left. It returns
// ctx.Err() when it had to cancel. The agent cannot be started again.
func (a *Agent) Stop(ctx context.Context) error {
	a.mu.Lock()
	started := a.started
	a.stopped = true
	a.mu.Unlock()
	a.stopOnce.Do(func() {
		close(a.stopCh)
		if !started {
			close(a.done) // no run goroutine will
		}
	})
	if !started {
		a.cancel()
		return nil
	}
	a.mu.Lock()
	s := a.sess
	a.mu.Unlock()
	if s != nil {
		s.closeSend()
	} else {
		// Between sessions, or dialing: nothing to close cleanly.
		a.cancel()
	}
	select {
	case <-a.done:
		a.cancel()
		return nil
	case <-ctx.Done():
		a.cancel()
		<-a.done
		return ctx.Err()
	}
}

// Done is closed when the agent has stopped.
func (a *Agent) Done() <-chan struct{} { return a.done }

// Reconnect drops the current session at once, without a goodbye, and
// redials (another gateway) as after any broken session: the simulator's
// reconnect storm. Without a session it does nothing.
func (a *Agent) Reconnect() {
	a.mu.Lock()
	s := a.sess
	a.mu.Unlock()
	if s != nil {
		s.cancel(errDropped)
	}
}

// Suspend makes the node go silent as a hung machine would: no heartbeats,
// no status, no answers to commands, no redials, while its connection
// stays open. Resume ends it. The simulator's crashes.
func (a *Agent) Suspend() {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !a.suspended.Load() {
		a.resume = make(chan struct{})
		a.suspended.Store(true)
	}
}

// Resume ends a Suspend: the node carries on where it stopped, and notices
// only now whether its session survived.
func (a *Agent) Resume() {
	a.mu.Lock()
	if a.suspended.Load() {
		a.suspended.Store(false)
		close(a.resume)
	}
	s := a.sess
	a.mu.Unlock()
	if s != nil {
		// The silence while suspended was the node's, not the gateway's.
		s.heard.Store(time.Now().UnixNano())
	}
}

// Suspended says whether the agent is suspended.
func (a *Agent) Suspended() bool { return a.suspended.Load() }

// Connected says whether the agent holds a welcomed session now.
func (a *Agent) Connected() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.sess != nil
}

// Allocations returns the allocations the node holds, sorted by id.
func (a *Agent) Allocations() []Allocation {
	a.mu.Lock()
	out := make([]Allocation, 0, len(a.held))
	for _, al := range a.held {
		out = append(out, *al)
	}
	a.mu.Unlock()
	slices.SortFunc(out, func(x, y Allocation) int { return cmp.Compare(x.ID, y.ID) })
	return out
}

// NotifyStatus tells the agent that the status source may have changed:
// the agent reads it now and sends a report if it did. Without a session
// (or while suspended) the next session's first report carries it.
func (a *Agent) NotifyStatus() {
	if a.suspended.Load() {
		return
	}
	a.mu.Lock()
	s := a.sess
	a.mu.Unlock()
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.halfClosed {
		return
	}
	a.sendStatus(s, time.Now(), false)
}

func (a *Agent) stopping() bool {
	select {
	case <-a.stopCh:
		return true
	default:
		return false
	}
}

// sleep waits d; false when the agent stops meanwhile.
func (a *Agent) sleep(d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-a.stopCh:
		return false
	}
}

// waitResumed blocks while the agent is suspended; false when it stops.
func (a *Agent) waitResumed() bool {
	if !a.suspended.Load() {
		return !a.stopping()
	}
	a.mu.Lock()
	ch, susp := a.resume, a.suspended.Load()
	a.mu.Unlock()
	if !susp {
		return !a.stopping()
	}
	select {
	case <-ch:
		return !a.stopping()
	case <-a.stopCh:
		return false
	}
}

func (a *Agent) nextGateway() string {
	g := a.set.Gateways[a.order[a.next%len(a.order)]]
	a.next++
	return g
}

// result is how one dial or session ended.
type result struct {
	addr       string
	welcomed   bool
	cause      string
	err        error
	retryAfter time.Duration
	endedAt    time.Time
	lived      time.Duration // from Welcome to end
}

func (a *Agent) run() {
	defer close(a.done)
	lo, hi := a.set.backoff()
	a.mu.Lock()
	brokeAt := a.startAt
	a.mu.Unlock()
	first := true
	attempts := 0
	// The k-th consecutive failure waits lo·2^k up to hi, jittered.
	redial := retry.Backoff{Min: min(2*lo, hi), Max: hi, Jitter: true}
	var wait time.Duration
	for {
		if wait > 0 && !a.sleep(wait) {
			return
		}
		if !a.waitResumed() {
			return
		}
		attempts++
		r := a.session(a.nextGateway(), first, brokeAt, attempts)
		if r.welcomed {
			first = false
			attempts = 0
			brokeAt = r.endedAt
		}
		if a.stopping() {
			r.cause = CauseStopped
			a.obs.Disconnected(DisconnectedEvent{Gateway: r.addr, At: r.endedAt, Cause: r.cause, Welcomed: r.welcomed, Err: r.err})
			return
		}
		switch {
		case r.cause == CauseDropped, r.welcomed && r.lived >= hi:
			// A session that lived: redial soon, at random below lo, and
			// double again from there.
			redial.Reset()
			wait = rand.N(lo)
		default:
			wait = redial.Next()
		}
		if ra := r.retryAfter; ra > 0 {
			// At least retry_after, jittered upwards so that nodes refused
			// together do not all come back in the same instant.
			wait = max(wait, ra+rand.N(ra/4+1))
		}
		a.log.Debug("fleet session ended", "node", a.cfg.NodeID, "addr", r.addr, "reason", r.cause, "err", r.err, "retry_in", wait)
		a.obs.Disconnected(DisconnectedEvent{Gateway: r.addr, At: r.endedAt, Cause: r.cause, Welcomed: r.welcomed, Err: r.err, Wait: wait})
	}
}

func (a *Agent) dialOptions() []grpc.DialOption {
	lo, hi := a.set.backoff()
	opts := []grpc.DialOption{
		grpc.WithTransportCredentials(a.creds),
		grpc.WithDisableRetry(),
		grpc.WithDisableServiceConfig(),
		grpc.WithDisableHealthCheck(),
		grpc.WithUserAgent("millrace-agent/" + a.set.AgentVersion),
		// A session's messages are a few hundred bytes: gRPC's default
		// 32 KiB read buffer and write buffers per connection are the
		// largest part of an agent's memory (the simulator runs
		// thousands); TLS buffers the connection underneath anyway.
		grpc.WithReadBufferSize(0),
		grpc.WithWriteBufferSize(4 << 10),
		// The agent does its own redialing (to another gateway); gRPC's
		// should not get in the way within one attempt.
		grpc.WithConnectParams(grpc.ConnectParams{
			Backoff:           backoff.Config{BaseDelay: lo, Multiplier: 2, Jitter: 0.2, MaxDelay: hi},
			MinConnectTimeout: a.set.helloTimeout(),
		}),
	}
	d := a.cfg.Dialer
	if d == nil {
		d = a.set.Dialer
	}
	if d != nil {
		opts = append(opts, grpc.WithContextDialer(d))
	}
	return append(opts, a.set.DialOptions...)
}

func (a *Agent) hello() *fleetpb.NodeMessage {
	a.mu.Lock()
	ids := make([]string, 0, len(a.held))
	for id := range a.held {
		ids = append(ids, id)
	}
	a.mu.Unlock()
	slices.Sort(ids)
	return &fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Hello{Hello: &fleetpb.Hello{
		NodeId:       a.cfg.NodeID,
		Pool:         a.cfg.Pool,
		Labels:       a.cfg.Labels,
		Gpus:         a.cfg.GPUs,
		AgentVersion: a.set.AgentVersion,
		Allocations:  ids,
	}}}
}

// session dials addr, says Hello and, once welcomed, serves the session
// until it ends.
func (a *Agent) session(addr string, first bool, brokeAt time.Time, attempts int) (r result) {
	r.addr = addr
	ctx, cancel := context.WithCancelCause(a.ctx)
	defer cancel(errClosed)
	conn, err := grpc.NewClient("passthrough:///"+addr, a.dialOptions()...)
	if err != nil {
		r.cause, r.err, r.endedAt = CauseDial, err, time.Now()
		return r
	}
	defer conn.Close()
	helloTimer := time.AfterFunc(a.set.helloTimeout(), func() { cancel(errHelloTimeout) })
	defer helloTimer.Stop()

	stream, err := fleetpb.NewGatewayClient(conn).Session(ctx)
	if err != nil {
		r.cause, r.err, r.endedAt = CauseDial, err, time.Now()
		if c := context.Cause(ctx); c == errHelloTimeout {
			r.cause = CauseHelloTimeout
		}
		return r
	}
	// A failed Send means the stream ended; Recv tells how.
	_ = stream.Send(a.hello())
	m, err := stream.Recv()
	if err != nil {
		return a.ended(ctx, r, err, nil)
	}
	switch b := m.Body.(type) {
	case *fleetpb.GatewayMessage_Refusal:
		// The stream ends next, with a status that may carry RetryInfo.
		for err == nil {
			_, err = stream.Recv()
		}
		return a.ended(ctx, r, err, b.Refusal)
	case *fleetpb.GatewayMessage_Welcome:
		helloTimer.Stop()
		return a.serve(ctx, cancel, stream, r, b.Welcome, first, brokeAt, attempts)
	default:
		cancel(errNotWelcome)
		return a.ended(ctx, r, errNotWelcome, nil)
	}
}

func (a *Agent) serve(ctx context.Context, cancel context.CancelCauseFunc, stream fleetpb.Gateway_SessionClient,
	r result, w *fleetpb.Welcome, first bool, brokeAt time.Time, attempts int) result {
	now := time.Now()
	r.welcomed = true
	iv := a.set.heartbeat(w.GetHeartbeatInterval().AsDuration())
	s := &session{a: a, stream: stream, cancel: cancel, interval: iv, silence: a.set.silence(iv)}
	s.heard.Store(now.UnixNano())
	a.mu.Lock()
	a.sess = s
	a.mu.Unlock()
	a.log.Debug("fleet session welcomed", "node", a.cfg.NodeID, "addr", r.addr, "gateway", w.GetGatewayId(), "session", w.GetSessionId())
	a.obs.Connected(ConnectedEvent{
		Gateway: r.addr, GatewayID: w.GetGatewayId(), SessionID: w.GetSessionId(), HeartbeatInterval: iv,
		At: now, First: first, Outage: now.Sub(brokeAt), Attempts: attempts,
	})
	s.mu.Lock()
	if !a.suspended.Load() {
		a.sendStatus(s, now, true)
	}
	s.timer = time.AfterFunc(iv, s.tick)
	s.mu.Unlock()
	if a.stopping() {
		// Stop ran before this session was registered: close it cleanly.
		s.closeSend()
	}

	var refusal *fleetpb.Refusal
	var err error
	for {
		var m *fleetpb.GatewayMessage
		if m, err = stream.Recv(); err != nil {
			break
		}
		s.heard.Store(time.Now().UnixNano())
		if a.suspended.Load() && !a.waitResumed() {
			cancel(errClosed)
			err = context.Canceled
			break
		}
		switch b := m.Body.(type) {
		case *fleetpb.GatewayMessage_Command:
			a.command(s, b.Command)
		case *fleetpb.GatewayMessage_Refusal:
			refusal = b.Refusal
		}
	}
	r = a.ended(ctx, r, err, refusal)
	r.lived = r.endedAt.Sub(now)
	a.mu.Lock()
	if a.sess == s {
		a.sess = nil
	}
	a.mu.Unlock()
	cancel(errClosed)
	s.close()
	return r
}

// ended classifies the end of a stream and reports a refusal.
func (a *Agent) ended(ctx context.Context, r result, err error, ref *fleetpb.Refusal) result {
	r.endedAt = time.Now()
	r.err = err
	ra := RetryAfter(err)
	if ref != nil || ra > 0 {
		ev := RefusedEvent{Gateway: r.addr, At: r.endedAt, RetryAfter: ra, Welcomed: r.welcomed}
		if ref != nil {
			ev.Code, ev.Reason = ref.GetCode(), ref.GetReason()
			ev.RetryAfter = max(ra, ref.GetRetryAfter().AsDuration())
		} else {
			st, _ := status.FromError(err)
			ev.Code, ev.Reason = st.Code().String(), st.Message()
		}
		r.cause, r.retryAfter = CauseRefused, ev.RetryAfter
		a.obs.Refused(ev)
		return r
	}
	switch cause := context.Cause(ctx); {
	case a.stopping():
		r.cause = CauseStopped
	case cause == errHelloTimeout:
		r.cause = CauseHelloTimeout
	case cause == errSilence:
		r.cause = CauseSilence
	case cause == errDropped:
		r.cause = CauseDropped
	case err == io.EOF:
		r.cause = CauseClosed
	default:
		r.cause = CauseError
	}
	return r
}

// RetryAfter returns the delay of the google.rpc.RetryInfo in a gRPC
// error's status details, or 0.
func RetryAfter(err error) time.Duration {
	st, ok := status.FromError(err)
	if !ok || st == nil {
		return 0
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok {
			return ri.GetRetryDelay().AsDuration()
		}
	}
	return 0
}
