package agent

import (
	"crypto/sha256"
	"errors"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/protobuf/proto"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// session is one welcomed session. Every Send goes through mu (gRPC allows
// one sender at a time); the receive loop runs in the agent's goroutine,
// heartbeats in a timer's. Lock order: never hold Agent.mu and session.mu
// together.
type session struct {
	a        *Agent
	stream   fleetpb.Gateway_SessionClient
	cancel   func(error)
	interval time.Duration
	silence  time.Duration
	heard    atomic.Int64 // unix ns of the last message from the gateway

	mu         sync.Mutex
	timer      *time.Timer
	closed     bool
	halfClosed bool
	statusSent bool
	statusHash [sha256.Size]byte
	statusAt   time.Time
}

// tick is the heartbeat timer: it checks the gateway is still heard from,
// sends a heartbeat and, when the status changed (or gauges are due), a
// status report.
func (s *session) tick() {
	a := s.a
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.halfClosed {
		return
	}
	if !a.suspended.Load() {
		now := time.Now()
		if s.silence > 0 && now.Sub(time.Unix(0, s.heard.Load())) > s.silence {
			s.cancel(errSilence)
			return
		}
		seq := a.seq.Add(1)
		if err := s.stream.Send(&fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Heartbeat{Heartbeat: &fleetpb.Heartbeat{Seq: seq}}}); err == nil {
			a.obs.HeartbeatSent(seq, now)
		}
		a.sendStatus(s, now, false)
	}
	s.timer.Reset(s.interval)
}

// send sends one message unless the session is closing.
func (s *session) send(m *fleetpb.NodeMessage) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.halfClosed {
		return errClosed
	}
	return s.stream.Send(m)
}

func (s *session) report(id string, st fleetpb.AllocationState, msg string) error {
	return s.send(&fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Allocation{Allocation: &fleetpb.AllocationReport{
		AllocationId: id, State: st, Error: msg,
	}}})
}

// closeSend half-closes the stream: the gateway ends the session cleanly.
func (s *session) closeSend() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed || s.halfClosed {
		return
	}
	s.halfClosed = true
	if s.timer != nil {
		s.timer.Stop()
	}
	_ = s.stream.CloseSend()
}

func (s *session) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	if s.timer != nil {
		s.timer.Stop()
	}
}

// sendStatus sends a status report when force is set, when the GPU states
// or conditions differ from the last report of this session, or when
// gauges are due. s.mu is held.
func (a *Agent) sendStatus(s *session, now time.Time, force bool) {
	if a.cfg.Status == nil {
		return
	}
	st := a.cfg.Status()
	if st == nil {
		return
	}
	h := statusHash(st)
	gi := a.set.gaugeInterval()
	due := gi > 0 && now.Sub(s.statusAt) >= gi
	if !force && s.statusSent && h == s.statusHash && !due {
		return
	}
	rep := &fleetpb.StatusReport{Seq: a.seq.Add(1), Gpus: st.GetGpus(), Conditions: st.GetConditions(), Gauges: st.GetGauges()}
	if err := s.stream.Send(&fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Status{Status: rep}}); err != nil {
		return
	}
	s.statusSent, s.statusHash, s.statusAt = true, h, now
}

// statusHash covers what makes a status "changed" (fleet.proto): the GPU
// states and conditions, not the gauges.
func statusHash(st *fleetpb.StatusReport) [sha256.Size]byte {
	b, _ := proto.MarshalOptions{Deterministic: true}.Marshal(&fleetpb.StatusReport{Gpus: st.GetGpus(), Conditions: st.GetConditions()})
	return sha256.Sum256(b)
}

var errNoAllocation = errors.New("command names no allocation")

// command carries out one Command and answers it.
func (a *Agent) command(s *session, c *fleetpb.Command) {
	received := time.Now()
	id := c.GetAllocationId()
	if id == "" {
		_ = s.report(id, fleetpb.AllocationState_ALLOCATION_STATE_FAILED, errNoAllocation.Error())
		return
	}
	switch act := c.Action.(type) {
	case *fleetpb.Command_Bind:
		a.mu.Lock()
		h := a.held[id]
		a.mu.Unlock()
		if h != nil {
			// Idempotent: a resent Bind (after a re-home) gets BOUND again.
			err := s.report(id, fleetpb.AllocationState_ALLOCATION_STATE_BOUND, "")
			a.obs.Bound(BoundEvent{Allocation: *h, Received: received, At: time.Now(), Repeat: true, Reported: err == nil})
			return
		}
		if a.cfg.Bind != nil {
			if err := a.cfg.Bind(a.ctx, c); err != nil {
				_ = s.report(id, fleetpb.AllocationState_ALLOCATION_STATE_FAILED, err.Error())
				return
			}
		}
		al := &Allocation{ID: id, ReservationID: c.GetReservationId(), GPUIndices: act.Bind.GetGpuIndices(), WholeNode: act.Bind.GetWholeNode()}
		a.mu.Lock()
		a.held[id] = al
		a.mu.Unlock()
		// Held even if the report is lost: the next Hello names it.
		err := s.report(id, fleetpb.AllocationState_ALLOCATION_STATE_BOUND, "")
		a.obs.Bound(BoundEvent{Allocation: *al, Received: received, At: time.Now(), Reported: err == nil})
	case *fleetpb.Command_Unbind:
		a.mu.Lock()
		h := a.held[id]
		a.mu.Unlock()
		if h != nil && a.cfg.Unbind != nil {
			if err := a.cfg.Unbind(a.ctx, c); err != nil {
				_ = s.report(id, fleetpb.AllocationState_ALLOCATION_STATE_FAILED, err.Error())
				return
			}
		}
		a.mu.Lock()
		delete(a.held, id)
		a.mu.Unlock()
		err := s.report(id, fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND, "")
		a.obs.Unbound(UnboundEvent{AllocationID: id, At: time.Now(), Held: h != nil, Reported: err == nil})
	default:
		_ = s.report(id, fleetpb.AllocationState_ALLOCATION_STATE_FAILED, "unknown command")
	}
}
