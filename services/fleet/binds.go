package fleet

import (
	"context"
	"slices"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/internal/backoff"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/subjects"
)

// bindTable is what the gateway knows about allocations (guarded by s.mu):
// binds decided in the last BindWindow, per node, whether or not the node
// is connected here (it may connect here later), and which session here
// holds which allocation (to deliver an unbind long after the bind).
type bindTable struct {
	pending     map[nodeKey]map[string]*pendingBind
	pendingNode map[string]nodeKey // allocation -> node of a pending bind
	// boundBy lists the sessions here that hold each allocation: normally
	// one. A node may claim (in its Hello) an allocation this gateway has
	// no placement for, so a claim never displaces another: an Unbind
	// goes to every holder, and the placed node always gets its own.
	boundBy map[string][]*session
	// placedOn is the node each allocation of the decisions read in the
	// last BindWindow was placed on: a report or claim from another node
	// is refused (foreign).
	placedOn map[string]placement
	// released are the allocations of the Released decisions read in the
	// last BindWindow: a node whose Hello says it holds one is told to
	// unbind it before anything else (reconciliation).
	released map[string]releasedAlloc
	count    int
}

type releasedAlloc struct {
	reservation, reason string
	expires             time.Time
}

type placement struct {
	key     nodeKey
	expires time.Time
}

type pendingBind struct {
	cmd     *fleetpb.GatewayMessage
	expires time.Time
}

func newBindTable() bindTable {
	return bindTable{
		pending:     map[nodeKey]map[string]*pendingBind{},
		pendingNode: map[string]nodeKey{},
		boundBy:     map[string][]*session{},
		placedOn:    map[string]placement{},
		released:    map[string]releasedAlloc{},
	}
}

// foreign reports whether alloc is known to be placed on a node other
// than key.
func (t *bindTable) foreign(alloc string, key nodeKey) bool {
	p, ok := t.placedOn[alloc]
	return ok && p.key != key
}

func (t *bindTable) hold(alloc string, sess *session) {
	if !slices.Contains(t.boundBy[alloc], sess) {
		t.boundBy[alloc] = append(t.boundBy[alloc], sess)
	}
}

func (t *bindTable) unhold(alloc string, sess *session) {
	h := slices.DeleteFunc(t.boundBy[alloc], func(o *session) bool { return o == sess })
	if len(h) == 0 {
		delete(t.boundBy, alloc)
		return
	}
	t.boundBy[alloc] = h
}

func (t *bindTable) add(key nodeKey, alloc string, cmd *fleetpb.GatewayMessage, expires time.Time) {
	if prev, ok := t.pendingNode[alloc]; ok && prev != key {
		t.drop(prev, alloc)
	}
	m := t.pending[key]
	if m == nil {
		m = map[string]*pendingBind{}
		t.pending[key] = m
	}
	if _, ok := m[alloc]; !ok {
		t.count++
	}
	m[alloc] = &pendingBind{cmd: cmd, expires: expires}
	t.pendingNode[alloc] = key
}

func (t *bindTable) drop(key nodeKey, alloc string) {
	m := t.pending[key]
	if _, ok := m[alloc]; !ok {
		return
	}
	delete(m, alloc)
	t.count--
	if len(m) == 0 {
		delete(t.pending, key)
	}
	if t.pendingNode[alloc] == key {
		delete(t.pendingNode, alloc)
	}
}

// pendingFor lists the live binds for a node that it does not hold, in
// allocation order.
func (t *bindTable) pendingFor(key nodeKey, held map[string]struct{}, now time.Time) []*fleetpb.GatewayMessage {
	m := t.pending[key]
	ids := make([]string, 0, len(m))
	for id, pb := range m {
		if _, ok := held[id]; !ok && pb.expires.After(now) {
			ids = append(ids, id)
		}
	}
	slices.Sort(ids)
	out := make([]*fleetpb.GatewayMessage, len(ids))
	for i, id := range ids {
		out[i] = m[id].cmd
	}
	return out
}

func (t *bindTable) expire(now time.Time) {
	for id, p := range t.placedOn {
		if !p.expires.After(now) {
			delete(t.placedOn, id)
		}
	}
	for id, r := range t.released {
		if !r.expires.After(now) {
			delete(t.released, id)
		}
	}
	for key, m := range t.pending {
		for id, pb := range m {
			if !pb.expires.After(now) {
				t.drop(key, id)
			}
		}
	}
}

func (s *Server) expireBinds(now time.Time) {
	s.mu.Lock()
	s.binds.expire(now)
	n := s.binds.count
	s.mu.Unlock()
	s.m.pendingBinds.Set(float64(n))
}

// consumeDecisions reads FLEET_PLACE with an ordered consumer from
// BindWindow ago (so that a gateway that just started knows the recent
// decisions) until ctx ends. Every gateway reads every decision and
// delivers those for the nodes it holds.
//
// Binds wait until the reader has caught up with the stream's head as of
// the start (see Server.caughtUp, catchUp).
func (s *Server) consumeDecisions(ctx context.Context) {
	start := time.Now().Add(-s.cfg.BindWindow)
	headKnown := false
	for {
		var err error
		if !headKnown {
			err = s.readHead(ctx, start)
			headKnown = err == nil
		}
		var cons jetstream.Consumer
		if err == nil {
			cons, err = s.js.OrderedConsumer(ctx, subjects.StreamFleetPlace, jetstream.OrderedConsumerConfig{
				DeliverPolicy: jetstream.DeliverByStartTimePolicy,
				OptStartTime:  &start,
			})
		}
		var cc jetstream.ConsumeContext
		if err == nil {
			cc, err = cons.Consume(s.decisionMsg, jetstream.ConsumeErrHandler(func(_ jetstream.ConsumeContext, err error) {
				s.log.Debug("placement decision reader", "err", err)
			}))
		}
		if err == nil {
			<-ctx.Done()
			cc.Stop()
			return
		}
		if ctx.Err() != nil {
			return
		}
		s.log.Warn("cannot read placement decisions; retrying", "stream", subjects.StreamFleetPlace, "err", err, "retry_in", decisionsRetry)
		if !backoff.Sleep(ctx, decisionsRetry) {
			return
		}
	}
}

// decisionsRetry is the pause before the decision reader tries again: a
// fixed second rather than a doubling pause, because binds wait for this
// reader and it must be back within a second of the stream.
const decisionsRetry = time.Second

// readHead notes the last sequence of FLEET_PLACE, the head the reader
// must reach before binds are sent; with nothing stored since start (the
// window holds no decision), the gateway is caught up at once.
func (s *Server) readHead(ctx context.Context, start time.Time) error {
	st, err := s.js.Stream(ctx, subjects.StreamFleetPlace)
	if err != nil {
		return err
	}
	state := st.CachedInfo().State
	s.mu.Lock()
	s.decisionsHead = state.LastSeq
	s.mu.Unlock()
	if state.LastSeq == 0 || state.LastTime.Before(start) {
		s.catchUp()
	}
	return nil
}

func (s *Server) decisionMsg(msg jetstream.Msg) {
	stored := time.Now()
	var seq uint64
	if meta, err := msg.Metadata(); err == nil {
		stored, seq = meta.Timestamp, meta.Sequence.Stream
	}
	d := &fleetpb.PlacementDecision{}
	if err := proto.Unmarshal(msg.Data(), d); err != nil {
		s.m.decisions.WithLabelValues("invalid").Inc()
		s.log.Warn("placement decision does not decode; skipped", "subject", msg.Subject(), "err", err)
	} else {
		if d.GetPool() == "" {
			if pool, _, ok := subjects.ParseFleet(msg.Subject()); ok {
				d.Pool = pool
			}
		}
		if s.decisionHook != nil {
			s.decisionHook(d)
		}
		s.applyDecision(d, stored)
	}
	s.mu.Lock()
	reached := !s.caughtUp && seq >= s.decisionsHead && s.decisionsHead > 0
	s.mu.Unlock()
	if reached {
		s.catchUp()
	}
}

// catchUp marks the decisions read up to the head: every node connected
// here is sent the binds placed on it that it lacks, held back until now.
func (s *Server) catchUp() {
	s.mu.Lock()
	if s.caughtUp {
		s.mu.Unlock()
		return
	}
	s.caughtUp = true
	now, sent := s.now(), 0
	for _, sess := range s.sessions {
		if !sess.established {
			continue
		}
		for _, c := range s.binds.pendingFor(sess.key, sess.held, now) {
			if sess.send(c) {
				sent++
				s.m.binds.WithLabelValues("bind").Inc()
				s.m.reconciled.WithLabelValues("bind").Inc()
			}
		}
	}
	s.mu.Unlock()
	s.log.Info("placement decisions read up to the head; binds are sent", "stream", subjects.StreamFleetPlace, "binds_held_back", sent)
}

func bindCommand(reservation string, a *fleetpb.Allocation) *fleetpb.GatewayMessage {
	return &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Command{Command: &fleetpb.Command{
		AllocationId:  a.GetId(),
		ReservationId: reservation,
		Action:        &fleetpb.Command_Bind{Bind: &fleetpb.Bind{GpuIndices: a.GetGpuIndices(), WholeNode: a.GetWholeNode()}},
	}}}
}

func unbindCommand(reservation, alloc, reason string) *fleetpb.GatewayMessage {
	return &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Command{Command: &fleetpb.Command{
		AllocationId:  alloc,
		ReservationId: reservation,
		Action:        &fleetpb.Command_Unbind{Unbind: &fleetpb.Unbind{Reason: reason}},
	}}}
}

// applyDecision delivers a decision to the nodes connected here and keeps
// its binds for BindWindow after it was stored, for nodes that connect
// later.
func (s *Server) applyDecision(d *fleetpb.PlacementDecision, stored time.Time) {
	switch b := d.GetBody().(type) {
	case *fleetpb.PlacementDecision_Placed:
		s.m.decisions.WithLabelValues("placed").Inc()
		expires := stored.Add(s.cfg.BindWindow)
		if !expires.After(s.now()) {
			return
		}
		s.mu.Lock()
		for _, a := range b.Placed.GetAllocations() {
			if CheckID("allocation id", a.GetId()) != nil || CheckID("node id", a.GetNodeId()) != nil {
				s.log.Warn("placement decision names an invalid allocation or node; skipped", "decision", d.GetDecisionId())
				continue
			}
			key := nodeKey{pool: d.GetPool(), node: a.GetNodeId()}
			cmd := bindCommand(d.GetReservationId(), a)
			s.binds.add(key, a.GetId(), cmd, expires)
			s.binds.placedOn[a.GetId()] = placement{key: key, expires: expires}
			sess := s.sessions[key]
			if sess == nil || !sess.established || !s.caughtUp {
				continue // sent when (if) the node connects here, or at catchUp
			}
			if _, held := sess.held[a.GetId()]; held {
				continue
			}
			if sess.send(cmd) {
				s.m.binds.WithLabelValues("bind").Inc()
			}
		}
		n := s.binds.count
		s.mu.Unlock()
		s.m.pendingBinds.Set(float64(n))
	case *fleetpb.PlacementDecision_Released:
		s.m.decisions.WithLabelValues("released").Inc()
		s.mu.Lock()
		if expires := stored.Add(s.cfg.BindWindow); expires.After(s.now()) {
			for _, id := range b.Released.GetAllocationIds() {
				s.binds.released[id] = releasedAlloc{reservation: d.GetReservationId(), reason: b.Released.GetReason(), expires: expires}
			}
		}
		for _, id := range b.Released.GetAllocationIds() {
			// The node the bind was pending for, and every node here that
			// holds the allocation: each is told once.
			var keys []nodeKey
			if key, known := s.binds.pendingNode[id]; known {
				s.binds.drop(key, id)
				keys = append(keys, key)
			}
			for _, holder := range s.binds.boundBy[id] {
				if !slices.Contains(keys, holder.key) {
					keys = append(keys, holder.key)
				}
			}
			for _, key := range keys {
				if sess := s.sessions[key]; sess != nil && sess.established {
					if sess.send(unbindCommand(d.GetReservationId(), id, b.Released.GetReason())) {
						s.m.binds.WithLabelValues("unbind").Inc()
					}
				}
			}
		}
		n := s.binds.count
		s.mu.Unlock()
		s.m.pendingBinds.Set(float64(n))
	case *fleetpb.PlacementDecision_UnbindAgain:
		// The placer has not seen these unbinds confirmed: tell the node
		// each was placed on (whether or not it claims it: one that lost
		// it answers UNBOUND at once) and every holder here.
		s.m.decisions.WithLabelValues("unbind_again").Inc()
		s.mu.Lock()
		for _, a := range b.UnbindAgain.GetAllocations() {
			if CheckID("allocation id", a.GetId()) != nil || CheckID("node id", a.GetNodeId()) != nil {
				continue
			}
			keys := []nodeKey{{pool: d.GetPool(), node: a.GetNodeId()}}
			for _, holder := range s.binds.boundBy[a.GetId()] {
				if !slices.Contains(keys, holder.key) {
					keys = append(keys, holder.key)
				}
			}
			for _, key := range keys {
				if sess := s.sessions[key]; sess != nil && sess.established {
					if sess.send(unbindCommand(d.GetReservationId(), a.GetId(), b.UnbindAgain.GetReason())) {
						s.m.binds.WithLabelValues("unbind").Inc()
					}
				}
			}
		}
		s.mu.Unlock()
	case *fleetpb.PlacementDecision_Freed:
		s.m.decisions.WithLabelValues("freed").Inc()
	case *fleetpb.PlacementDecision_Unfenced:
		s.m.decisions.WithLabelValues("unfenced").Inc()
	case *fleetpb.PlacementDecision_Failed:
		s.m.decisions.WithLabelValues("failed").Inc()
	default:
		s.m.decisions.WithLabelValues("invalid").Inc()
	}
}

// allocationReport updates what the node holds: a bind it confirmed (or
// that failed) is no longer pending. It refuses, changing nothing, a report
// on an allocation known to be placed on another node (refusedForeign) and
// a BOUND beyond the session's limit (refusedHeld).
func (s *Server) allocationReport(sess *session, r *fleetpb.AllocationReport) (refused string) {
	id := r.GetAllocationId()
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.binds.foreign(id, sess.key) {
		return refusedForeign
	}
	switch r.GetState() {
	case fleetpb.AllocationState_ALLOCATION_STATE_BOUND:
		if _, ok := sess.held[id]; !ok && len(sess.held) >= s.cfg.MaxHeldAllocations {
			return refusedHeld
		}
		if sess.held == nil {
			sess.held = map[string]struct{}{}
		}
		sess.held[id] = struct{}{}
		s.binds.hold(id, sess)
	default:
		delete(sess.held, id)
		s.binds.unhold(id, sess)
		s.binds.drop(sess.key, id)
	}
	// A bound allocation's bind is kept until its release or the end of
	// BindWindow: a node that reconnects without it (it lost it) is sent
	// the Bind again (reconcile). Safe because no bind is sent before the
	// reader has reached the head (caughtUp): a release stored before the
	// Hello has been read, and its GPUs stay booked until it is freed.
	return ""
}

// reconcileLocked compares what a node's Hello says it holds with what
// this gateway knows of the control plane's decisions (s.mu held): every
// held allocation that was released is unbound at once, before any bind
// is sent, so that the node drops what it must before it is given
// anything new; every bind placed on the node in BindWindow that it does
// not hold is sent (pendingFor, after this). The placer covers what is
// older than BindWindow: UnbindAgain for releases the node has not
// confirmed, and fences for nodes that were unreachable.
func (s *Server) reconcileLocked(sess *session) {
	for _, id := range sess.heldLocked() {
		r, ok := s.binds.released[id]
		if !ok {
			continue
		}
		if sess.send(unbindCommand(r.reservation, id, r.reason)) {
			s.m.binds.WithLabelValues("unbind").Inc()
			s.m.reconciled.WithLabelValues("unbind").Inc()
		}
	}
}
