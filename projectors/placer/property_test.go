package placer

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/streams/projection"
)

// fleetModel is what the test knows of the nodes, to check that every
// placement went to a node that was healthy and connected, on GPUs that
// were healthy, when it was made.
type fleetModel struct {
	healthy   map[string]bool
	connected map[string]bool
	failedGPU map[string]map[int]bool
	ngpu      map[string]int
	ids       []string
}

func newFleet(e *env, rng *rand.Rand, nodes int) *fleetModel {
	f := &fleetModel{healthy: map[string]bool{}, connected: map[string]bool{}, failedGPU: map[string]map[int]bool{}, ngpu: map[string]int{}}
	for i := 0; i < nodes; i++ {
		f.add(e, rng, fmt.Sprintf("n%02d", i))
	}
	return f
}

func (f *fleetModel) add(e *env, rng *rand.Rand, id string) {
	ngpu := []int{1, 2, 4, 8}[rng.IntN(4)]
	pool := []string{"a", "b"}[rng.IntN(2)]
	mdl := []string{"A100", "H100"}[rng.IntN(2)]
	mem := []int{40000, 80000}[rng.IntN(2)]
	e.addNode(id, pool, ngpu, mdl, mem, map[string]string{"rack": fmt.Sprintf("r%d", rng.IntN(3))})
	f.healthy[id], f.connected[id], f.ngpu[id] = true, true, ngpu
	f.failedGPU[id] = map[int]bool{}
	f.ids = append(f.ids, id)
}

// mutate changes one node as the liveness projector would.
func (f *fleetModel) mutate(e *env, rng *rand.Rand) {
	id := f.ids[rng.IntN(len(f.ids))]
	switch rng.IntN(5) {
	case 0, 1: // the node fails
		e.setNode(id, "unreachable", false)
		f.healthy[id], f.connected[id] = false, false
	case 2: // it comes back
		e.setNode(id, "healthy", true)
		f.healthy[id], f.connected[id] = true, true
	case 3: // its session drops (it keeps its allocations)
		e.setNode(id, "healthy", false)
		f.connected[id] = false
	case 4: // a GPU fails or recovers
		g := rng.IntN(f.ngpu[id])
		if f.failedGPU[id][g] {
			e.setGPU(id, g, "ok")
			delete(f.failedGPU[id], g)
		} else {
			e.setGPU(id, g, "failed")
			f.failedGPU[id][g] = true
		}
	}
}

// checkPlacements checks the Placed decisions in the outbox after seen.
func (f *fleetModel) checkPlacements(t testing.TB, rows []outboxRow, seen int) {
	t.Helper()
	for _, r := range rows[seen:] {
		for _, a := range r.decision.GetPlaced().GetAllocations() {
			n := a.GetNodeId()
			if !f.healthy[n] || !f.connected[n] {
				t.Fatalf("%s placed on %s, which was not healthy and connected", r.decision.GetDecisionId(), n)
			}
			for _, g := range a.GetGpuIndices() {
				if f.failedGPU[n][int(g)] {
					t.Fatalf("%s placed on failed GPU %s/%d", r.decision.GetDecisionId(), n, g)
				}
			}
		}
	}
}

// randomRequest makes a request with a random spec.
func randomRequest(e *env, rng *rand.Rand, id string) *msg {
	pool := []string{"a", "b"}[rng.IntN(2)]
	var opts []specOpt
	gpus := []int{1, 1, 2, 2, 4, 8}[rng.IntN(6)]
	switch r := rng.IntN(100); {
	case r < 10:
		opts = append(opts, wholeNodes(1+rng.IntN(2)))
	case r < 12:
		gpus = 0 // invalid
	case r < 14:
		gpus = 32 // never fits
	}
	if rng.IntN(5) == 0 {
		opts = append(opts, model([]string{"A100", "H100"}[rng.IntN(2)]))
	}
	if rng.IntN(8) == 0 {
		opts = append(opts, label("rack", fmt.Sprintf("r%d", rng.IntN(3))))
	}
	if rng.IntN(10) == 0 {
		opts = append(opts, minMem(60000))
	}
	return e.request(id, pool, gpus, opts...)
}

// rolledBack runs f in a transaction that is rolled back on purpose.
func (e *env) rolledBack(p *Placer, f func(ctx context.Context, tx pgx.Tx) error) {
	e.t.Helper()
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		e.t.Fatal(err)
	}
	if err := f(ctx, tx); err != nil {
		e.t.Fatal(err)
	}
	if err := tx.Rollback(ctx); err != nil {
		e.t.Fatal(err)
	}
	p.Aborted()
}

func TestProperty(t *testing.T) {
	for seed := uint64(1); seed <= 4; seed++ {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			t.Parallel()
			property(t, seed, 300)
		})
	}
}

// property runs random requests, cancellations, node failures, bind
// reports, sweeps and clock jumps through one placer, rolling some of its
// transactions back, and checks the invariants after every step and the
// replay at the end.
func property(t *testing.T, seed uint64, steps int) {
	rng := rand.New(rand.NewPCG(seed, 99))
	e := newEnv(t)
	fleet := newFleet(e, rng, 14)
	p := e.placer(Config{BindTimeout: 30 * time.Second, PendingTimeout: 3 * time.Minute, ReloadEvery: -1})
	var backlog []*msg // delivered but not committed
	var ids []string
	seen := 0
	for step := 0; step < steps; step++ {
		placerStep, committed := false, false
		switch op := rng.IntN(100); {
		case op < 35:
			for n := 1 + rng.IntN(6); n > 0; n-- {
				switch {
				case len(ids) > 0 && rng.IntN(4) == 0:
					id := ids[rng.IntN(len(ids))]
					backlog = append(backlog, e.cancel(id, "a"))
				case len(ids) > 0 && rng.IntN(15) == 0:
					backlog = append(backlog, randomRequest(e, rng, ids[rng.IntN(len(ids))])) // a resend
				default:
					id := fmt.Sprintf("r%03d", len(ids))
					ids = append(ids, id)
					backlog = append(backlog, randomRequest(e, rng, id))
				}
			}
			placerStep = true
			if rng.IntN(8) == 0 {
				e.rolledBack(p, func(ctx context.Context, tx pgx.Tx) error { return p.Apply(ctx, tx, asMessages(backlog)) })
			} else {
				e.apply(p, backlog...)
				backlog, committed = nil, true
			}
		case op < 55:
			placerStep = true
			if rng.IntN(8) == 0 {
				e.rolledBack(p, func(ctx context.Context, tx pgx.Tx) error { return p.Sweep(ctx, tx, e.now) })
			} else {
				e.sweep(p)
				committed = true
			}
		case op < 70:
			fleet.mutate(e, rng)
		case op < 72:
			fleet.add(e, rng, fmt.Sprintf("n%02d", len(fleet.ids)))
		case op < 80:
			// A node answers an Unbind: of an allocation releasing, or
			// one that fences its node.
			var ids []string
			rows, err := e.pool.Query(context.Background(), `select id from fleet_allocations
				where released_at is not null and (freed_at is null or id in (select allocation_id from fleet_fences))
				order by id`)
			if err != nil {
				t.Fatal(err)
			}
			ids, err = pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil {
				t.Fatal(err)
			}
			if len(ids) > 0 {
				e.report(ids[rng.IntN(len(ids))], "unbound")
			}
		case op < 88:
			if live := e.live(); len(live) > 0 {
				a := live[rng.IntN(len(live))]
				state := "bound"
				if rng.IntN(5) == 0 {
					state = "failed"
				}
				e.report(a.id, state)
			}
		default:
			e.advance(time.Duration(5+rng.IntN(40)) * time.Second)
		}
		e.advance(time.Duration(rng.IntN(3000)) * time.Millisecond)
		rows := e.outbox()
		fleet.checkPlacements(t, rows, seen)
		seen = len(rows)
		e.checkInvariants()
		if placerStep && committed {
			e.checkIndex(p)
		}
		if t.Failed() {
			t.Fatalf("step %d", step)
		}
	}
	if len(backlog) > 0 {
		e.apply(p, backlog...)
	}
	counts := map[string]int{}
	for _, r := range e.outbox() {
		switch d := r.decision; {
		case d.GetPlaced() != nil:
			counts["placed"]++
		case d.GetReleased() != nil:
			counts["released "+d.GetReleased().GetReason()]++
		case d.GetFailed() != nil:
			counts["failed"]++
		case d.GetFreed() != nil:
			counts["freed "+d.GetFreed().GetReason()]++
		case d.GetUnfenced() != nil:
			counts["unfenced"]++
		}
	}
	t.Logf("%d reservations; decisions %v", len(ids), counts)
	if counts["placed"] == 0 || counts["released node_unreachable"]+counts["released bind_timeout"]+counts["released bind_failed"] == 0 {
		t.Errorf("the run did not exercise placement and repair: %v", counts)
	}
	if counts["freed unbound"] == 0 || counts["freed node_unreachable"] == 0 {
		t.Errorf("the run did not exercise release completion and fences: %v", counts)
	}
	live := e.digest()
	if got := e.replay(1 + int(seed)*5); !mapsEqual(got, live) {
		t.Errorf("replay differs from the live run:\n got  %v\n want %v", got, live)
	}
}

// TestTwoPlacersStale: two placers on one database, their transactions
// interleaved, each with an index that does not know the other's
// bookings, never book a GPU twice nor place a reservation twice.
func TestTwoPlacersStale(t *testing.T) {
	rng := rand.New(rand.NewPCG(7, 7))
	e := newEnv(t)
	fleet := &fleetModel{healthy: map[string]bool{}, connected: map[string]bool{}, failedGPU: map[string]map[int]bool{}, ngpu: map[string]int{}}
	for i := 0; i < 6; i++ {
		id := fmt.Sprintf("n%d", i)
		e.addNode(id, "a", 1+i%4, "H100", 80000, nil)
		fleet.healthy[id], fleet.connected[id], fleet.ngpu[id], fleet.failedGPU[id] = true, true, 1+i%4, map[int]bool{}
		fleet.ids = append(fleet.ids, id)
	}
	placers := []*Placer{e.placer(Config{ReloadEvery: -1}), e.placer(Config{ReloadEvery: -1})}
	// Both learn the same pending reservations before either places them.
	req := NewRequests()
	var ids []string
	for i := 0; i < 10; i++ {
		id := fmt.Sprintf("shared%02d", i)
		ids = append(ids, id)
		e.apply(req, e.request(id, "a", 1+rng.IntN(2)))
	}
	for _, p := range placers {
		if err := pgx.BeginFunc(context.Background(), e.pool, func(tx pgx.Tx) error { return p.prepare(context.Background(), tx, e.now) }); err != nil {
			t.Fatal(err)
		}
	}
	seen := 0
	for step := 0; step < 150; step++ {
		p := placers[step%2]
		switch op := rng.IntN(10); {
		case op < 5:
			var ms []*msg
			for n := 1 + rng.IntN(4); n > 0; n-- {
				if len(ids) > 0 && rng.IntN(5) == 0 {
					ms = append(ms, e.cancel(ids[rng.IntN(len(ids))], "a"))
					continue
				}
				id := fmt.Sprintf("r%03d", len(ids))
				ids = append(ids, id)
				ms = append(ms, e.request(id, "a", 1+rng.IntN(3)))
			}
			e.apply(p, ms...)
		case op < 8:
			e.sweep(p)
		default:
			fleet.mutate(e, rng)
		}
		// Most binds succeed, so that bookings last.
		for _, a := range e.live() {
			if rng.IntN(10) > 0 {
				e.report(a.id, "bound")
			}
		}
		e.advance(time.Duration(rng.IntN(10)) * time.Second)
		rows := e.outbox()
		fleet.checkPlacements(t, rows, seen)
		seen = len(rows)
		e.checkInvariants()
		if t.Failed() {
			t.Fatalf("step %d", step)
		}
	}
	var placed int
	e.pool.QueryRow(context.Background(), `select count(*) from fleet_placements`).Scan(&placed)
	if placed == 0 {
		t.Error("nothing was placed")
	}
}

// TestStaleQueue: a placer whose queue holds reservations that another
// placer cancelled, placed or failed meanwhile neither places nor fails
// them again.
func TestStaleQueue(t *testing.T) {
	e := newEnv(t)
	req := NewRequests()
	e.apply(req, e.request("cancelled", "p", 2), e.request("placed", "p", 2), e.request("failed", "p", 2))
	a, b := e.placer(Config{}), e.placer(Config{})
	e.sweep(a)
	e.sweep(b) // both queue all three: there are no nodes yet
	e.apply(b, e.cancel("cancelled", "p"))
	e.addNode("n1", "p", 2, "H100", 80000, nil)
	e.sweep(b) // b places "placed"
	e.exec(`insert into fleet_failures values ('failed', 'failed/fail', now(), 'test')`)
	e.addNode("n2", "p", 2, "H100", 80000, nil)
	e.addNode("n3", "p", 2, "H100", 80000, nil)
	e.sweep(a)
	if got := e.decisions(); len(got) != 2 {
		t.Errorf("decisions %q, want b's cancel and placement only", got)
	}
	if len(a.pending) != 0 {
		t.Errorf("a still queues %v", a.queued())
	}
	e.checkInvariants()
	// And a failure decided on a stale queue does not fail a placed one.
	e.setNode("n2", "unreachable", false)
	e.setNode("n3", "unreachable", false)
	e.apply(req, e.request("late", "p", 2))
	c, d := e.placer(Config{PendingTimeout: time.Minute}), e.placer(Config{})
	e.addNode("n4", "p", 2, "H100", 80000, nil)
	e.setNode("n4", "unreachable", false)
	e.sweep(c)
	e.setNode("n4", "healthy", true)
	e.sweep(d) // d places late on n4
	e.report("late/1/0", "bound")
	e.report("placed/1/0", "bound")
	e.setNode("n4", "healthy", false) // c cannot place late anywhere
	e.advance(2 * time.Minute)
	e.sweep(c) // c's queue still has late, past its timeout
	if st, _ := e.status("late"); st != "ACTIVE" {
		t.Errorf("late is %s: %q", st, e.decisions())
	}
	if len(c.pending) != 0 {
		t.Errorf("c still queues %v", c.queued())
	}
	e.checkInvariants()
}

// TestTwoPlacersConcurrent: the same with transactions that overlap in
// time; a transaction that fails (a deadlock, say) is rolled back and
// retried, as the runner does.
func TestTwoPlacersConcurrent(t *testing.T) {
	rng := rand.New(rand.NewPCG(11, 3))
	e := newEnv(t)
	for i := 0; i < 6; i++ {
		e.addNode(fmt.Sprintf("n%d", i), "a", 4, "H100", 80000, nil)
	}
	placers := []*Placer{e.placer(Config{ReloadEvery: -1}), e.placer(Config{ReloadEvery: -1})}
	for _, p := range placers {
		e.sweep(p)
	}
	for round := 0; round < 15; round++ {
		// Each placer gets its own requests; the fleet is smaller than the
		// demand, so their plans collide.
		batches := make([][]*msg, 2)
		for i := range batches {
			for j := 0; j < 6; j++ {
				id := fmt.Sprintf("p%d-%02d-%d", i, round, j)
				batches[i] = append(batches[i], e.request(id, "a", []int{1, 2, 4}[rng.IntN(3)]))
			}
			if round > 2 {
				batches[i] = append(batches[i], e.cancel(fmt.Sprintf("p%d-%02d-%d", i, round-3, rng.IntN(6)), "a"))
			}
		}
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for i, p := range placers {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for attempt := 0; attempt < 20; attempt++ {
					if errs[i] = e.tryApply(p, batches[i]...); errs[i] == nil {
						return
					}
				}
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("placer %d: %v", i, err)
			}
		}
		e.checkInvariants()
		wg.Add(2)
		for i, p := range placers {
			go func() {
				defer wg.Done()
				for attempt := 0; attempt < 20; attempt++ {
					if errs[i] = e.trySweep(p); errs[i] == nil {
						return
					}
				}
			}()
		}
		wg.Wait()
		for i, err := range errs {
			if err != nil {
				t.Fatalf("placer %d sweep: %v", i, err)
			}
		}
		e.checkInvariants()
	}
	var booked int
	e.pool.QueryRow(context.Background(), `select count(*) from fleet_bookings`).Scan(&booked)
	if booked == 0 {
		t.Error("nothing booked")
	}
}

func TestReplayDuplicates(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	e.addNode("n2", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("a", "p", 4), e.request("b", "p", 2), e.request("c", "p", 0, wholeNodes(1)))
	e.setNode("n1", "unreachable", false)
	e.sweep(p) // a moves to n2? no room: it waits
	e.apply(p, e.cancel("b", "p"))
	e.sweep(p)
	e.apply(p, e.request("bad", "p", 0), e.cancel("c", "p"))
	e.checkInvariants()
	live := e.digest()
	// The stream with every decision twice in a row, then all of it again
	// (a relay republishing beyond the duplicate window).
	decisions := e.outboxMessages()
	var stream []*msg
	for _, m := range decisions {
		stream = append(stream, m, m)
	}
	stream = append(stream, decisions...)
	ctx := context.Background()
	dec := NewDecisions()
	if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return dec.Reset(ctx, tx) }); err != nil {
		t.Fatal(err)
	}
	for i := 0; i < len(stream); i += 3 {
		e.apply(dec, stream[i:min(i+3, len(stream))]...)
	}
	if got := e.digest(); !mapsEqual(got, live) {
		t.Errorf("replay with duplicates differs:\n got  %v\n want %v\n%q", got, live, e.decisions())
	}
	// A placement that conflicts with the bookings is poison.
	var conflicting *msg
	for _, m := range decisions {
		if m.hdr["Millrace-Reservation"] == "b" {
			c := *m
			conflicting = &c
			break
		}
	}
	if conflicting == nil {
		t.Fatal("no decision of b")
	}
	e.exec(`delete from fleet_allocations where reservation_id = 'b'`)
	e.exec(`delete from fleet_placements where reservation_id = 'b'`)
	e.exec(`insert into fleet_bookings (pool, node_id, gpu_index, allocation_id, reservation_id) select 'p', n, g, 'x', 'x' from unnest(array['n1', 'n2']) n, generate_series(0, 3) g on conflict do nothing`)
	if err := e.tryApply(dec, conflicting); err == nil || !isPoison(err) {
		t.Errorf("conflicting placement: %v", err)
	}
}

func isPoison(err error) bool {
	_, ok := projection.AsPoison(err)
	return ok
}

func TestStatusView(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 2, "H100", 80000, nil)
	p := e.placer(Config{})
	e.apply(p, e.request("r", "p", 2), e.request("w", "p", 2))
	got := map[string]string{}
	for _, id := range []string{"r", "w"} {
		got[id], _ = e.status(id)
	}
	e.report("r/1/0", "bound")
	got["r-bound"], _ = e.status("r")
	want := map[string]string{"r": "PLACED", "w": "PENDING", "r-bound": "ACTIVE"}
	if !mapsEqual(got, want) {
		t.Errorf("states %v, want %v", got, want)
	}
	if !slices.Equal(e.liveOf("w"), nil) {
		t.Error("w placed")
	}
}
