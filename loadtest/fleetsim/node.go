package fleetsim

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/millrace/millrace/agent"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Why a node's last session ended, for attributing its next Welcome.
const (
	outageNormal = iota // the gateway's doing (killed, closed, refused)
	outageCrash         // the simulator suspended the node
	outageStorm         // the simulator dropped the session (storm)
)

// node is one simulated node: its inventory and status, its agent, and
// what the simulator knows of its outages. It is the agent's Observer.
type node struct {
	s     *sim
	idx   int
	id    string
	model Model
	gpus  []*fleetpb.Gpu
	a     *agent.Agent

	// sampleNext asks for the next heartbeat's send time (liveness lag).
	sampleNext atomic.Bool

	mu            sync.Mutex
	health        []fleetpb.GpuHealth
	startedAt     time.Time
	connected     bool
	everConnected bool
	lastAlive     time.Time // last heartbeat sent or Welcome
	down          bool
	downSince     time.Time
	maxDown       time.Duration
	outage        int
	crashed       bool
	resumedAt     time.Time
	boundAt       map[string]time.Time // allocation -> when the node bound it
}

func newNode(s *sim, idx int, id string, m Model, gpus int) *node {
	n := &node{s: s, idx: idx, id: id, model: m, health: make([]fleetpb.GpuHealth, gpus)}
	n.gpus = make([]*fleetpb.Gpu, gpus)
	for g := range gpus {
		n.health[g] = fleetpb.GpuHealth_GPU_HEALTH_OK
		n.gpus[g] = &fleetpb.Gpu{
			Index:     uint32(g),
			Model:     m.Name,
			MemoryMib: m.MemoryMiB,
			Health:    fleetpb.GpuHealth_GPU_HEALTH_OK,
			Uuid:      fmt.Sprintf("GPU-%s-%d", id, g),
		}
	}
	return n
}

func (n *node) labels() map[string]string {
	return map[string]string{
		"zone":          fmt.Sprintf("zone-%d", n.idx%4),
		"rack":          fmt.Sprintf("rack-%d", n.idx/40),
		"millrace.sim":  "true",
		"gpu.model":     n.model.Name,
		"gpu.count":     fmt.Sprint(len(n.gpus)),
		"node.instance": fmt.Sprint(n.idx),
	}
}

// alive records that the node was heard (as far as it knows) at t: an
// outage in progress ends.
func (n *node) alive(t time.Time) {
	if n.down {
		n.maxDown = max(n.maxDown, t.Sub(n.downSince))
		n.down = false
	}
	n.lastAlive = t
}

// goDown starts an outage: the gateways last heard the node at its last
// heartbeat.
func (n *node) goDown() {
	if !n.down && !n.lastAlive.IsZero() {
		n.down = true
		n.downSince = n.lastAlive
	}
}

// longestDown is the node's longest outage so far, counting one in
// progress up to now.
func (n *node) longestDown(now time.Time) time.Duration {
	n.mu.Lock()
	defer n.mu.Unlock()
	d := n.maxDown
	if n.down {
		d = max(d, now.Sub(n.downSince))
	}
	return d
}

// status is the agent's status source: GPU health, a Ready condition, and
// gauges (which never make a change).
func (n *node) status() *fleetpb.StatusReport {
	n.mu.Lock()
	st := &fleetpb.StatusReport{
		Gpus:   make([]*fleetpb.GpuState, len(n.health)),
		Gauges: make([]*fleetpb.GpuGauges, len(n.health)),
	}
	ready := true
	for g, h := range n.health {
		st.Gpus[g] = &fleetpb.GpuState{Index: uint32(g), Health: h}
		st.Gauges[g] = &fleetpb.GpuGauges{Index: uint32(g), Utilization: float64((n.idx+g)%100) / 100, TemperatureC: 40 + float64((n.idx*7+g)%40)}
		if h == fleetpb.GpuHealth_GPU_HEALTH_FAILED {
			ready = false
		}
	}
	n.mu.Unlock()
	st.Conditions = []*fleetpb.Condition{{Type: "Ready", Status: ready, Reason: "simulated"}}
	return st
}

// flip changes one GPU's health (OK <-> DEGRADED) and tells the agent.
func (n *node) flip(g int) {
	n.mu.Lock()
	if n.health[g] == fleetpb.GpuHealth_GPU_HEALTH_OK {
		n.health[g] = fleetpb.GpuHealth_GPU_HEALTH_DEGRADED
	} else {
		n.health[g] = fleetpb.GpuHealth_GPU_HEALTH_OK
	}
	n.mu.Unlock()
	n.a.NotifyStatus()
}

// bind is the agent's Bind handler: it refuses GPUs the node lacks and
// GPUs already held by another allocation (a double booking, counted).
func (n *node) bind(_ context.Context, cmd *fleetpb.Command) error {
	n.s.bindsReceived.Add(1)
	b := cmd.GetBind()
	want := map[uint32]bool{}
	for _, g := range b.GetGpuIndices() {
		if int(g) >= len(n.gpus) {
			n.s.bindsInvalid.Add(1)
			return fmt.Errorf("node %s has no GPU %d", n.id, g)
		}
		want[g] = true
	}
	for _, h := range n.a.Allocations() {
		if h.ID == cmd.GetAllocationId() {
			continue
		}
		if b.GetWholeNode() || h.WholeNode {
			n.conflict(-1, cmd.GetAllocationId(), h.ID)
			return fmt.Errorf("node %s is held by allocation %s", n.id, h.ID)
		}
		for _, g := range h.GPUIndices {
			if want[g] {
				n.conflict(int32(g), cmd.GetAllocationId(), h.ID)
				return fmt.Errorf("GPU %d of node %s is held by allocation %s", g, n.id, h.ID)
			}
		}
	}
	return nil
}

func (n *node) conflict(gpu int32, bound, held string) {
	n.mu.Lock()
	since := n.boundAt[held]
	n.mu.Unlock()
	n.s.conflict(Conflict{At: time.Now(), Node: n.id, GPU: gpu, Bound: bound, Held: held, HeldSince: since})
}

// crash suspends the node; resume ends it.
func (n *node) crash() {
	n.mu.Lock()
	n.crashed = true
	if !n.connected {
		n.outage = outageCrash
	}
	n.goDown()
	n.mu.Unlock()
	n.a.Suspend()
}

func (n *node) resume() {
	now := time.Now()
	n.mu.Lock()
	n.crashed = false
	n.resumedAt = now
	survived := n.connected
	n.mu.Unlock()
	n.a.Resume()
	n.s.crashResumed.Add(1)
	if survived {
		n.s.crashSurvived.Add(1)
	}
}

// Observer.

func (n *node) Connected(e agent.ConnectedEvent) {
	s := n.s
	n.mu.Lock()
	n.alive(e.At)
	n.connected, n.everConnected = true, true
	kind := n.outage
	n.outage = outageNormal
	started := n.startedAt
	n.mu.Unlock()
	s.welcomes.Add(1)
	s.sessionUp(e.At)
	switch {
	case e.First:
		s.firstWelcome.Record(e.At.Sub(started))
	case kind == outageCrash:
		s.crashReconnect.Add(1)
	case kind == outageStorm:
		s.stormRehome.Record(e.Outage)
		s.stormWelcomed(e.At)
	default:
		s.rehome.Record(e.Outage)
	}
}

func (n *node) Disconnected(e agent.DisconnectedEvent) {
	s := n.s
	s.count(&s.disconnects, e.Cause)
	if !e.Welcomed {
		return
	}
	n.mu.Lock()
	n.connected = false
	n.goDown()
	switch {
	case e.Cause == agent.CauseDropped:
		n.outage = outageStorm
	case n.crashed || e.At.Sub(n.resumedAt) < time.Second:
		n.outage = outageCrash
	default:
		n.outage = outageNormal
	}
	n.mu.Unlock()
	s.sessions.Add(-1)
}

func (n *node) Refused(e agent.RefusedEvent) { n.s.count(&n.s.refusals, e.Code) }

func (n *node) Bound(e agent.BoundEvent) {
	if e.Repeat {
		n.s.bindRepeats.Add(1)
	} else {
		n.mu.Lock()
		if n.boundAt == nil {
			n.boundAt = map[string]time.Time{}
		}
		n.boundAt[e.Allocation.ID] = e.At
		n.mu.Unlock()
	}
	n.s.match.bound(e.ID, e.At)
}

func (n *node) Unbound(agent.UnboundEvent) { n.s.unbinds.Add(1) }

func (n *node) HeartbeatSent(_ uint64, at time.Time) {
	n.s.heartbeats.Add(1)
	n.mu.Lock()
	n.alive(at)
	n.mu.Unlock()
	if n.sampleNext.CompareAndSwap(true, false) {
		n.s.liveSample(n, at)
	}
}
