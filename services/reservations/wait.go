package reservations

import (
	"context"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// A Create with wait holds its call until the reservation is decided. One
// core NATS subscription per Server, on fleet.place.>, hears every
// placement decision (JetStream delivers what it stores to core
// subscribers too) and wakes the waiters of its reservation; a waiter then
// reads the reservation from the database. The subscription is a hint, the
// database the truth: a waiter re-reads it once after registering (the
// decision may have come before), every RecheckInterval (a decision missed
// while NATS reconnected, a cancel by another call), and at the end.

const (
	// settlePoll is the pace of the reads that wait for a known change to
	// show in the database.
	settlePoll = 20 * time.Millisecond
	// deadlineMargin: a wait ends this long before the client's deadline,
	// so that the client gets the reservation rather than DEADLINE_EXCEEDED.
	deadlineMargin = 250 * time.Millisecond
)

// waiters are the Creates waiting, by reservation id.
type waiters struct {
	mu   sync.Mutex
	byID map[string]map[chan struct{}]struct{}
}

func (w *waiters) add(id string) chan struct{} {
	ch := make(chan struct{}, 1)
	w.mu.Lock()
	defer w.mu.Unlock()
	set := w.byID[id]
	if set == nil {
		set = map[chan struct{}]struct{}{}
		w.byID[id] = set
	}
	set[ch] = struct{}{}
	return ch
}

func (w *waiters) remove(id string, ch chan struct{}) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if set := w.byID[id]; set != nil {
		delete(set, ch)
		if len(set) == 0 {
			delete(w.byID, id)
		}
	}
}

func (w *waiters) has(id string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.byID[id] != nil
}

// wake signals every waiter of id and reports whether there was one.
func (w *waiters) wake(id string) bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	for ch := range w.byID[id] {
		select {
		case ch <- struct{}{}:
		default: // already signalled
		}
	}
	return w.byID[id] != nil
}

// onDecision handles one message of fleet.place.>. Most decisions concern
// nobody waiting here; the Millrace-Reservation header lets those pass
// without decoding the body.
func (s *Server) onDecision(msg *nats.Msg) {
	if id := msg.Header.Get(envelope.Reservation); id != "" && !s.waiters.has(id) {
		s.m.decisions.WithLabelValues("ignored").Inc()
		return
	}
	var d fleetpb.PlacementDecision
	if err := proto.Unmarshal(msg.Data, &d); err != nil {
		s.m.decisions.WithLabelValues("malformed").Inc()
		return
	}
	switch d.GetBody().(type) {
	case *fleetpb.PlacementDecision_Placed, *fleetpb.PlacementDecision_Failed:
		if s.waiters.wake(d.GetReservationId()) {
			s.m.decisions.WithLabelValues("woke").Inc()
			return
		}
	}
	// Released decisions end or requeue a placement; they do not answer
	// a wait for one.
	s.m.decisions.WithLabelValues("ignored").Inc()
}

func decided(r *fleetpb.Reservation) bool {
	return r.GetState() != fleetpb.ReservationState_RESERVATION_STATE_PENDING
}

// wait holds the call until the reservation is decided (any state but
// PENDING), d passes, the client's deadline nears or the Server closes, and
// returns the reservation as the database shows it then (view when the
// database does not have it yet). ch must have been registered before the
// request was published.
func (s *Server) wait(ctx context.Context, view *fleetpb.Reservation, ch <-chan struct{}, d time.Duration) (*fleetpb.Reservation, error) {
	start := time.Now()
	s.m.waiting.Inc()
	defer s.m.waiting.Dec()
	id := view.GetId()

	deadline := start.Add(d)
	if dl, ok := ctx.Deadline(); ok && dl.Add(-deadlineMargin).Before(deadline) {
		deadline = dl.Add(-deadlineMargin)
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	recheck := time.NewTicker(s.cfg.RecheckInterval)
	defer recheck.Stop()

	done := func(outcome string, r *fleetpb.Reservation) (*fleetpb.Reservation, error) {
		s.m.waited(outcome, time.Since(start))
		return r, nil
	}
	if r, err := s.store.get(ctx, id); err == nil && r != nil && decided(r) {
		return done("decided", r)
	}
	outcome := "timeout"
loop:
	for {
		select {
		case <-ch:
			// The placer writes its rows before it publishes; a projection
			// that lags shows them within SettleTimeout.
			if r := s.settle(ctx, id, decided); r != nil && decided(r) {
				return done("decided", r)
			}
		case <-recheck.C:
			if r, err := s.store.get(ctx, id); err == nil && r != nil && decided(r) {
				return done("decided", r)
			}
		case <-timer.C:
			break loop
		case <-s.closed:
			outcome = "shutdown"
			break loop
		case <-ctx.Done():
			s.m.waited("abandoned", time.Since(start))
			return nil, status.FromContextError(ctx.Err()).Err()
		}
	}
	r, err := s.store.get(ctx, id)
	if err != nil {
		// The request is stored; its id is worth more to the client than
		// an error.
		s.log.Warn("read reservation after wait", "reservation", id, "err", err)
	}
	if r == nil {
		r = view
	}
	return done(outcome, r)
}

// settle reads the reservation until done holds or SettleTimeout passes,
// and returns the last view read (nil if none).
func (s *Server) settle(ctx context.Context, id string, done func(*fleetpb.Reservation) bool) *fleetpb.Reservation {
	deadline := time.Now().Add(s.cfg.SettleTimeout)
	var last *fleetpb.Reservation
	for {
		r, err := s.store.get(ctx, id)
		if err == nil && r != nil {
			last = r
			if done(r) {
				return r
			}
		}
		if !time.Now().Before(deadline) {
			return last
		}
		t := time.NewTimer(settlePoll)
		select {
		case <-ctx.Done():
			t.Stop()
			return last
		case <-t.C:
		}
	}
}
