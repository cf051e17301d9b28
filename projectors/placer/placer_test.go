package placer

import (
	"bytes"
	"context"
	"fmt"
	"go/build"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
)

func TestBestFit(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 8, "H100", 80000, nil)
	e.addNode("n2", "p", 4, "H100", 80000, nil)
	e.addNode("n3", "p", 2, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("r1", "p", 2), e.request("r2", "p", 3), e.request("r3", "p", 1), e.request("r4", "p", 8))
	want := map[string][]string{
		"r1": {"n3:[0 1]"}, // exactly two free: the tightest
		"r2": {"n2:[0 1 2]"},
		"r3": {"n2:[3]"}, // n2 has one left, n1 eight
		"r4": {"n1:[0 1 2 3 4 5 6 7]"},
	}
	for rid, w := range want {
		if got := e.liveOf(rid); !slices.Equal(got, w) {
			t.Errorf("%s on %v, want %v", rid, got, w)
		}
		if st, _ := e.status(rid); st != "PLACED" {
			t.Errorf("%s is %s, want PLACED", rid, st)
		}
	}
	// Ties go to the lowest node id.
	e.addNode("m2", "q", 4, "A", 1, nil)
	e.addNode("m1", "q", 4, "A", 1, nil)
	e.apply(p, e.request("t1", "q", 4))
	if got := e.liveOf("t1"); !slices.Equal(got, []string{"m1:[0 1 2 3]"}) {
		t.Errorf("t1 on %v, want m1", got)
	}
	e.checkInvariants()
	e.checkIndex(p)
}

func TestConstraints(t *testing.T) {
	e := newEnv(t)
	e.addNode("a100-small", "p", 4, "A100", 40000, map[string]string{"zone": "a"})
	e.addNode("a100-big", "p", 4, "A100", 80000, map[string]string{"zone": "b"})
	e.addNode("h100", "p", 2, "H100", 80000, map[string]string{"zone": "a", "rack": "r1"})
	p := e.placer(Config{})
	e.apply(p,
		e.request("model", "p", 2, model("H100")),
		e.request("mem", "p", 1, minMem(60000), model("A100")),
		e.request("zone", "p", 1, label("zone", "a"), model("A100")),
		e.request("nomatch", "p", 1, label("zone", "c")),
		e.request("toobig", "p", 3, model("H100")),
	)
	for rid, w := range map[string][]string{
		"model":   {"h100:[0 1]"},
		"mem":     {"a100-big:[0]"},
		"zone":    {"a100-small:[0]"},
		"nomatch": nil,
		"toobig":  nil,
	} {
		if got := e.liveOf(rid); !slices.Equal(got, w) {
			t.Errorf("%s on %v, want %v", rid, got, w)
		}
	}
	if st, _ := e.status("nomatch"); st != "PENDING" {
		t.Errorf("nomatch is %s, want PENDING", st)
	}
	e.checkInvariants()
	e.checkIndex(p)
}

func TestMixedNode(t *testing.T) {
	e := newEnv(t)
	e.addNode("mix", "p", 4, "A100", 40000, nil)
	e.exec(`update fleet_devices set model = 'H100', memory_mib = 80000 where node_id = 'mix' and gpu_index >= 2`)
	e.addNode("h", "p", 3, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("r1", "p", 2, model("H100")), e.request("r2", "p", 2, model("A100")), e.request("r3", "p", 1, model("H100")))
	for rid, w := range map[string][]string{
		"r1": {"mix:[2 3]"}, // two matching free on mix beat three on h
		"r2": {"mix:[0 1]"},
		"r3": {"h:[0]"},
	} {
		if got := e.liveOf(rid); !slices.Equal(got, w) {
			t.Errorf("%s on %v, want %v", rid, got, w)
		}
	}
	e.checkIndex(p)
}

func TestWholeNodes(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 8, "H100", 80000, nil)
	e.addNode("n2", "p", 8, "H100", 80000, nil)
	e.addNode("n3", "p", 4, "H100", 80000, nil)
	e.addNode("n4", "p", 8, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("g", "p", 1))
	// g took n3 (best fit for one GPU), so only n1, n2 and n4 are whole.
	e.apply(p, e.request("w", "p", 0, wholeNodes(2)), e.request("w2", "p", 0, wholeNodes(2)))
	if got := e.liveOf("w"); !slices.Equal(got, []string{"n1:[0 1 2 3 4 5 6 7]", "n2:[0 1 2 3 4 5 6 7]"}) {
		t.Errorf("w on %v", got)
	}
	if got := e.liveOf("w2"); got != nil {
		t.Errorf("w2 on %v, want pending", got)
	}
	var whole bool
	if err := e.pool.QueryRow(context.Background(), `select bool_and(whole_node) from fleet_allocations where reservation_id = 'w'`).Scan(&whole); err != nil || !whole {
		t.Errorf("whole_node %v %v", whole, err)
	}
	// A failed GPU makes a node not whole.
	e.setGPU("n4", 3, "failed")
	e.apply(p, e.cancel("g", "p"))
	e.report("g/1/0", "unbound")
	e.sweep(p)
	e.apply(p, e.request("w1", "p", 0, wholeNodes(1)))
	if got := e.liveOf("w1"); !slices.Equal(got, []string{"n3:[0 1 2 3]"}) {
		t.Errorf("w1 on %v, want n3", got)
	}
	e.checkInvariants()
	e.checkIndex(p)
}

func TestCancel(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("placed", "p", 4), e.request("waiting", "p", 2))
	e.apply(p, e.cancel("waiting", "p"), e.cancel("placed", "p"), e.cancel("unknown", "p"))
	got := e.decisions()
	want := []string{
		"placed/place/1 placed n1:[0 1 2 3]",
		"waiting/cancel released cancelled requeued=false []",
		"placed/release/1 released cancelled requeued=false [placed/1/0]",
	}
	if !slices.Equal(got, want) {
		t.Fatalf("decisions\n got  %q\n want %q", got, want)
	}
	for _, rid := range []string{"placed", "waiting"} {
		if st, _ := e.status(rid); st != "CANCELLED" {
			t.Errorf("%s is %s", rid, st)
		}
	}
	var ended bool
	if err := e.pool.QueryRow(context.Background(), `select ended_at is not null and end_reason = 'cancelled' from fleet_placements where reservation_id = 'placed'`).Scan(&ended); err != nil || !ended {
		t.Errorf("placement not ended: %v", err)
	}
	// The GPUs are free again once the node has confirmed the unbind; a
	// second cancel and a resent request are no-ops.
	e.report("placed/1/0", "unbound")
	e.sweep(p)
	e.apply(p, e.cancel("placed", "p"), e.request("placed", "p", 1), e.request("next", "p", 4))
	if got := e.liveOf("next"); !slices.Equal(got, []string{"n1:[0 1 2 3]"}) {
		t.Errorf("next on %v", got)
	}
	if n := len(e.decisions()); n != 5 {
		t.Errorf("%d decisions, want 5: %q", n, e.decisions())
	}
	e.checkInvariants()
	e.checkIndex(p)
}

func TestCancelOrderInBatch(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{})
	// A cancellation before its request does nothing; after it, it ends the
	// reservation before it is placed.
	e.apply(p, e.cancel("early", "p"), e.request("early", "p", 1), e.request("late", "p", 1), e.cancel("late", "p"))
	if st, _ := e.status("early"); st != "PLACED" {
		t.Errorf("early is %s", st)
	}
	if st, _ := e.status("late"); st != "CANCELLED" {
		t.Errorf("late is %s", st)
	}
	live := e.digest()
	// The same messages one per batch give the same rows.
	if got := e.replay(1); !mapsEqual(got, live) {
		t.Errorf("replay one by one differs:\n%v\n%v", got, live)
	}
}

func TestRepairUnreachable(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	e.addNode("n2", "p", 8, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("r", "p", 4), e.request("w", "p", 0, wholeNodes(1)))
	if got := e.liveOf("r"); !slices.Equal(got, []string{"n1:[0 1 2 3]"}) {
		t.Fatalf("r on %v", got)
	}
	e.setNode("n1", "suspect", true)
	e.sweep(p) // suspect is not unreachable: nothing moves
	if got := e.liveOf("r"); !slices.Equal(got, []string{"n1:[0 1 2 3]"}) {
		t.Fatalf("r on %v after suspect", got)
	}
	e.setNode("n1", "unreachable", false)
	e.setNode("n2", "healthy", true)
	e.apply(p, e.cancel("w", "p"))
	e.report("w/1/0", "unbound")
	e.advance(time.Second)
	e.sweep(p)
	if got := e.liveOf("r"); !slices.Equal(got, []string{"n2:[0 1 2 3]"}) {
		t.Errorf("r on %v after repair, want n2", got)
	}
	d := e.decisions()
	if !slices.Contains(d, "r/release/1 released node_unreachable requeued=true [r/1/0]") ||
		!slices.Contains(d, "r/place/2 placed n2:[0 1 2 3]") {
		t.Errorf("decisions %q", d)
	}
	var n int
	e.pool.QueryRow(context.Background(), `select count(*) from fleet_bookings where node_id = 'n1'`).Scan(&n)
	if n != 0 {
		t.Errorf("%d bookings left on the unreachable node", n)
	}
	e.checkInvariants()
	e.checkIndex(p)
}

// TestApplySweepsWhenOverdue: with requests arriving all the time the
// runner never sweeps; Apply then applies the policies itself.
func TestApplySweepsWhenOverdue(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	e.addNode("n2", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{SweepOverdue: 10 * time.Second})
	e.apply(p, e.request("r", "p", 4))
	e.report("r/1/0", "bound")
	node := strings.Split(e.liveOf("r")[0], ":")[0]
	e.setNode(node, "unreachable", false)
	for i := 0; i < 5; i++ {
		e.advance(time.Second)
		e.apply(p, e.request(fmt.Sprintf("x%d", i), "q", 1)) // another pool: nothing to place
	}
	if got := e.liveOf("r"); len(got) != 1 || !strings.HasPrefix(got[0], node+":") {
		t.Fatalf("r moved before a sweep was due: %v", got)
	}
	e.advance(6 * time.Second)
	e.apply(p, e.request("y", "q", 1))
	if got := e.liveOf("r"); len(got) != 1 || strings.HasPrefix(got[0], node+":") {
		t.Errorf("r on %v: not repaired by an overdue Apply", got)
	}
	e.checkIndex(p)
}

func TestBindTimeoutAndFailure(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 2, "H100", 80000, nil)
	e.addNode("n2", "p", 2, "H100", 80000, nil)
	p := e.placer(Config{BindTimeout: 30 * time.Second})
	e.apply(p, e.request("bound", "p", 2), e.request("slow", "p", 2))
	e.report("bound/1/0", "bound")
	e.advance(29 * time.Second)
	e.sweep(p)
	if st, _ := e.status("slow"); st != "PLACED" {
		t.Fatalf("slow is %s before the timeout", st)
	}
	if st, _ := e.status("bound"); st != "ACTIVE" {
		t.Errorf("bound is %s", st)
	}
	e.advance(2 * time.Second)
	e.sweep(p)
	d := e.decisions()
	if !slices.Contains(d, "slow/release/1 released bind_timeout requeued=true [slow/1/0]") {
		t.Errorf("no bind timeout: %q", d)
	}
	// Its GPUs are bookable again once the node answered the Unbind.
	e.report("slow/1/0", "unbound")
	e.sweep(p)
	// Placed again (on the same node: it is the only room).
	if got := e.liveOf("slow"); len(got) != 1 {
		t.Fatalf("slow on %v", got)
	}
	e.report("slow/2/0", "failed")
	e.sweep(p)
	if d := e.decisions(); !slices.Contains(d, "slow/release/2 released bind_failed requeued=true [slow/2/0]") {
		t.Errorf("no bind failure: %q", d)
	}
	if st, _ := e.status("bound"); st != "ACTIVE" {
		t.Errorf("bound is %s after sweeps", st)
	}
	e.checkInvariants()
	e.checkIndex(p)
}

func TestRepairAvoidsTheNodeOnce(t *testing.T) {
	e := newEnv(t)
	e.addNode("a", "p", 2, "H100", 80000, nil)
	e.addNode("b", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("r", "p", 2))
	if got := e.liveOf("r"); !slices.Equal(got, []string{"a:[0 1]"}) {
		t.Fatalf("r on %v", got)
	}
	e.report("r/1/0", "failed")
	e.sweep(p)
	// Best fit would pick a again; the repair tries elsewhere first.
	if got := e.liveOf("r"); !slices.Equal(got, []string{"b:[0 1]"}) {
		t.Errorf("r on %v after a failed bind, want b", got)
	}
	// With no room elsewhere it goes back where it was.
	e.apply(p, e.request("fill", "p", 2))
	e.report("r/2/0", "failed")
	e.sweep(p)
	if got := e.liveOf("r"); !slices.Equal(got, []string{"b:[0 1]"}) {
		t.Errorf("r on %v after a second failed bind, want b again", got)
	}
	e.checkIndex(p)
}

func TestPendingTimeout(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{PendingTimeout: 5 * time.Minute})
	e.apply(p, e.request("hog", "p", 1), e.request("never", "p", 16), e.request("busy", "p", 0, wholeNodes(1)))
	e.report("hog/1/0", "bound")
	e.advance(4 * time.Minute)
	e.sweep(p)
	for _, rid := range []string{"never", "busy"} {
		if st, _ := e.status(rid); st != "PENDING" {
			t.Errorf("%s is %s before the timeout", rid, st)
		}
	}
	e.addNode("n2", "p", 16, "H100", 80000, nil) // nodes can join
	e.sweep(p)
	if st, _ := e.status("never"); st != "PLACED" {
		t.Errorf("never is %s once a node can hold it", st)
	}
	e.report("never/1/0", "bound")
	e.advance(2 * time.Minute)
	e.sweep(p)
	st, reason := e.status("busy")
	if st != "FAILED" || !strings.HasPrefix(reason, "no capacity: ") {
		t.Errorf("busy is %s %q: %q", st, reason, e.decisions())
	}
	e.apply(p, e.request("huge", "p", 64))
	e.advance(6 * time.Minute)
	e.sweep(p)
	if st, reason := e.status("huge"); st != "FAILED" || !strings.Contains(reason, "has no nodes that can hold 64 GPUs") {
		t.Errorf("huge is %s %q", st, reason)
	}
	e.checkInvariants()
	e.checkIndex(p)
}

func TestInvalidSpecFails(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("none", "p", 0), e.request("both", "p", 2, func(s *specT) { s.Nodes = 1 }))
	for _, rid := range []string{"none", "both"} {
		st, reason := e.status(rid)
		if st != "FAILED" || !strings.HasPrefix(reason, "invalid spec: ") {
			t.Errorf("%s is %s %q", rid, st, reason)
		}
	}
	e.checkIndex(p)
}

func TestPoison(t *testing.T) {
	e := newEnv(t)
	p := e.placer(Config{})
	good := e.request("ok", "p", 1)
	for name, bad := range map[string]*msg{
		"garbage":   {data: []byte{0xff, 0x01}, hdr: good.hdr, seq: 90},
		"kind":      {data: good.data, hdr: map[string]string{envelope.Schema: envelope.SchemaFleetV1, envelope.Kind: "node"}, seq: 91},
		"schema":    {data: good.data, hdr: map[string]string{envelope.Schema: "bes.v1", envelope.Kind: envelope.KindReservation}, seq: 92},
		"empty":     {data: nil, hdr: good.hdr, seq: 93},
		"otherpool": {data: good.data, hdr: map[string]string{envelope.Schema: envelope.SchemaFleetV1, envelope.Kind: envelope.KindReservation, envelope.Pool: "q"}, seq: 94},
	} {
		err := e.tryApply(p, good, bad)
		pe, ok := projection.AsPoison(err)
		if !ok || pe.Seq != bad.seq {
			t.Errorf("%s: %v, want poison of %d", name, err, bad.seq)
		}
	}
	e.apply(p, good)
	if st, _ := e.status("ok"); st != "PENDING" {
		t.Errorf("ok is %s", st)
	}
}

func TestRestartRebuildsQueue(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("a", "p", 4), e.request("b", "p", 4), e.request("c", "p", 2))
	e.setNode("n1", "unreachable", false)
	e.addNode("n2", "p", 4, "H100", 80000, nil)
	e.sweep(p) // a moves to n2; b and c still wait
	// A new process: its queue comes from the tables, in request order.
	q := e.placer(Config{})
	e.apply(q, e.cancel("a", "p"))
	e.report("a/2/0", "unbound")
	e.sweep(q)
	if got := e.liveOf("b"); !slices.Equal(got, []string{"n2:[0 1 2 3]"}) {
		t.Errorf("b on %v, want n2 (before c, in request order)", got)
	}
	e.checkIndex(q)
	var gen int
	for _, en := range q.queued() {
		if en.id == "c" {
			gen = en.gen
		}
	}
	if gen != 1 {
		t.Errorf("c's next generation %d", gen)
	}
	e.checkInvariants()
}

// TestAbortedReloads: a rolled-back transaction leaves no trace in the
// index or the queue.
func TestAbortedReloads(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{})
	ctx := context.Background()
	m := e.request("r", "p", 4)
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Apply(ctx, tx, asMessages([]*msg{m})); err != nil {
		t.Fatal(err)
	}
	tx.Rollback(ctx)
	p.Aborted()
	e.apply(p, e.request("s", "p", 4))
	if got := e.liveOf("s"); !slices.Equal(got, []string{"n1:[0 1 2 3]"}) {
		t.Errorf("s on %v: the rolled-back booking lingered", got)
	}
	e.apply(p, m) // redelivered
	if st, _ := e.status("r"); st != "PENDING" {
		t.Errorf("r is %s", st)
	}
	e.checkIndex(p)
	e.checkInvariants()
}

// TestRefreshSeesLateCommits: a node change whose rev was drawn before
// others but committed after them is still read.
func TestRefreshSeesLateCommits(t *testing.T) {
	e := newEnv(t)
	e.addNode("slow", "p", 4, "H100", 80000, nil)
	e.addNode("fast", "p", 4, "H100", 80000, nil)
	e.setNode("slow", "unreachable", false)
	p := e.placer(Config{})
	e.sweep(p)
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, `update fleet_nodes set state = 'healthy', connected = true, rev = nextval('fleet_rev') where node_id = 'slow'`); err != nil {
		t.Fatal(err)
	}
	e.setNode("fast", "healthy", true) // a higher rev, committed first
	e.sweep(p)
	e.sweep(p)
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	e.sweep(p)
	e.checkIndex(p)
	if n := p.idx.nodes[nodeKey{"p", "slow"}]; !n.placeable() {
		t.Errorf("the late change of slow was missed: %s", p.idx.view()["p/slow"])
	}
}

func TestGuardRejectsStalePlans(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	e.addNode("n2", "p", 4, "H100", 80000, nil)
	a, b := e.placer(Config{}), e.placer(Config{})
	e.sweep(a)
	e.sweep(b) // both load the empty fleet
	e.apply(a, e.request("ra", "p", 4))
	// b's index still thinks n1 is free; its plan is rejected and it
	// places on n2 instead, in the same transaction.
	e.apply(b, e.request("rb", "p", 4))
	if got := e.liveOf("rb"); !slices.Equal(got, []string{"n2:[0 1 2 3]"}) {
		t.Errorf("rb on %v, want n2", got)
	}
	e.checkInvariants()
	e.checkIndex(b)
	// A node that turned unhealthy after c's index read it (its rev hidden
	// from c's refresh): the FOR SHARE re-check refuses it.
	e.apply(a, e.cancel("ra", "p"))
	e.report("ra/1/0", "unbound")
	e.sweep(a)
	c := e.placer(Config{})
	e.sweep(c)
	e.setNode("n1", "unreachable", false)
	e.exec(`update fleet_nodes set rev = 0 where node_id = 'n1'`)
	e.apply(c, e.request("rc", "p", 4))
	if got := e.liveOf("rc"); got != nil {
		t.Errorf("rc placed on %v: n1 is unreachable", got)
	}
	if c.idx.nodes[nodeKey{"p", "n1"}].placeable() {
		t.Error("the guard did not correct c's picture of n1")
	}
	e.checkInvariants()
	e.checkIndex(c)
}

func TestOutboxRows(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "gpu pool.a", 2, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("r/1", "gpu pool.a", 2))
	rows := e.outbox()
	if len(rows) != 1 {
		t.Fatalf("%d outbox rows", len(rows))
	}
	r := rows[0]
	if r.subject != "fleet.place.gpu%20pool%2Ea" || r.msgID != "r/1/place/1" || r.decision.GetDecisionId() != r.msgID {
		t.Errorf("row %s %s %s", r.subject, r.msgID, r.decision.GetDecisionId())
	}
	want := map[string]string{envelope.Schema: envelope.SchemaFleetV1, envelope.Kind: envelope.KindDecision,
		envelope.Pool: "gpu pool.a", envelope.Reservation: "r/1"}
	if !mapsEqual(r.headers, want) {
		t.Errorf("headers %v", r.headers)
	}
	if !r.decision.GetAt().AsTime().Equal(e.now.Truncate(time.Microsecond)) {
		t.Errorf("decision at %v, clock %v", r.decision.GetAt().AsTime(), e.now)
	}
}

func TestConfig(t *testing.T) {
	if err := (Config{}).Validate(); err != nil {
		t.Errorf("zero config: %v", err)
	}
	for _, c := range []Config{{BindTimeout: -1}, {PendingTimeout: -1}, {Rounds: -1}, {PendingTimeout: time.Second}} {
		if c.Validate() == nil {
			t.Errorf("%+v is valid", c)
		}
	}
	d := Config{}.withDefaults()
	if d.BindTimeout != 30*time.Second || d.PendingTimeout != 10*time.Minute || d.Rounds != 3 {
		t.Errorf("defaults %+v", d)
	}
}

// TestNewConfig: New refuses each negative field, naming it, but for the
// two whose negative means something; a zero field takes its default.
func TestNewConfig(t *testing.T) {
	for field, c := range map[string]Config{
		"BindTimeout":    {BindTimeout: -1},
		"PendingTimeout": {PendingTimeout: -1},
		"Rounds":         {Rounds: -1},
		"UnbindRetry":    {UnbindRetry: -1},
	} {
		if _, err := New(c); err == nil || !strings.Contains(err.Error(), "placer: "+field+" -1") || !strings.Contains(err.Error(), "set 0 for the default") {
			t.Errorf("%s negative: New returned %v, want an error naming it and saying what to set", field, err)
		}
	}
	for field, c := range map[string]Config{"ReloadEvery": {ReloadEvery: -1}, "SweepOverdue": {SweepOverdue: -1}} {
		if _, err := New(c); err != nil {
			t.Errorf("%s negative (never) refused: %v", field, err)
		}
	}
	p, err := New(Config{})
	if err != nil {
		t.Fatal(err)
	}
	c := p.cfg
	if c.Now == nil || c.Subject == nil || c.Logger == nil {
		t.Errorf("no default clock, subject or logger: %+v", c)
	}
	type durations struct {
		bind, pending, reload, sweep, unbind time.Duration
		rounds                               int
	}
	got := durations{c.BindTimeout, c.PendingTimeout, c.ReloadEvery, c.SweepOverdue, c.UnbindRetry, c.Rounds}
	want := durations{DefaultBindTimeout, DefaultPendingTimeout, DefaultReloadEvery, DefaultSweepOverdue, DefaultUnbindRetry, DefaultRounds}
	if got != want {
		t.Errorf("defaults\n got %+v\nwant %+v", got, want)
	}
}

// TestDependencies: a projector has no goroutines of its own and does not
// know NATS (CONTRIBUTING.md, "The backbone").
func TestDependencies(t *testing.T) {
	pkg, err := build.ImportDir(".", 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, imp := range pkg.Imports {
		if strings.Contains(imp, "nats-io") || strings.Contains(imp, "millrace/streams") && imp != "github.com/millrace/millrace/streams/projection" {
			t.Errorf("package placer imports %s", imp)
		}
	}
	for _, name := range pkg.GoFiles {
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(src, []byte("\tgo func")) || bytes.Contains(src, []byte(" go func(")) {
			t.Errorf("%s starts a goroutine", name)
		}
	}
}

func mapsEqual(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || w != v {
			return false
		}
	}
	return true
}

// TestPoolsKeepNodesApart: prod/n1 and sandbox/n1 are two nodes. Each is
// indexed, booked and placed on by itself: a full prod/n1 leaves
// sandbox/n1 free, and the bookings of one never block the other.
func TestPoolsKeepNodesApart(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "prod", 4, "H100", 80000, nil)
	e.addNode("n1", "sandbox", 4, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("in-prod", "prod", 4))
	e.apply(p, e.request("in-sandbox", "sandbox", 4))
	for _, rid := range []string{"in-prod", "in-sandbox"} {
		if got := e.liveOf(rid); !slices.Equal(got, []string{"n1:[0 1 2 3]"}) {
			t.Fatalf("%s on %v, want its pool's n1", rid, got)
		}
	}
	var bookings []string
	rows, err := e.pool.Query(context.Background(), `select pool || '/' || node_id || ':' || gpu_index || ' ' || reservation_id
		from fleet_bookings order by 1`)
	if err == nil {
		bookings, err = pgx.CollectRows(rows, pgx.RowTo[string])
	}
	if err != nil || len(bookings) != 8 || bookings[0] != "prod/n1:0 in-prod" || bookings[4] != "sandbox/n1:0 in-sandbox" {
		t.Fatalf("bookings = %v, %v", bookings, err)
	}
	// A change of sandbox/n1 (unreachable) releases what sandbox holds
	// there, and nothing of prod's.
	e.exec(`update fleet_nodes set state = 'unreachable', connected = false, rev = nextval('fleet_rev')
		where pool = 'sandbox' and node_id = 'n1'`)
	e.sweep(p)
	if d := e.decisions(); !slices.Contains(d, "in-sandbox/release/1 released node_unreachable requeued=true [in-sandbox/1/0]") ||
		slices.ContainsFunc(d, func(s string) bool { return strings.HasPrefix(s, "in-prod/release") }) {
		t.Fatalf("decisions after sandbox/n1 went unreachable: %q", d)
	}
	if got := e.liveOf("in-prod"); !slices.Equal(got, []string{"n1:[0 1 2 3]"}) {
		t.Fatalf("in-prod on %v after sandbox/n1 went away", got)
	}
	e.checkInvariants()
	e.checkIndex(p)
}

// TestSiblingReportsChangeNothing: an allocation report counts only from
// the node (pool and id) the allocation is placed on. A sibling in the
// pool, or a node of the same id in another pool, cannot bind, unbind or
// fail it.
func TestSiblingReportsChangeNothing(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "prod", 4, "H100", 80000, nil)
	e.addNode("n2", "prod", 4, "H100", 80000, nil)
	e.addNode("n1", "sandbox", 4, "H100", 80000, nil)
	p := e.placer(Config{BindTimeout: 30 * time.Second})
	e.apply(p, e.request("held", "prod", 4), e.request("unheld", "prod", 4))
	if a, b := e.liveOf("held"), e.liveOf("unheld"); !slices.Equal(a, []string{"n1:[0 1 2 3]"}) || !slices.Equal(b, []string{"n2:[0 1 2 3]"}) {
		t.Fatalf("held on %v, unheld on %v", a, b)
	}
	e.report("held/1/0", "bound") // by prod/n1, its node

	// Siblings try to unbind and fail held, and to bind unheld.
	e.reportAs("prod", "n2", "held/1/0", "unbound")
	e.reportAs("sandbox", "n1", "held/1/0", "failed")
	e.reportAs("prod", "n1", "unheld/1/0", "bound")
	e.reportAs("sandbox", "n2", "unheld/1/0", "bound")
	e.sweep(p)
	if st, _ := e.status("held"); st != "ACTIVE" {
		t.Errorf("held is %s after siblings reported it unbound and failed, want ACTIVE", st)
	}
	if st, _ := e.status("unheld"); st != "PLACED" {
		t.Errorf("unheld is %s after siblings reported it bound, want PLACED", st)
	}
	if d := e.decisions(); slices.ContainsFunc(d, func(s string) bool { return strings.Contains(s, "released") }) {
		t.Fatalf("a sibling's report released an allocation: %q", d)
	}
	// Past the bind timeout: unheld was never bound by its own node and
	// is placed again, whatever its siblings said; held stays.
	e.advance(31 * time.Second)
	e.sweep(p)
	d := e.decisions()
	if !slices.Contains(d, "unheld/release/1 released bind_timeout requeued=true [unheld/1/0]") {
		t.Errorf("unheld was not released for its bind timeout: %q", d)
	}
	if slices.ContainsFunc(d, func(s string) bool { return strings.HasPrefix(s, "held/release") }) {
		t.Errorf("held was released: %q", d)
	}
	if st, _ := e.status("held"); st != "ACTIVE" {
		t.Errorf("held is %s, want ACTIVE", st)
	}
	e.checkInvariants()
}

// TestAllocationIDsUnguessable: the allocations of one placement share a
// readable prefix, and each has 128 random bits after it, so that no
// allocation id can be derived from a sibling's.
func TestAllocationIDsUnguessable(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 2, "H100", 80000, nil)
	e.addNode("n2", "p", 2, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("r", "p", 0, wholeNodes(2)))
	live := e.live()
	if len(live) != 2 {
		t.Fatalf("live allocations %+v", live)
	}
	re := regexp.MustCompile(`^r/1/[01]\.([0-9a-f]{32})$`)
	var random []string
	for _, a := range live {
		m := re.FindStringSubmatch(a.id)
		if m == nil {
			t.Fatalf("allocation id %q is not <reservation>/<generation>/<n>.<128 random bits in hex>", a.id)
		}
		random = append(random, m[1])
	}
	if random[0] == random[1] {
		t.Fatalf("two allocations share their random part: %v", random)
	}
}

// TestIdle: the placer says its sweeps have nothing to do (so that the
// runner sweeps it seldom) only after a committed sweep that decided
// nothing while no reservation was pending and nothing was booked or
// fenced; any batch applied ends it.
func TestIdle(t *testing.T) {
	e := newEnv(t)
	p := e.placer(Config{UnbindRetry: 10 * time.Second})
	idle := func(want bool, when string) {
		t.Helper()
		if got := p.Idle(); got != want {
			t.Fatalf("%s: Idle() = %t, want %t", when, got, want)
		}
	}
	idle(false, "before any sweep")
	e.sweep(p)
	idle(true, "an empty fleet swept")
	e.apply(p, e.request("r", "p", 4))
	idle(false, "a request pending, no node")
	e.sweep(p)
	idle(false, "a request pending, swept")
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	e.sweep(p) // places r
	e.sweep(p)
	idle(false, "r placed")
	e.report("r/1/0", "bound")
	e.apply(p, e.cancel("r", "p"))
	e.sweep(p)
	idle(false, "r releasing, unconfirmed")
	e.report("r/1/0", "unbound")
	e.sweep(p) // frees it
	e.sweep(p)
	idle(true, "r freed")

	// A releasing allocation on a node that went unreachable is freed and
	// fences the node: not idle until the node confirmed.
	e.apply(p, e.request("s", "p", 4))
	e.report("s/1/0", "bound")
	e.apply(p, e.cancel("s", "p"))
	e.setNode("n1", "unreachable", false)
	e.sweep(p)
	e.sweep(p)
	idle(false, "n1 fenced")
	// A fence of a node the index does not know still counts: the
	// confirm reads every fence.
	tx, err := e.pool.Begin(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, q := range []string{"delete from fleet_devices where node_id = 'n1'", "delete from fleet_nodes where node_id = 'n1'"} {
		if _, err := tx.Exec(context.Background(), q); err != nil {
			t.Fatal(err)
		}
	}
	fresh := e.placer(Config{})
	if err := fresh.Sweep(context.Background(), tx, e.now); err != nil {
		t.Fatal(err)
	}
	fresh.Committed()
	tx.Rollback(context.Background())
	if fresh.Idle() {
		t.Fatal("a placer that found a fence of an unknown node says it is idle")
	}
	e.setNode("n1", "healthy", true)
	e.report("s/1/0", "unbound")
	e.sweep(p) // unfences
	e.sweep(p)
	idle(true, "n1 unfenced")

	// A transaction that did not commit leaves the placer not knowing.
	pgx.BeginFunc(context.Background(), e.pool, func(tx pgx.Tx) error { return p.Sweep(context.Background(), tx, e.now) })
	p.Aborted()
	idle(false, "after an aborted sweep")
	e.sweep(p)
	idle(true, "swept again")
	e.checkInvariants()
	e.checkIndex(p)
}
