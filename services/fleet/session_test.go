package fleet

import (
	"context"
	"errors"
	"io"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// A node with a good certificate gets Welcome, and by then its Connected
// event is stored, once, with the fleet headers.
func TestWelcomeAfterConnectedStored(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{GatewayID: "gw-1", HeartbeatInterval: 7 * time.Second})
	hello := testHello("node-1", "pool.a")
	hello.Allocations = []string{"alloc-held"}
	c := openSession(t, gw.nodeConn(t, nil, "node-1", "pool.a"), helloMsg(hello))
	w := c.welcome()
	if w.GetGatewayId() != "gw-1" || w.GetSessionId() == "" || w.GetHeartbeatInterval().AsDuration() != 7*time.Second {
		t.Fatalf("welcome %v", w)
	}

	// No polling: the event is stored before the Welcome is sent.
	evs := b.nodeEvents(t)
	if len(evs) != 1 || evs[0].ev.GetConnected() == nil {
		t.Fatalf("after Welcome the stream holds %d node events, want the Connected event", len(evs))
	}
	m, ev := evs[0].msg, evs[0].ev
	if want := subjects.FleetNode("pool.a", "node-1"); m.Subject != want {
		t.Errorf("subject %s, want %s", m.Subject, want)
	}
	for h, want := range map[string]string{
		envelope.MsgID:   w.GetSessionId() + "/1",
		envelope.Schema:  envelope.SchemaFleetV1,
		envelope.Kind:    envelope.KindNode,
		envelope.Pool:    "pool.a",
		envelope.Node:    "node-1",
		envelope.Gateway: "gw-1",
	} {
		if got := m.Header.Get(h); got != want {
			t.Errorf("header %s = %q, want %q", h, got, want)
		}
	}
	if ev.GetNodeId() != "node-1" || ev.GetPool() != "pool.a" || ev.GetGatewayId() != "gw-1" || ev.GetSessionId() != w.GetSessionId() {
		t.Errorf("event ids %v", ev)
	}
	conn := ev.GetConnected()
	if len(conn.GetGpus()) != 2 || conn.GetLabels()["zone"] != "a" || conn.GetAgentVersion() != "test/1" ||
		len(conn.GetAllocations()) != 1 || conn.GetAllocations()[0] != "alloc-held" {
		t.Errorf("connected %v", conn)
	}

	// A later event as a barrier: still exactly one Connected.
	c.send(statusMsg(1, fleetpb.GpuHealth_GPU_HEALTH_OK, 0.5))
	b.waitEvents(t, "status", 1, is(kindStatus))
	if got := len(b.waitEvents(t, "connected", 1, is(kindConnected))); got != 1 {
		t.Fatalf("%d Connected events, want 1", got)
	}
}

func statusMsg(seq uint64, health fleetpb.GpuHealth, util float64) *fleetpb.NodeMessage {
	return &fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Status{Status: &fleetpb.StatusReport{
		Seq: seq,
		Gpus: []*fleetpb.GpuState{
			{Index: 0, Health: fleetpb.GpuHealth_GPU_HEALTH_OK},
			{Index: 1, Health: health},
		},
		Conditions: []*fleetpb.Condition{{Type: "Ready", Status: true, Reason: "ok"}},
		Gauges: []*fleetpb.GpuGauges{
			{Index: 0, Utilization: util, TemperatureC: 40 + util*40, MemoryUsedMib: uint64(util * 80000)},
			{Index: 1, Utilization: util, TemperatureC: 41, MemoryUsedMib: 1},
		},
	}}}
}

// A status report whose gauges alone changed publishes nothing; a change of
// health publishes one status_changed.
func TestStatusPublishedOnlyWhenChanged(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	c, w := gw.connect(t, "n1", "p")

	c.send(statusMsg(1, fleetpb.GpuHealth_GPU_HEALTH_OK, 0.1))
	c.expectAck(1)
	c.send(statusMsg(2, fleetpb.GpuHealth_GPU_HEALTH_OK, 0.9)) // gauges only
	c.expectAck(2)
	c.send(statusMsg(3, fleetpb.GpuHealth_GPU_HEALTH_DEGRADED, 0.9))
	c.expectAck(3)

	// Events are stored in order, so once the third is there, a second
	// one would be too.
	got := b.waitEvents(t, "two status changes", 2, is(kindStatus))
	if len(got) != 2 {
		t.Fatalf("%d status_changed events, want 2 (the gauges-only report must publish nothing)", len(got))
	}
	first, second := got[0].ev.GetStatusChanged(), got[1].ev.GetStatusChanged()
	if first.GetStatusHash() != StatusHash(statusMsg(1, fleetpb.GpuHealth_GPU_HEALTH_OK, 0.1).GetStatus()) {
		t.Error("first status hash does not match StatusHash")
	}
	if first.GetStatusHash() != StatusHash(statusMsg(2, fleetpb.GpuHealth_GPU_HEALTH_OK, 0.9).GetStatus()) {
		t.Error("gauges changed the status hash")
	}
	if first.GetStatusHash() == second.GetStatusHash() || len(second.GetStatusHash()) != 64 {
		t.Errorf("hashes %q and %q", first.GetStatusHash(), second.GetStatusHash())
	}
	if second.GetGpus()[1].GetHealth() != fleetpb.GpuHealth_GPU_HEALTH_DEGRADED {
		t.Errorf("second status %v", second)
	}
	if id := got[1].msg.Header.Get(envelope.MsgID); !strings.HasPrefix(id, w.GetSessionId()+"/") {
		t.Errorf("msg id %q does not name the session", id)
	}
}

// Heartbeats are never published one by one: N heartbeats from M nodes in
// two pools become one LivenessBatch per pool per flush, with each node's
// age at observed_at.
func TestHeartbeatsBecomeLivenessBatches(t *testing.T) {
	b := newBackbone(t)
	clock := &fakeClock{}
	t0 := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	clock.Set(t0)
	// The ticker never fires here: the test flushes by hand.
	gw := startGateway(t, b, Config{HeartbeatInterval: time.Hour, FlushInterval: time.Hour}, withClock(clock))

	const nodes, beats = 6, 10
	clients := make([]*client, nodes)
	for i := range clients {
		pool := []string{"pa", "pb"}[i%2]
		clients[i], _ = gw.connect(t, "n"+string(rune('0'+i)), pool)
	}
	for i, c := range clients {
		clock.Set(t0.Add(time.Duration(i) * 100 * time.Millisecond))
		for range beats {
			c.heartbeat()
			c.expectAck(c.seq)
		}
	}
	observed := t0.Add(time.Second)
	clock.Set(observed)
	gw.srv.flushLiveness(context.Background())
	gw.srv.flushLiveness(context.Background()) // nothing heard since: no message

	batches := b.liveness(t)
	if len(batches) != 2 {
		t.Fatalf("%d liveness messages for %d heartbeats, want 2 (one per pool)", len(batches), nodes*beats)
	}
	seen := map[string]bool{}
	for _, lb := range batches {
		if lb.GetGatewayId() != "gw-test" || !lb.GetObservedAt().AsTime().Equal(observed) {
			t.Errorf("batch %v", lb)
		}
		for _, na := range lb.GetNodes() {
			i := int(na.GetNodeId()[1] - '0')
			if want := []string{"pa", "pb"}[i%2]; lb.GetPool() != want {
				t.Errorf("node %s in pool %s's batch", na.GetNodeId(), lb.GetPool())
			}
			if want := uint32(1000 - 100*i); na.GetAgeMs() != want {
				t.Errorf("node %s age %d ms, want %d", na.GetNodeId(), na.GetAgeMs(), want)
			}
			if na.GetSessionId() == "" || seen[na.GetNodeId()] {
				t.Errorf("node %s: session %q, seen twice: %v", na.GetNodeId(), na.GetSessionId(), seen[na.GetNodeId()])
			}
			seen[na.GetNodeId()] = true
		}
	}
	if len(seen) != nodes {
		t.Fatalf("batches name %d nodes, want %d", len(seen), nodes)
	}
	for _, m := range b.stored(t, subjects.StreamFleetNodes) {
		if m.Header.Get(envelope.Kind) == envelope.KindLiveness {
			pool := m.Header.Get(envelope.Pool)
			if m.Subject != subjects.FleetLiveness(pool) || m.Header.Get(envelope.MsgID) == "" ||
				m.Header.Get(envelope.Schema) != envelope.SchemaFleetV1 || m.Header.Get(envelope.Gateway) != "gw-test" {
				t.Errorf("liveness message %s headers %v", m.Subject, m.Header)
			}
		}
	}
}

// With the flush ticker running, a burst of heartbeats still becomes a
// handful of batches.
func TestLivenessFlushTicker(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{HeartbeatInterval: time.Second, FlushInterval: 100 * time.Millisecond})
	c, _ := gw.connect(t, "n1", "p")
	const beats = 40
	for range beats {
		c.heartbeat()
		c.expectAck(c.seq)
	}
	poll.Until(t, "a liveness batch", func() bool { return len(b.liveness(t)) > 0 })
	if n := len(b.liveness(t)); n >= beats/2 {
		t.Fatalf("%d liveness messages for %d heartbeats", n, beats)
	}
}

// failingLiveness refuses the first `fail` liveness batches.
type failingLiveness struct {
	Publisher
	fail atomic.Int32
}

func (f *failingLiveness) PublishAsync(m *nats.Msg) (*streams.Future, error) {
	if m.Header.Get(envelope.Kind) == envelope.KindLiveness && f.fail.Add(-1) >= 0 {
		return nil, errors.New("backbone unavailable")
	}
	return f.Publisher.PublishAsync(m)
}

// A liveness batch that is not stored is not lost: the next flush carries
// its nodes, with the age of their last heartbeat, though they sent none
// since.
func TestLostLivenessBatchIsResent(t *testing.T) {
	b := newBackbone(t)
	clock := &fakeClock{}
	t0 := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	clock.Set(t0)
	pub := &failingLiveness{Publisher: b.pub}
	pub.fail.Store(2)
	gw := startGateway(t, b, Config{HeartbeatInterval: time.Hour, FlushInterval: time.Hour}, withClock(clock), withPublisher(pub))
	c, _ := gw.connect(t, "n1", "p")
	c.heartbeat()
	c.expectAck(c.seq)
	for i := 1; i <= 3; i++ {
		clock.Set(t0.Add(time.Duration(i) * 5 * time.Second))
		gw.srv.flushLiveness(context.Background())
	}
	batches := b.liveness(t)
	if len(batches) != 1 || len(batches[0].GetNodes()) != 1 {
		t.Fatalf("after two lost batches and a third flush: %d batches stored (%v), want one naming n1", len(batches), batches)
	}
	if na := batches[0].GetNodes()[0]; na.GetNodeId() != "n1" || na.GetAgeMs() != 15000 {
		t.Fatalf("resent entry %v, want n1 aged 15000 ms", na)
	}
	gw.srv.flushLiveness(context.Background())
	if n := len(b.liveness(t)); n != 1 {
		t.Fatalf("%d batches after a flush with nothing heard, want still 1", n)
	}
}

// A pool with more nodes heard than fit one batch gets several.
func TestLivenessChunks(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	list := make([]liveness, 0, 25001)
	for i := range 25000 {
		list = append(list, liveness{key: nodeKey{pool: "big", node: "n" + itoa(i)}, session: "s"})
	}
	list = append(list, liveness{key: nodeKey{pool: "small", node: "x"}, session: "s"})
	out := gw.srv.livenessBatches(list, time.Now(), 1)
	var sizes []int
	ids := map[string]bool{}
	for _, o := range out {
		sizes = append(sizes, len(o.sessions))
		ids[o.msg.Header.Get(envelope.MsgID)] = true
	}
	if len(out) != 4 || sizes[0] != 10000 || sizes[1] != 10000 || sizes[2] != 5000 || sizes[3] != 1 || len(ids) != 4 {
		t.Fatalf("chunks %v (%d distinct ids), want [10000 10000 5000 1]", sizes, len(ids))
	}
}

func itoa(i int) string {
	if i == 0 {
		return "0"
	}
	var b []byte
	for ; i > 0; i /= 10 {
		b = append([]byte{byte('0' + i%10)}, b...)
	}
	return string(b)
}

// A session that sends nothing for the heartbeat timeout is closed and its
// disconnect says why.
func TestHeartbeatTimeout(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{HeartbeatInterval: 100 * time.Millisecond, HeartbeatTimeout: 300 * time.Millisecond, FlushInterval: 50 * time.Millisecond})
	c, w := gw.connect(t, "n1", "p")
	err := c.end()
	if status.Code(err) != codes.DeadlineExceeded {
		t.Fatalf("status %v, want DEADLINE_EXCEEDED", err)
	}
	got := b.waitEvents(t, "disconnect", 1, is(kindDisconnected))
	if got[0].ev.GetDisconnected().GetReason() != reasonHeartbeatTimeout || got[0].ev.GetSessionId() != w.GetSessionId() {
		t.Fatalf("disconnect %v", got[0].ev)
	}
}

// A node that closes its session cleanly is disconnected "closed".
func TestCloseSend(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	c, _ := gw.connect(t, "n1", "p")
	c.st.CloseSend()
	if err := c.end(); !errors.Is(err, io.EOF) {
		t.Fatalf("status %v after a clean close, want OK", err)
	}
	got := b.waitEvents(t, "disconnect", 1, is(kindDisconnected))
	if r := got[0].ev.GetDisconnected().GetReason(); r != reasonClosed {
		t.Fatalf("reason %q", r)
	}
	poll.Until(t, "no session left", func() bool { return gw.srv.Sessions() == 0 })
}

// A newer session for the same node replaces the older one, which gets
// Refusal "replaced"; the old disconnect is stored before the new connect.
func TestNewerSessionReplacesOlder(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	old, w1 := gw.connect(t, "n1", "p")
	cur, w2 := gw.connect(t, "n1", "p")
	if w1.GetSessionId() == w2.GetSessionId() {
		t.Fatal("two sessions share an id")
	}
	r, err := old.refused()
	checkRefusal(t, r, err, CodeReplaced, codes.Aborted)
	cur.sync() // the new session works

	evs := b.waitEvents(t, "events", 3, func(*fleetpb.NodeEvent) bool { return true })
	if len(evs) != 3 ||
		evs[0].ev.GetConnected() == nil || evs[0].ev.GetSessionId() != w1.GetSessionId() ||
		evs[1].ev.GetDisconnected().GetReason() != reasonReplaced || evs[1].ev.GetSessionId() != w1.GetSessionId() ||
		evs[2].ev.GetConnected() == nil || evs[2].ev.GetSessionId() != w2.GetSessionId() {
		for _, e := range evs {
			t.Logf("event %v", e.ev)
		}
		t.Fatal("want connect(old), disconnect(old, replaced), connect(new)")
	}
	poll.Until(t, "one session", func() bool { return gw.srv.Sessions() == 1 })
}

// The inventory is republished every ResyncEvery with the allocations the
// node holds now.
func TestResync(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{ResyncEvery: 200 * time.Millisecond, FlushInterval: 20 * time.Millisecond, HeartbeatInterval: time.Second})
	c, w := gw.connect(t, "n1", "p")
	c.send(allocMsg("a1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND))
	b.waitEvents(t, "allocation", 1, is(kindAllocation))
	got := b.waitEvents(t, "a resync with the allocation", 1, func(ev *fleetpb.NodeEvent) bool {
		return ev.GetConnected() != nil && len(ev.GetConnected().GetAllocations()) == 1
	})
	if got[0].ev.GetSessionId() != w.GetSessionId() || got[0].msg.Header.Get(envelope.MsgID) == w.GetSessionId()+"/1" {
		t.Fatalf("resync %v id %s", got[0].ev, got[0].msg.Header.Get(envelope.MsgID))
	}
}

func allocMsg(id string, st fleetpb.AllocationState) *fleetpb.NodeMessage {
	return &fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Allocation{Allocation: &fleetpb.AllocationReport{AllocationId: id, State: st}}}
}

// Drain sends every session "draining" with a short retry_after, stores
// their disconnects, refuses new sessions, and ends Run.
func TestDrain(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	var clients []*client
	for _, id := range []string{"n1", "n2", "n3"} {
		c, _ := gw.connect(t, id, "p")
		c.heartbeat()
		c.expectAck(c.seq)
		clients = append(clients, c)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := gw.srv.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	for _, c := range clients {
		r, err := c.refused()
		checkRefusal(t, r, err, CodeDraining, codes.Unavailable)
		if d := r.GetRetryAfter().AsDuration(); d < 0 || d >= maxDrainRetry {
			t.Errorf("draining retry_after %s, want [0, %s)", d, maxDrainRetry)
		}
	}
	// Drain returned after the disconnects were stored.
	n := 0
	for _, e := range b.nodeEvents(t) {
		if e.ev.GetDisconnected().GetReason() == reasonDraining {
			n++
		}
	}
	if n != 3 {
		t.Fatalf("%d draining disconnects stored when Drain returned, want 3", n)
	}
	if len(b.liveness(t)) == 0 {
		t.Error("no last liveness batch")
	}
	select {
	case <-gw.runDone:
		gw.runDone <- nil
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after Drain")
	}
	late := openSession(t, gw.nodeConn(t, nil, "n4", "p"), helloMsg(testHello("n4", "p")))
	r, err := late.refused()
	checkRefusal(t, r, err, CodeDraining, codes.Unavailable)
}
