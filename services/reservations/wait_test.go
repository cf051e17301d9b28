package reservations

import (
	"context"
	"net/http"
	"testing"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/millrace/millrace/internal/poll"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

type created struct {
	r       *fleetpb.Reservation
	err     error
	elapsed time.Duration
}

// createAsync runs a Create in a goroutine.
func (e *env) createAsync(ctx context.Context, req *fleetpb.CreateReservationRequest) <-chan created {
	out := make(chan created, 1)
	go func() {
		start := time.Now()
		r, err := e.client.Create(ctx, req)
		out <- created{r, err, time.Since(start)}
	}()
	return out
}

// placer plays the projector and the placer for the first reservation
// requested: it waits for the request in the stream, writes the rows, and
// publishes the decision.
func (e *env) placer(fail bool) <-chan string {
	done := make(chan string, 1)
	go func() {
		var ev *fleetpb.ReservationEvent
		poll.True(func() bool {
			msgs, err := e.tryResvMsgs()
			if err != nil || len(msgs) == 0 {
				return false
			}
			// One that does not decode ends the wait too: the check below
			// then fails.
			ev = &fleetpb.ReservationEvent{}
			proto.Unmarshal(msgs[0].Data, ev)
			return true
		}, poll.Within(20*time.Second))
		if ev.GetRequested() == nil {
			done <- ""
			return
		}
		sp := ev.GetRequested().GetSpec()
		ctx := testCtx(e.t)
		e.db.Exec(ctx, `insert into fleet_reservations (id, pool, gpus, owner, requested_at) values ($1, $2, $3, $4, $5)`,
			ev.ReservationId, sp.Pool, int(sp.Gpus), ev.Owner, ev.At.AsTime())
		d := &fleetpb.PlacementDecision{DecisionId: "d-" + ev.ReservationId, ReservationId: ev.ReservationId, Pool: sp.Pool, At: tsAt(time.Now())}
		if fail {
			e.db.Exec(ctx, `insert into fleet_failures (reservation_id, decision_id, failed_at, reason) values ($1, $2, now(), 'no capacity')`,
				ev.ReservationId, d.DecisionId)
			d.Body = &fleetpb.PlacementDecision_Failed{Failed: &fleetpb.Failed{Reason: "no capacity"}}
		} else {
			e.db.Exec(ctx, `insert into fleet_placements (reservation_id, decision_id, placed_at) values ($1, $2, now())`, ev.ReservationId, d.DecisionId)
			e.db.Exec(ctx, `insert into fleet_allocations (id, reservation_id, pool, node_id, gpu_indices, decision_id, placed_at)
				values ($1, $2, $3, 'n1', '{0,1}', $4, now())`, "al-"+ev.ReservationId, ev.ReservationId, sp.Pool, d.DecisionId)
			d.Body = &fleetpb.PlacementDecision_Placed{Placed: &fleetpb.Placed{Allocations: []*fleetpb.Allocation{
				{Id: "al-" + ev.ReservationId, NodeId: "n1", GpuIndices: []uint32{0, 1}},
			}}}
		}
		// Another reservation's decision and a release wake nobody.
		for _, d := range []*fleetpb.PlacementDecision{
			{DecisionId: "d-other", ReservationId: "r-other", Pool: sp.Pool, Body: &fleetpb.PlacementDecision_Placed{Placed: &fleetpb.Placed{}}},
			{DecisionId: "d-release", ReservationId: ev.ReservationId, Pool: sp.Pool, Body: &fleetpb.PlacementDecision_Released{Released: &fleetpb.Released{Requeued: true}}},
			d,
		} {
			if err := e.tryDecide(d); err != nil {
				done <- ""
				return
			}
		}
		done <- ev.ReservationId
	}()
	return done
}

const longWait = 50 * time.Second

func TestWaitPlaced(t *testing.T) {
	t.Parallel()
	// A long recheck interval: only the decision can end this wait early.
	e := newEnv(t, Config{RecheckInterval: time.Hour, SettleTimeout: 10 * time.Second})
	res := e.createAsync(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 2), Wait: durationpb.New(longWait)})
	id := <-e.placer(false)
	if id == "" {
		t.Fatal("the request never reached the stream")
	}
	c := <-res
	if c.err != nil {
		t.Fatal(c.err)
	}
	if c.r.Id != id || c.r.State != placed || len(c.r.Allocations) != 1 || c.r.PlacedAt == nil {
		t.Fatalf("Create returned %v, want %s PLACED with its allocation", c.r, id)
	}
	if a := c.r.Allocations[0]; a.State != fleetpb.AllocationState_ALLOCATION_STATE_PENDING || a.NodeId != "n1" {
		t.Errorf("allocation %v", a)
	}
	if c.elapsed >= longWait/2 {
		t.Errorf("Create took %s: it waited out its wait instead of waking on the decision", c.elapsed)
	}
	if n := len(e.resvMsgs()); n != 1 {
		t.Errorf("%d events", n)
	}
}

func TestWaitFailedHTTP(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{RecheckInterval: time.Hour, SettleTimeout: 10 * time.Second})
	out := make(chan httpResult, 1)
	start := time.Now()
	go func() {
		out <- e.do("POST", "/v1/reservations", aliceKey, []byte(`{"spec": {"pool": "a100", "gpus": 1}, "wait": "50s"}`))
	}()
	id := <-e.placer(true)
	r := (<-out).reservation(t)
	if r.Id != id || r.State != failed || r.Reason != "no capacity" || r.EndedAt == nil {
		t.Fatalf("Create returned %v, want %s FAILED", r, id)
	}
	if el := time.Since(start); el >= longWait/2 {
		t.Errorf("took %s", el)
	}
}

// The database re-check ends a wait whose decision the subscription did not
// see: here the placer writes its rows and publishes nothing.
func TestWaitRecheck(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{RecheckInterval: 50 * time.Millisecond})
	id := requestReservationID("alice", "again")
	e.reservation(id, "alice", spec("a100", 1), t0)
	res := e.createAsync(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), RequestId: "again", Wait: durationpb.New(longWait)})
	poll.Until(t, "the Create to wait", func() bool { return e.srv.waiters.has(id) }, poll.Within(20*time.Second))
	// The report first, so that the reservation goes from PENDING to ACTIVE
	// in one step.
	e.report("al-1", "n1", "bound", t0.Add(2*time.Second))
	e.place(id, "a100", t0.Add(time.Second), alloc{id: "al-1", node: "n1", gpus: []int32{0}})
	c := <-res
	if c.err != nil {
		t.Fatal(c.err)
	}
	if c.r.State != active || c.elapsed >= longWait/2 {
		t.Fatalf("Create returned %v after %s, want ACTIVE at once", c.r.State, c.elapsed)
	}
	if n := len(e.resvMsgs()); n != 0 {
		t.Errorf("a retry of a projected reservation published %d events", n)
	}

	// Already decided: no wait at all.
	r, err := e.client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), RequestId: "again", Wait: durationpb.New(longWait)})
	if err != nil || r.State != active {
		t.Fatalf("%v %v", r, err)
	}
}

func TestWaitTimeout(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	const wait = 300 * time.Millisecond
	start := time.Now()
	r, err := e.client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), Wait: durationpb.New(wait)})
	if err != nil {
		t.Fatal(err)
	}
	if el := time.Since(start); el < wait {
		t.Errorf("returned after %s, before the wait of %s", el, wait)
	}
	if r.State != pending || r.Id == "" {
		t.Errorf("got %v, want PENDING", r)
	}
	if e.srv.waiters.has(r.Id) {
		t.Error("the waiter is still registered")
	}

	// Over HTTP too, with the projector having the reservation.
	res := e.do("POST", "/v1/reservations", aliceKey, []byte(`{"spec": {"pool": "a100", "gpus": 1}, "request_id": "slow", "wait": "0.3s"}`))
	if r := res.reservation(t); r.State != pending || r.Id != requestReservationID("alice", "slow") {
		t.Errorf("HTTP got %v", r)
	}
}

// A client deadline shorter than wait gets the reservation, not
// DEADLINE_EXCEEDED.
func TestWaitClientDeadline(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+aliceKey)
	r, err := e.client.Create(ctx, &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), Wait: durationpb.New(longWait)})
	if err != nil {
		t.Fatalf("got %v, want the pending reservation", err)
	}
	if r.State != pending {
		t.Errorf("state %v", r.State)
	}
}

// Close ends the waits in progress with the reservation as it is.
func TestWaitClose(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	res := e.createAsync(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), RequestId: "c", Wait: durationpb.New(longWait)})
	id := requestReservationID("alice", "c")
	poll.Until(t, "the Create to wait", func() bool { return e.srv.waiters.has(id) }, poll.Within(20*time.Second))
	e.srv.Close()
	c := <-res
	if c.err != nil || c.r.State != pending || c.elapsed >= longWait/2 {
		t.Fatalf("after Close: %v %v after %s", c.r, c.err, c.elapsed)
	}
	// Still served after Close, without waiting.
	res2 := e.do("POST", "/v1/reservations", aliceKey, []byte(`{"spec": {"pool": "a100", "gpus": 1}, "wait": "50s"}`))
	if res2.status != http.StatusOK {
		t.Fatalf("after Close: %d %s", res2.status, res2.body)
	}
}
