package agent_test

import (
	"context"
	"crypto/tls"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/millrace/millrace/agent"
	"github.com/millrace/millrace/internal/poll"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

const pool = "pool-a"

type harness struct {
	t   *testing.T
	ca  *testCA
	set *agent.Settings
	rec *recorder
}

func newHarness(t *testing.T, gateways ...*fakeGateway) *harness {
	h := &harness{t: t, ca: gateways[0].ca, rec: &recorder{}}
	var addrs []string
	for _, g := range gateways {
		addrs = append(addrs, g.addr)
	}
	h.set = &agent.Settings{
		Gateways:      addrs,
		TLS:           &tls.Config{RootCAs: h.ca.pool, MinVersion: tls.VersionTLS12},
		AgentVersion:  "test",
		HelloTimeout:  5 * time.Second,
		BackoffMin:    10 * time.Millisecond,
		BackoffMax:    100 * time.Millisecond,
		GaugeInterval: -1,
	}
	return h
}

// start makes and starts an agent for node; mod adjusts its config.
func (h *harness) start(node string, mod func(*agent.Config)) *agent.Agent {
	h.t.Helper()
	cfg := agent.Config{
		Settings:    h.set,
		NodeID:      node,
		Pool:        pool,
		Certificate: h.ca.nodeCert(h.t, node, pool),
		Observer:    h.rec,
	}
	if mod != nil {
		mod(&cfg)
	}
	a, err := agent.New(cfg)
	if err != nil {
		h.t.Fatal(err)
	}
	a.Start()
	h.t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		a.Stop(ctx)
	})
	return a
}

func TestHello(t *testing.T) {
	ca := newTestCA(t)
	g := startGateway(t, ca, "gw-1", time.Hour)
	h := newHarness(t, g)
	gpus := []*fleetpb.Gpu{
		{Index: 0, Model: "H100", MemoryMib: 81559, Health: fleetpb.GpuHealth_GPU_HEALTH_OK, Uuid: "GPU-0"},
		{Index: 1, Model: "H100", MemoryMib: 81559, Health: fleetpb.GpuHealth_GPU_HEALTH_OK, Uuid: "GPU-1"},
	}
	h.start("node-1", func(c *agent.Config) {
		c.Labels = map[string]string{"zone": "z1", "rack": "r7"}
		c.GPUs = gpus
		c.Allocations = []agent.Allocation{{ID: "al-2", GPUIndices: []uint32{1}}, {ID: "al-1", GPUIndices: []uint32{0}}}
	})
	poll.Until(t, "a session", func() bool { return g.count() == 1 }, poll.Within(10*time.Second))
	s := g.last()
	want := &fleetpb.Hello{
		NodeId: "node-1", Pool: pool, Labels: map[string]string{"zone": "z1", "rack": "r7"},
		Gpus: gpus, AgentVersion: "test", Allocations: []string{"al-1", "al-2"},
	}
	if !proto.Equal(s.hello, want) {
		t.Errorf("Hello:\n got %v\nwant %v", s.hello, want)
	}
	if s.peerCN != "node-1" {
		t.Errorf("client certificate names %q, want node-1", s.peerCN)
	}
	poll.Until(t, "the Connected event", func() bool { return len(h.rec.get(&h.rec.connected)) == 1 }, poll.Within(5*time.Second))
	ev := h.rec.get(&h.rec.connected)[0].ev.(agent.ConnectedEvent)
	if !ev.First || ev.Gateway != g.addr || ev.GatewayID != "gw-1" || ev.SessionID != "gw-1-0" || ev.HeartbeatInterval != time.Hour || ev.Attempts != 1 {
		t.Errorf("Connected event %+v", ev)
	}
}

func TestHeartbeatsAtTheInterval(t *testing.T) {
	ca := newTestCA(t)
	const iv = 40 * time.Millisecond
	g := startGateway(t, ca, "gw-1", iv)
	h := newHarness(t, g)
	h.start("node-1", nil)
	poll.Until(t, "8 heartbeats", func() bool { s := g.last(); return s != nil && len(s.heartbeats()) >= 8 }, poll.Within(10*time.Second))
	s := g.last()
	var last uint64
	for i, r := range s.heartbeats() {
		seq := r.msg.GetHeartbeat().GetSeq()
		if seq <= last {
			t.Errorf("heartbeat %d: seq %d after %d", i, seq, last)
		}
		last = seq
	}
	// The agent's send times (the gateway's receive times may bunch when
	// the machine is busy): never closer than the interval, the first one
	// an interval after the Welcome.
	poll.Until(t, "the Connected event", func() bool { return len(h.rec.get(&h.rec.connected)) == 1 }, poll.Within(5*time.Second))
	welcome := h.rec.get(&h.rec.connected)[0].at
	beats := h.rec.beats()
	if d := beats[0].Sub(welcome); d < iv {
		t.Errorf("first heartbeat %s after the Welcome, want >= %s", d, iv)
	}
	for i := 1; i < len(beats); i++ {
		if d := beats[i].Sub(beats[i-1]); d < iv {
			t.Errorf("heartbeats %d and %d %s apart, want >= %s", i-1, i, d, iv)
		}
	}
	// And not much more: the median gap is near the interval.
	gaps := make([]time.Duration, 0, len(beats))
	for i := 1; i < len(beats); i++ {
		gaps = append(gaps, beats[i].Sub(beats[i-1]))
	}
	slices.Sort(gaps)
	if m := gaps[len(gaps)/2]; m > 5*iv {
		t.Errorf("median heartbeat gap %s, want about %s", m, iv)
	}
}

func TestObeysRetryAfter(t *testing.T) {
	for _, statusOnly := range []bool{false, true} {
		name := "refusal message"
		if statusOnly {
			name = "RetryInfo only"
		}
		t.Run(name, func(t *testing.T) {
			ca := newTestCA(t)
			const retry = 400 * time.Millisecond
			g1 := startGateway(t, ca, "gw-1", time.Hour)
			g2 := startGateway(t, ca, "gw-2", time.Hour)
			var refusedAt atomic.Int64
			refuseFirst := func(n int, _ *fleetpb.Hello) *fleetpb.Refusal {
				if refusedAt.CompareAndSwap(0, time.Now().UnixNano()) {
					return &fleetpb.Refusal{Code: "sessions_full", Reason: "full", RetryAfter: durationpb.New(retry)}
				}
				return nil
			}
			for _, g := range []*fakeGateway{g1, g2} {
				g.refuse, g.statusOnly = refuseFirst, statusOnly
			}
			h := newHarness(t, g1, g2)
			h.start("node-1", nil)
			poll.Until(t, "a welcomed session", func() bool { return len(h.rec.get(&h.rec.connected)) == 1 }, poll.Within(10*time.Second))
			sessions := append(g1.all(), g2.all()...)
			if len(sessions) != 2 {
				t.Fatalf("%d sessions, want 2 (one refused, one welcomed)", len(sessions))
			}
			refused := time.Unix(0, refusedAt.Load())
			for _, s := range sessions {
				if s.refused {
					continue
				}
				if d := s.start.Sub(refused); d < retry {
					t.Errorf("redialed %s after the refusal, want >= %s", d, retry)
				}
			}
			ev := h.rec.get(&h.rec.refused)
			if len(ev) != 1 {
				t.Fatalf("%d Refused events, want 1", len(ev))
			}
			re := ev[0].ev.(agent.RefusedEvent)
			wantCode := "sessions_full"
			if statusOnly {
				wantCode = "ResourceExhausted"
			}
			if re.Code != wantCode || re.RetryAfter != retry || re.Welcomed {
				t.Errorf("Refused event %+v, want code %s, retry after %s", re, wantCode, retry)
			}
			dis := h.rec.get(&h.rec.disconnected)
			if len(dis) != 1 || dis[0].ev.(agent.DisconnectedEvent).Cause != agent.CauseRefused || dis[0].ev.(agent.DisconnectedEvent).Wait < retry {
				t.Errorf("Disconnected events %+v", dis)
			}
		})
	}
}

// TestRedialDoubles: each consecutive failure waits twice as long as the
// one before, from twice BackoffMin up to BackoffMax, jittered to between
// half of that and all of it.
func TestRedialDoubles(t *testing.T) {
	ca := newTestCA(t)
	g := startGateway(t, ca, "gw-1", time.Hour)
	const refusals = 5
	g.refuse = func(n int, _ *fleetpb.Hello) *fleetpb.Refusal {
		if n < refusals {
			return &fleetpb.Refusal{Code: "sessions_full", Reason: "full"}
		}
		return nil
	}
	h := newHarness(t, g)
	h.start("node-1", nil)
	poll.Until(t, "a welcomed session", func() bool { return len(h.rec.get(&h.rec.connected)) == 1 }, poll.Within(10*time.Second))
	dis := h.rec.get(&h.rec.disconnected)
	if len(dis) != refusals {
		t.Fatalf("%d Disconnected events, want %d", len(dis), refusals)
	}
	lo, hi := h.set.BackoffMin, h.set.BackoffMax
	for i, e := range dis {
		whole := min(lo<<(i+1), hi)
		if w := e.ev.(agent.DisconnectedEvent).Wait; w < whole/2 || w > whole {
			t.Errorf("failure %d waited %s, want between %s and %s", i+1, w, whole/2, whole)
		}
	}
}

func TestRehomesWhenTheGatewayGoes(t *testing.T) {
	ca := newTestCA(t)
	g1 := startGateway(t, ca, "gw-1", 50*time.Millisecond)
	g2 := startGateway(t, ca, "gw-2", 50*time.Millisecond)
	h := newHarness(t, g1, g2)
	h.start("node-1", nil)
	poll.Until(t, "a session", func() bool { return g1.count()+g2.count() == 1 }, poll.Within(10*time.Second))
	first, other := g1, g2
	if g2.count() == 1 {
		first, other = g2, g1
	}
	// Hold an allocation, so that the next Hello must name it.
	first.last().out <- bindCmd("al-1", 0)
	poll.Until(t, "BOUND", func() bool { return len(first.last().reports()) == 1 }, poll.Within(5*time.Second))

	first.srv.Stop() // the gateway goes away: connections close
	poll.Until(t, "a session on the other gateway", func() bool { return other.count() == 1 }, poll.Within(10*time.Second))
	poll.Until(t, "two Connected events", func() bool { return len(h.rec.get(&h.rec.connected)) == 2 }, poll.Within(5*time.Second))
	ev := h.rec.get(&h.rec.connected)[1].ev.(agent.ConnectedEvent)
	if ev.First || ev.Gateway != other.addr || ev.Outage <= 0 || ev.Outage > 5*time.Second {
		t.Errorf("re-home Connected event %+v, want gateway %s and a short outage", ev, other.addr)
	}
	if got := other.last().hello.GetAllocations(); !slices.Equal(got, []string{"al-1"}) {
		t.Errorf("Hello after the re-home names allocations %v, want [al-1]", got)
	}
	dis := h.rec.get(&h.rec.disconnected)
	if len(dis) == 0 || dis[0].ev.(agent.DisconnectedEvent).Cause != agent.CauseError {
		t.Errorf("Disconnected events %+v, want cause error first", dis)
	}
	poll.Until(t, "heartbeats on the new session", func() bool { return len(other.last().heartbeats()) >= 2 }, poll.Within(5*time.Second))
	// The gateways share their ticket keys: the node resumed its TLS
	// session at the other gateway, with the certificate it had.
	if s := other.last(); !s.resumed || s.peerCN != "node-1" {
		t.Errorf("the session on the other gateway: resumed %v, certificate of %q; want a resumed session of node-1", s.resumed, s.peerCN)
	}
	if first.all()[0].resumed {
		t.Errorf("the first session was resumed: there was no ticket yet")
	}
}

func TestRehomesWhenDrained(t *testing.T) {
	ca := newTestCA(t)
	g1 := startGateway(t, ca, "gw-1", time.Hour)
	g2 := startGateway(t, ca, "gw-2", time.Hour)
	h := newHarness(t, g1, g2)
	h.start("node-1", nil)
	poll.Until(t, "a session", func() bool { return g1.count()+g2.count() == 1 }, poll.Within(10*time.Second))
	first, other := g1, g2
	if g2.count() == 1 {
		first, other = g2, g1
	}
	const retry = 300 * time.Millisecond
	ref := &fleetpb.Refusal{Code: "draining", Reason: "gateway shutting down", RetryAfter: durationpb.New(retry)}
	st, _ := status.New(codes.Unavailable, "draining").WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(retry)})
	drained := time.Now()
	first.last().end <- ending{msg: &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Refusal{Refusal: ref}}, err: st.Err()}
	poll.Until(t, "a session on the other gateway", func() bool { return other.count() == 1 }, poll.Within(10*time.Second))
	if d := other.last().start.Sub(drained); d < retry {
		t.Errorf("redialed %s after the drain, want >= %s", d, retry)
	}
	ev := h.rec.get(&h.rec.refused)
	if len(ev) != 1 || ev[0].ev.(agent.RefusedEvent).Code != "draining" || !ev[0].ev.(agent.RefusedEvent).Welcomed {
		t.Errorf("Refused events %+v, want one draining after the Welcome", ev)
	}
	poll.Until(t, "the Connected event", func() bool { return len(h.rec.get(&h.rec.connected)) == 2 }, poll.Within(5*time.Second))
	if c := h.rec.get(&h.rec.connected)[1].ev.(agent.ConnectedEvent); c.Outage < retry || c.Gateway != other.addr {
		t.Errorf("re-home %+v, want an outage of at least %s on %s", c, retry, other.addr)
	}
}

func TestBindIsIdempotent(t *testing.T) {
	ca := newTestCA(t)
	g := startGateway(t, ca, "gw-1", time.Hour)
	h := newHarness(t, g)
	var mu sync.Mutex
	var binds, unbinds []string
	a := h.start("node-1", func(c *agent.Config) {
		c.Bind = func(_ context.Context, cmd *fleetpb.Command) error {
			mu.Lock()
			defer mu.Unlock()
			binds = append(binds, cmd.GetAllocationId())
			if cmd.GetAllocationId() == "al-busy" {
				return errBusy
			}
			return nil
		}
		c.Unbind = func(_ context.Context, cmd *fleetpb.Command) error {
			mu.Lock()
			defer mu.Unlock()
			unbinds = append(unbinds, cmd.GetAllocationId())
			return nil
		}
	})
	poll.Until(t, "a session", func() bool { return g.count() == 1 }, poll.Within(10*time.Second))
	s := g.last()
	type rep struct {
		id    string
		state fleetpb.AllocationState
		err   string
	}
	steps := []struct {
		cmd  *fleetpb.GatewayMessage
		want rep
	}{
		{bindCmd("al-1", 0, 1), rep{"al-1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND, ""}},
		{bindCmd("al-1", 0, 1), rep{"al-1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND, ""}},
		{bindCmd("al-busy", 2), rep{"al-busy", fleetpb.AllocationState_ALLOCATION_STATE_FAILED, "gpu busy"}},
		{unbindCmd("al-1"), rep{"al-1", fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND, ""}},
		{unbindCmd("al-1"), rep{"al-1", fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND, ""}},
	}
	for i, st := range steps {
		s.out <- st.cmd
		poll.Until(t, "a report", func() bool { return len(s.reports()) == i+1 }, poll.Within(5*time.Second))
		r := s.reports()[i]
		if got := (rep{r.GetAllocationId(), r.GetState(), r.GetError()}); got != st.want {
			t.Errorf("step %d: report %+v, want %+v", i, got, st.want)
		}
		if i == 1 {
			if al := a.Allocations(); len(al) != 1 || al[0].ID != "al-1" || !slices.Equal(al[0].GPUIndices, []uint32{0, 1}) {
				t.Errorf("allocations held %+v, want al-1 on GPUs 0,1", al)
			}
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if !slices.Equal(binds, []string{"al-1", "al-busy"}) {
		t.Errorf("Bind handler called for %v, want [al-1 al-busy] (not again for a held allocation)", binds)
	}
	if !slices.Equal(unbinds, []string{"al-1"}) {
		t.Errorf("Unbind handler called for %v, want [al-1] (not for an allocation not held)", unbinds)
	}
	bound := h.rec.get(&h.rec.bound)
	if len(bound) != 2 || bound[0].ev.(agent.BoundEvent).Repeat || !bound[1].ev.(agent.BoundEvent).Repeat {
		t.Errorf("Bound events %+v, want a first and a repeat", bound)
	}
	if len(a.Allocations()) != 0 {
		t.Errorf("allocations held after the unbind: %+v", a.Allocations())
	}
}

// statusSource is a status the test changes.
type statusSource struct {
	mu sync.Mutex
	st *fleetpb.StatusReport
}

func (s *statusSource) get() *fleetpb.StatusReport {
	s.mu.Lock()
	defer s.mu.Unlock()
	return proto.Clone(s.st).(*fleetpb.StatusReport)
}

func (s *statusSource) set(f func(*fleetpb.StatusReport)) {
	s.mu.Lock()
	f(s.st)
	s.mu.Unlock()
}

func TestStatusOnlyOnChange(t *testing.T) {
	ca := newTestCA(t)
	const iv = 20 * time.Millisecond
	g := startGateway(t, ca, "gw-1", iv)
	h := newHarness(t, g)
	src := &statusSource{st: &fleetpb.StatusReport{
		Gpus:       []*fleetpb.GpuState{{Index: 0, Health: fleetpb.GpuHealth_GPU_HEALTH_OK}},
		Conditions: []*fleetpb.Condition{{Type: "Ready", Status: true}},
		Gauges:     []*fleetpb.GpuGauges{{Index: 0, Utilization: 0.1}},
	}}
	a := h.start("node-1", func(c *agent.Config) { c.Status = src.get })
	poll.Until(t, "a session", func() bool { return g.count() == 1 }, poll.Within(10*time.Second))
	s := g.last()
	beatsAfter := func(n int) {
		t.Helper()
		k := len(s.heartbeats())
		poll.Until(t, "heartbeats", func() bool { return len(s.heartbeats()) >= k+n }, poll.Within(5*time.Second))
	}
	beatsAfter(5)
	if n := len(s.statuses()); n != 1 {
		t.Fatalf("%d status reports after 5 heartbeats with no change, want 1 (the first)", n)
	}

	// Gauges alone are no change.
	src.set(func(st *fleetpb.StatusReport) { st.Gauges[0].Utilization = 0.9 })
	a.NotifyStatus()
	beatsAfter(3)
	if n := len(s.statuses()); n != 1 {
		t.Fatalf("%d status reports after a gauge change, want 1", n)
	}

	// A health change, notified: sent at once.
	src.set(func(st *fleetpb.StatusReport) { st.Gpus[0].Health = fleetpb.GpuHealth_GPU_HEALTH_DEGRADED })
	a.NotifyStatus()
	poll.Until(t, "the second report", func() bool { return len(s.statuses()) == 2 }, poll.Within(5*time.Second))
	if got := s.statuses()[1].GetGpus()[0].GetHealth(); got != fleetpb.GpuHealth_GPU_HEALTH_DEGRADED {
		t.Errorf("second report's GPU health %s", got)
	}
	a.NotifyStatus()
	beatsAfter(3)
	if n := len(s.statuses()); n != 2 {
		t.Fatalf("%d status reports after a notify without change, want 2", n)
	}

	// A condition change without notify: found at a heartbeat.
	src.set(func(st *fleetpb.StatusReport) { st.Conditions[0].Status = false })
	poll.Until(t, "the third report", func() bool { return len(s.statuses()) == 3 }, poll.Within(5*time.Second))
	beatsAfter(3)
	if n := len(s.statuses()); n != 3 {
		t.Fatalf("%d status reports, want 3", n)
	}
	// Every report and heartbeat has its own seq.
	seen := map[uint64]bool{}
	for _, r := range s.received() {
		seq := r.msg.GetHeartbeat().GetSeq() + r.msg.GetStatus().GetSeq()
		if seen[seq] {
			t.Errorf("seq %d sent twice", seq)
		}
		seen[seq] = true
	}
}

func TestGaugesPeriodically(t *testing.T) {
	ca := newTestCA(t)
	g := startGateway(t, ca, "gw-1", 20*time.Millisecond)
	h := newHarness(t, g)
	h.set.GaugeInterval = 100 * time.Millisecond
	src := &statusSource{st: &fleetpb.StatusReport{Gauges: []*fleetpb.GpuGauges{{Index: 0, Utilization: 0.5}}}}
	h.start("node-1", func(c *agent.Config) { c.Status = src.get })
	poll.Until(t, "three status reports", func() bool { s := g.last(); return s != nil && len(s.statuses()) >= 3 }, poll.Within(10*time.Second))
}

func TestSilentGatewayIsLeft(t *testing.T) {
	ca := newTestCA(t)
	g1 := startGateway(t, ca, "gw-1", 20*time.Millisecond)
	g2 := startGateway(t, ca, "gw-2", 20*time.Millisecond)
	g1.noAcks, g2.noAcks = true, true
	h := newHarness(t, g1, g2)
	h.start("node-1", nil)
	poll.Until(t, "a silence disconnect", func() bool {
		for _, d := range h.rec.get(&h.rec.disconnected) {
			if d.ev.(agent.DisconnectedEvent).Cause == agent.CauseSilence {
				return true
			}
		}
		return false
	}, poll.Within(10*time.Second))
	poll.Until(t, "sessions on both gateways", func() bool { return g1.count() >= 1 && g2.count() >= 1 }, poll.Within(10*time.Second))
}

func TestSuspendAndResume(t *testing.T) {
	ca := newTestCA(t)
	g := startGateway(t, ca, "gw-1", 20*time.Millisecond)
	h := newHarness(t, g)
	h.set.SilenceTimeout = -1
	a := h.start("node-1", nil)
	poll.Until(t, "heartbeats", func() bool { s := g.last(); return s != nil && len(s.heartbeats()) >= 2 }, poll.Within(10*time.Second))
	s := g.last()
	a.Suspend()
	// Whatever was in flight lands; then nothing comes while suspended.
	n := len(h.rec.beats())
	s.out <- bindCmd("al-1", 0)
	// Absence can only be watched for a while: ten heartbeat intervals.
	deadline := time.Now().Add(200 * time.Millisecond)
	for time.Now().Before(deadline) {
		if len(h.rec.beats()) > n {
			t.Fatal("heartbeat sent while suspended")
		}
		time.Sleep(5 * time.Millisecond)
	}
	if len(s.reports()) != 0 {
		t.Fatal("a command was answered while suspended")
	}
	a.Resume()
	poll.Until(t, "the bind answered after resume", func() bool { return len(s.reports()) == 1 }, poll.Within(5*time.Second))
	poll.Until(t, "heartbeats again", func() bool { return len(h.rec.beats()) > n+2 }, poll.Within(5*time.Second))
	if g.count() != 1 {
		t.Errorf("%d sessions, want the one that survived the suspension", g.count())
	}
}

func TestReconnect(t *testing.T) {
	ca := newTestCA(t)
	g := startGateway(t, ca, "gw-1", time.Hour)
	h := newHarness(t, g)
	a := h.start("node-1", nil)
	poll.Until(t, "a session", func() bool { return a.Connected() }, poll.Within(10*time.Second))
	a.Reconnect()
	poll.Until(t, "a second session", func() bool { return len(h.rec.get(&h.rec.connected)) == 2 }, poll.Within(10*time.Second))
	d := h.rec.get(&h.rec.disconnected)[0].ev.(agent.DisconnectedEvent)
	if d.Cause != agent.CauseDropped || d.Wait >= h.set.BackoffMin {
		t.Errorf("Disconnected %+v, want cause dropped and a wait below BackoffMin", d)
	}
}

func TestStopClosesCleanly(t *testing.T) {
	ca := newTestCA(t)
	g := startGateway(t, ca, "gw-1", time.Hour)
	h := newHarness(t, g)
	a := h.start("node-1", nil)
	poll.Until(t, "a session", func() bool { return a.Connected() }, poll.Within(10*time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.Stop(ctx); err != nil {
		t.Fatalf("Stop: %v", err)
	}
	if !g.last().halfClosed() {
		t.Error("the gateway did not see the node half-close")
	}
	d := h.rec.get(&h.rec.disconnected)
	if len(d) != 1 || d[0].ev.(agent.DisconnectedEvent).Cause != agent.CauseStopped {
		t.Errorf("Disconnected events %+v, want one, stopped", d)
	}
	select {
	case <-a.Done():
	default:
		t.Error("Done not closed after Stop")
	}
}

func TestStopWhileRefused(t *testing.T) {
	ca := newTestCA(t)
	g := startGateway(t, ca, "gw-1", time.Hour)
	g.refuse = func(int, *fleetpb.Hello) *fleetpb.Refusal {
		return &fleetpb.Refusal{Code: "draining", RetryAfter: durationpb.New(time.Hour)}
	}
	h := newHarness(t, g)
	a := h.start("node-1", nil)
	poll.Until(t, "a refusal", func() bool { return len(h.rec.get(&h.rec.refused)) == 1 }, poll.Within(10*time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.Stop(ctx); err != nil {
		t.Fatalf("Stop during an hour's retry_after: %v", err)
	}
}

func TestJoin(t *testing.T) {
	ca := newTestCA(t)
	g := startGateway(t, ca, "gw-1", time.Hour)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := agent.Join(ctx, g.addr, "bad-token", "node-j", ca.certPEM); err == nil {
		t.Fatal("Join with a bad token succeeded")
	}
	id, err := agent.Join(ctx, g.addr, "good-token", "node-j", ca.certPEM)
	if err != nil {
		t.Fatalf("Join: %v", err)
	}
	if id.Pool != pool || id.Certificate.Leaf == nil || id.Certificate.Leaf.Subject.CommonName != "node-j" || id.NotAfter.Before(time.Now()) {
		t.Errorf("identity: pool %q, leaf %v, not after %s", id.Pool, id.Certificate.Leaf, id.NotAfter)
	}
	rec := &recorder{}
	a, err := agent.New(agent.Config{
		Settings:    &agent.Settings{Gateways: []string{g.addr}, TLS: id.TLSConfig()},
		NodeID:      "node-j",
		Pool:        id.Pool,
		Certificate: &id.Certificate,
		Observer:    rec,
	})
	if err != nil {
		t.Fatal(err)
	}
	a.Start()
	defer a.Stop(ctx)
	poll.Until(t, "a session with the joined identity", func() bool { return a.Connected() }, poll.Within(10*time.Second))
	if cn := g.last().peerCN; cn != "node-j" {
		t.Errorf("session certificate names %q", cn)
	}
}

func TestValidate(t *testing.T) {
	set := &agent.Settings{Gateways: []string{"127.0.0.1:1"}, TLS: &tls.Config{}}
	for _, c := range []agent.Config{
		{NodeID: "n", Pool: "p"},
		{Settings: &agent.Settings{TLS: &tls.Config{}}, NodeID: "n", Pool: "p"},
		{Settings: &agent.Settings{Gateways: []string{"127.0.0.1:1"}}, NodeID: "n", Pool: "p"},
		{Settings: set, Pool: "p"},
		{Settings: set, NodeID: "n"},
		{Settings: &agent.Settings{Gateways: []string{"nohost"}, TLS: &tls.Config{}}, NodeID: "n", Pool: "p"},
	} {
		if _, err := agent.New(c); err == nil {
			t.Errorf("New(%+v) accepted", c)
		}
	}
}

// TestNewRefusesNegatives: a negative timing is refused, naming the field;
// SilenceTimeout and GaugeInterval alone mean something when negative
// (never).
func TestNewRefusesNegatives(t *testing.T) {
	for field, set := range map[string]func(*agent.Settings){
		"DefaultHeartbeat": func(s *agent.Settings) { s.DefaultHeartbeat = -time.Second },
		"HelloTimeout":     func(s *agent.Settings) { s.HelloTimeout = -time.Second },
		"BackoffMin":       func(s *agent.Settings) { s.BackoffMin = -time.Second },
		"BackoffMax":       func(s *agent.Settings) { s.BackoffMax = -time.Second },
	} {
		set := func() *agent.Settings {
			s := &agent.Settings{Gateways: []string{"127.0.0.1:1"}, TLS: &tls.Config{}}
			set(s)
			return s
		}()
		_, err := agent.New(agent.Config{Settings: set, NodeID: "n", Pool: "p"})
		if err == nil || !strings.Contains(err.Error(), "agent: "+field+" -1s is negative; set 0 for the default") {
			t.Errorf("%s negative: New returned %v, want an error naming it and saying what to set", field, err)
		}
	}
	never := &agent.Settings{Gateways: []string{"127.0.0.1:1"}, TLS: &tls.Config{}, SilenceTimeout: -1, GaugeInterval: -1}
	if _, err := agent.New(agent.Config{Settings: never, NodeID: "n", Pool: "p"}); err != nil {
		t.Errorf("negative SilenceTimeout and GaugeInterval (never) refused: %v", err)
	}
}

func TestStopBeforeStart(t *testing.T) {
	a, err := agent.New(agent.Config{
		Settings: &agent.Settings{Gateways: []string{"127.0.0.1:1"}, TLS: &tls.Config{}},
		NodeID:   "n", Pool: "p",
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Stop(context.Background()); err != nil {
		t.Fatal(err)
	}
	a.Start() // no effect after Stop
	select {
	case <-a.Done():
	default:
		t.Error("Done not closed")
	}
	if a.Connected() {
		t.Error("connected after Stop")
	}
}
