package reservations

import (
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/internal/poll"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/subjects"
)

const (
	pending   = fleetpb.ReservationState_RESERVATION_STATE_PENDING
	placed    = fleetpb.ReservationState_RESERVATION_STATE_PLACED
	active    = fleetpb.ReservationState_RESERVATION_STATE_ACTIVE
	cancelled = fleetpb.ReservationState_RESERVATION_STATE_CANCELLED
	failed    = fleetpb.ReservationState_RESERVATION_STATE_FAILED
)

func wantCode(t *testing.T, err error, code codes.Code, contains string) {
	t.Helper()
	if status.Code(err) != code {
		t.Fatalf("got %v, want %v", err, code)
	}
	if !strings.Contains(status.Convert(err).Message(), contains) {
		t.Fatalf("message %q does not mention %q", status.Convert(err).Message(), contains)
	}
}

func TestCreatePublishesOneEvent(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	sp := &fleetpb.ReservationSpec{Pool: "a100.east", Gpus: 2, Model: "A100-80GB",
		Labels: map[string]string{"zone": "z1"}, MinGpuMemoryMib: 81920}
	before := time.Now()
	r, err := e.client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: sp})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(r.Id, "r-") || len(r.Id) != 28 {
		t.Errorf("id %q, want r- and 26 characters", r.Id)
	}
	if r.State != pending || r.Owner != "alice" || !proto.Equal(r.Spec, sp) {
		t.Errorf("reservation %v, want PENDING for alice with the spec asked", r)
	}
	if r.CreatedAt.AsTime().Before(before.Add(-time.Second)) {
		t.Errorf("created_at %v is before the call", r.CreatedAt.AsTime())
	}

	msgs := e.waitResvMsgs(1)
	m := msgs[0]
	checkHeaders(t, m, r.Id, "requested", "a100.east")
	if m.Subject != "fleet.resv.a100%2Eeast" {
		t.Errorf("subject %q", m.Subject)
	}
	ev := decodeEvent(t, m)
	want := &fleetpb.ReservationEvent{
		ReservationId: r.Id, Owner: "alice", At: ev.At,
		Body: &fleetpb.ReservationEvent_Requested{Requested: &fleetpb.ReservationRequested{Spec: sp}},
	}
	if diff := protoDiff(want, ev); diff != "" {
		t.Errorf("event (want, got):\n%s", diff)
	}
	if ev.At == nil {
		t.Error("event has no time")
	}

	// Without request_id every Create is a new reservation.
	r2, err := e.client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: sp})
	if err != nil {
		t.Fatal(err)
	}
	if r2.Id == r.Id {
		t.Errorf("two Creates without request_id got the same id %s", r.Id)
	}
	e.waitResvMsgs(2)
}

func TestCreateRequestIDRepeats(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	// Count every publish, duplicates included: JetStream drops a duplicate
	// from the stream, but core subscribers still see it.
	seen := make(chan *nats.Msg, 100)
	sub, err := e.nc.ChanSubscribe(subjects.FleetResvFilter, seen)
	if err != nil {
		t.Fatal(err)
	}
	defer sub.Unsubscribe()
	e.nc.Flush()

	req := &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), RequestId: "job-42"}
	r1, err := e.client.Create(as(t, aliceKey), req)
	if err != nil {
		t.Fatal(err)
	}
	if want := requestReservationID("alice", "job-42"); r1.Id != want {
		t.Fatalf("id %s, want the one request_id names, %s", r1.Id, want)
	}
	// Before the projector has it, a retry publishes again (a no-op in the
	// stream) and names the same reservation.
	r2, err := e.client.Create(as(t, aliceKey), req)
	if err != nil {
		t.Fatal(err)
	}
	if r2.Id != r1.Id {
		t.Fatalf("retry got %s, first got %s", r2.Id, r1.Id)
	}
	msgs := e.waitResvMsgs(1)
	checkHeaders(t, msgs[0], r1.Id, "requested", "a100")
	if got := decodeEvent(t, msgs[0]).GetRequested().GetRequestId(); got != "job-42" {
		t.Errorf("event request_id %q", got)
	}

	// Once the projector has it, a retry reads it and publishes nothing.
	e.reservation(r1.Id, "alice", spec("a100", 1), t0)
	e.place(r1.Id, "a100", t0.Add(time.Second), alloc{id: "al-1", node: "n1", gpus: []int32{3}})
	for len(seen) < 2 {
		<-time.After(5 * time.Millisecond)
	}
	drain(seen)
	r3, err := e.client.Create(as(t, aliceKey), req)
	if err != nil {
		t.Fatal(err)
	}
	if r3.Id != r1.Id || r3.State != placed || len(r3.Allocations) != 1 {
		t.Fatalf("retry after projection got %v, want the placed reservation %s", r3, r1.Id)
	}
	// Messages from one connection arrive in order: if the retry had
	// published, it would come before this marker.
	if err := e.nc.Publish("fleet.resv.marker", nil); err != nil {
		t.Fatal(err)
	}
	if m := <-seen; m.Subject != "fleet.resv.marker" {
		t.Fatalf("a retry of a projected reservation published %s %q", m.Subject, m.Header.Get("Nats-Msg-Id"))
	}

	// The same request_id with another spec is refused.
	other := &fleetpb.CreateReservationRequest{Spec: spec("a100", 2), RequestId: "job-42"}
	_, err = e.client.Create(as(t, aliceKey), other)
	wantCode(t, err, codes.AlreadyExists, "job-42")

	// Another owner's request_id of the same name is another reservation.
	rb, err := e.client.Create(as(t, bobKey), req)
	if err != nil {
		t.Fatal(err)
	}
	if rb.Id == r1.Id || rb.Owner != "bob" {
		t.Fatalf("bob's job-42 got %s (%s), alice's is %s", rb.Id, rb.Owner, r1.Id)
	}
}

// A reservation the projector has but the stream does not (it aged out)
// is returned without publishing.
func TestCreateRequestIDInDatabaseOnly(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	id := requestReservationID("alice", "old")
	e.reservation(id, "alice", spec("a100", 1), t0)
	r, err := e.client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), RequestId: "old"})
	if err != nil {
		t.Fatal(err)
	}
	if r.Id != id || r.State != pending || !r.CreatedAt.AsTime().Equal(t0) {
		t.Fatalf("got %v", r)
	}
	if msgs := e.resvMsgs(); len(msgs) != 0 {
		t.Fatalf("published %d messages", len(msgs))
	}
}

func drain(ch chan *nats.Msg) {
	for {
		select {
		case <-ch:
		default:
			return
		}
	}
}

func TestAuth(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	create := &fleetpb.CreateReservationRequest{Spec: spec("a100", 1)}

	_, err := e.client.Create(testCtx(t), create)
	wantCode(t, err, codes.Unauthenticated, "authorization: Bearer")
	_, err = e.client.Create(as(t, "not-a-key-0123456789"), create)
	wantCode(t, err, codes.Unauthenticated, "not valid")
	_, err = e.client.List(metadata.AppendToOutgoingContext(testCtx(t), "authorization", "Basic "+aliceKey), &fleetpb.ListReservationsRequest{})
	wantCode(t, err, codes.Unauthenticated, "needs an API key")
	r, err := e.client.Create(metadata.AppendToOutgoingContext(testCtx(t), APIKeyHeader, aliceKey), create)
	if err != nil {
		t.Fatalf("key in %s: %v", APIKeyHeader, err)
	}
	if r.Owner != "alice" {
		t.Fatalf("owner %q", r.Owner)
	}

	for _, key := range []string{"", "not-a-key-0123456789"} {
		res := e.do("GET", "/v1/reservations", key, nil)
		if res.status != http.StatusUnauthorized || res.header.Get("WWW-Authenticate") == "" {
			t.Errorf("HTTP with key %q: %d %s", key, res.status, res.body)
		}
		if _, code := res.apiError(t); code != "UNAUTHENTICATED" {
			t.Errorf("code %s", code)
		}
	}
	if res := e.do("GET", "/v1/reservations", "", nil, APIKeyHeader, aliceKey); res.status != http.StatusOK {
		t.Errorf("HTTP with %s: %d %s", APIKeyHeader, res.status, res.body)
	}

	// Bob's reservation does not exist for alice.
	e.reservation("r-bobs", "bob", spec("a100", 1), t0)
	_, err = e.client.Get(as(t, aliceKey), &fleetpb.GetReservationRequest{Id: "r-bobs"})
	wantCode(t, err, codes.NotFound, "r-bobs")
	_, err = e.client.Cancel(as(t, aliceKey), &fleetpb.CancelReservationRequest{Id: "r-bobs"})
	wantCode(t, err, codes.NotFound, "r-bobs")
	for _, c := range []struct{ method, path string }{{"GET", "/v1/reservations/r-bobs"}, {"POST", "/v1/reservations/r-bobs:cancel"}, {"DELETE", "/v1/reservations/r-bobs"}} {
		if res := e.do(c.method, c.path, aliceKey, nil); res.status != http.StatusNotFound {
			t.Errorf("%s %s as alice: %d %s", c.method, c.path, res.status, res.body)
		}
	}
	list, err := e.client.List(as(t, aliceKey), &fleetpb.ListReservationsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Reservations) != 0 {
		t.Errorf("alice lists %v", list.Reservations)
	}
	if got, err := e.client.Get(as(t, bobKey), &fleetpb.GetReservationRequest{Id: "r-bobs"}); err != nil || got.Owner != "bob" {
		t.Errorf("bob's own Get: %v %v", got, err)
	}

	// Carol's key is limited to a100 and h100.
	_, err = e.client.Create(as(t, carolKey), &fleetpb.CreateReservationRequest{Spec: spec("v100", 1)})
	wantCode(t, err, codes.PermissionDenied, `"v100"`)
	res := e.do("POST", "/v1/reservations", carolKey, []byte(`{"spec": {"pool": "v100", "gpus": 1}}`))
	if _, code := res.apiError(t); res.status != http.StatusForbidden || code != "PERMISSION_DENIED" {
		t.Errorf("HTTP create in v100 as carol: %d %s", res.status, res.body)
	}
	if _, err := e.client.Create(as(t, carolKey), &fleetpb.CreateReservationRequest{Spec: spec("h100", 1)}); err != nil {
		t.Errorf("carol in h100: %v", err)
	}
	_, err = e.client.List(as(t, carolKey), &fleetpb.ListReservationsRequest{Pool: "v100"})
	wantCode(t, err, codes.PermissionDenied, "v100")
	e.reservation("r-carol-v100", "carol", spec("v100", 1), t0)
	e.reservation("r-carol-a100", "carol", spec("a100", 1), t0.Add(time.Second))
	_, err = e.client.Get(as(t, carolKey), &fleetpb.GetReservationRequest{Id: "r-carol-v100"})
	wantCode(t, err, codes.PermissionDenied, "v100")
	list, err = e.client.List(as(t, carolKey), &fleetpb.ListReservationsRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if len(list.Reservations) != 1 || list.Reservations[0].Id != "r-carol-a100" {
		t.Errorf("carol lists %v, want only her a100 reservation", list.Reservations)
	}
	// Nothing of the refused calls reached the stream.
	for _, m := range e.resvMsgs() {
		if p := m.Header.Get("Millrace-Pool"); p == "v100" || m.Header.Get("Millrace-Reservation") == "r-bobs" {
			t.Errorf("refused call published %s", m.Header.Get("Nats-Msg-Id"))
		}
	}
}

func TestPendingLimit(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{MaxPendingPerOwner: 3, RecountEvery: -1})
	e.reservation("r-p1", "alice", spec("a100", 1), t0)
	e.reservation("r-p2", "alice", spec("a100", 1), t0)
	e.reservation("r-placed", "alice", spec("a100", 1), t0)
	e.place("r-placed", "a100", t0, alloc{id: "al-placed", node: "n1", gpus: []int32{0}})
	// Neither active nor ended reservations count.
	e.reservation("r-active", "alice", spec("a100", 1), t0)
	e.place("r-active", "a100", t0, alloc{id: "al-active", node: "n1", gpus: []int32{1}})
	e.report("al-active", "n1", "bound", t0)
	e.reservation("r-gone", "alice", spec("a100", 1), t0)
	e.cancelled("r-gone", t0)
	e.reservation("r-failed", "alice", spec("a100", 1), t0)
	e.fail("r-failed", "no capacity", t0)

	create := &fleetpb.CreateReservationRequest{Spec: spec("a100", 1)}
	_, err := e.client.Create(as(t, aliceKey), create)
	wantCode(t, err, codes.ResourceExhausted, "3 reservations pending or placed")
	res := e.do("POST", "/v1/reservations", aliceKey, []byte(`{"spec": {"pool": "a100", "gpus": 1}}`))
	if _, code := res.apiError(t); res.status != http.StatusTooManyRequests || code != "RESOURCE_EXHAUSTED" {
		t.Errorf("HTTP: %d %s", res.status, res.body)
	}
	if _, err := e.client.Create(as(t, bobKey), create); err != nil {
		t.Errorf("bob is not at the limit: %v", err)
	}
	e.cancelled("r-p1", t0.Add(time.Minute))
	if _, err := e.client.Create(as(t, aliceKey), create); err != nil {
		t.Errorf("after a cancel: %v", err)
	}
	if n := len(e.resvMsgs()); n != 2 {
		t.Errorf("%d events published, want 2 (bob's and alice's last)", n)
	}
}

// TestGetStates writes each state as the projectors would and reads it back.
func TestGetStates(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	sp := &fleetpb.ReservationSpec{Pool: "a100", Gpus: 2, Model: "A100", Labels: map[string]string{"rack": "7"}, MinGpuMemoryMib: 40000}
	at := func(s int) time.Time { return t0.Add(time.Duration(s) * time.Second) }

	e.reservation("r-pending", "alice", sp, at(0))

	e.reservation("r-placed", "alice", sp, at(0))
	e.place("r-placed", "a100", at(1), alloc{id: "al-p1", node: "n1", gpus: []int32{0, 1}}, alloc{id: "al-p2", node: "n2", gpus: []int32{4, 5}})
	e.report("al-p1", "n1", "bound", at(2))
	e.report("al-p2", "n2", "failed", at(2))

	e.reservation("r-active", "alice", sp, at(0))
	e.place("r-active", "a100", at(1), alloc{id: "al-a1", node: "n3", whole: true, gpus: []int32{0, 1, 2, 3}})
	e.report("al-a1", "n3", "bound", at(3))

	e.reservation("r-cancelled", "alice", sp, at(0))
	e.place("r-cancelled", "a100", at(1), alloc{id: "al-c1", node: "n4", gpus: []int32{0}})
	e.exec(`update fleet_allocations set released_at = $2, release_reason = 'cancelled' where id = $1`, "al-c1", at(5))
	e.exec(`update fleet_placements set ended_at = $2, end_reason = 'cancelled' where reservation_id = $1`, "r-cancelled", at(5))
	e.cancelled("r-cancelled", at(4))

	e.reservation("r-failed", "alice", sp, at(0))
	e.fail("r-failed", "no node has 2 free A100", at(6))

	// Released with requeue: the placement row goes, the reservation is
	// pending again and holds nothing.
	e.reservation("r-requeued", "alice", sp, at(0))
	e.place("r-requeued", "a100", at(1), alloc{id: "al-r1", node: "n5", gpus: []int32{0}})
	e.exec(`update fleet_allocations set released_at = $2, release_reason = 'node_unreachable' where id = $1`, "al-r1", at(7))
	e.exec(`delete from fleet_placements where reservation_id = $1`, "r-requeued")

	want := map[string]*fleetpb.Reservation{
		"r-pending": {State: pending},
		"r-placed": {State: placed, PlacedAt: tsAt(at(1)), Allocations: []*fleetpb.Allocation{
			{Id: "al-p1", NodeId: "n1", GpuIndices: []uint32{0, 1}, State: fleetpb.AllocationState_ALLOCATION_STATE_BOUND},
			{Id: "al-p2", NodeId: "n2", GpuIndices: []uint32{4, 5}, State: fleetpb.AllocationState_ALLOCATION_STATE_FAILED},
		}},
		"r-active": {State: active, PlacedAt: tsAt(at(1)), ActiveAt: tsAt(at(3)), Allocations: []*fleetpb.Allocation{
			{Id: "al-a1", NodeId: "n3", GpuIndices: []uint32{0, 1, 2, 3}, WholeNode: true, State: fleetpb.AllocationState_ALLOCATION_STATE_BOUND},
		}},
		"r-cancelled": {State: cancelled, PlacedAt: tsAt(at(1)), EndedAt: tsAt(at(4)), Reason: "cancelled"},
		"r-failed":    {State: failed, EndedAt: tsAt(at(6)), Reason: "no node has 2 free A100"},
		"r-requeued":  {State: pending},
	}
	for id, w := range want {
		w.Id, w.Spec, w.Owner, w.CreatedAt = id, sp, "alice", tsAt(at(0))
		got, err := e.client.Get(as(t, aliceKey), &fleetpb.GetReservationRequest{Id: id})
		if err != nil {
			t.Fatalf("Get %s: %v", id, err)
		}
		if diff := protoDiff(w, got); diff != "" {
			t.Errorf("Get %s (want, got):\n%s", id, diff)
		}
		// HTTP says the same.
		res := e.do("GET", "/v1/reservations/"+id, aliceKey, nil)
		if diff := protoDiff(w, res.reservation(t)); diff != "" {
			t.Errorf("HTTP GET %s (want, got):\n%s", id, diff)
		}
	}

	_, err := e.client.Get(as(t, aliceKey), &fleetpb.GetReservationRequest{Id: "r-nope"})
	wantCode(t, err, codes.NotFound, "r-nope")
	_, err = e.client.Get(as(t, aliceKey), &fleetpb.GetReservationRequest{})
	wantCode(t, err, codes.InvalidArgument, "id is required")
}

func TestList(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	var all []string
	for i := range 7 {
		id := "r-" + string(rune('a'+i))
		pool := "a100"
		if i%2 == 1 {
			pool = "h100"
		}
		e.reservation(id, "alice", spec(pool, 1), t0.Add(time.Duration(i/2)*time.Second)) // pairs share a time
		all = append(all, id)
	}
	e.reservation("r-bob", "bob", spec("a100", 1), t0)
	e.cancelled("r-c", t0.Add(time.Hour))
	e.place("r-e", "a100", t0, alloc{id: "al-e", node: "n1", gpus: []int32{2}})

	page := func(req *fleetpb.ListReservationsRequest) []string {
		t.Helper()
		var ids []string
		for n := 0; ; n++ {
			resp, err := e.client.List(as(t, aliceKey), req)
			if err != nil {
				t.Fatal(err)
			}
			if req.PageSize > 0 && len(resp.Reservations) > int(req.PageSize) {
				t.Fatalf("page of %d, page_size %d", len(resp.Reservations), req.PageSize)
			}
			for _, r := range resp.Reservations {
				ids = append(ids, r.Id)
				if r.Id == "r-e" && (r.State != placed || len(r.Allocations) != 1) {
					t.Errorf("r-e listed as %v", r)
				}
			}
			if resp.NextPageToken == "" {
				return ids
			}
			if n > 20 {
				t.Fatal("List does not end")
			}
			req = proto.Clone(req).(*fleetpb.ListReservationsRequest)
			req.PageToken = resp.NextPageToken
		}
	}
	if got := page(&fleetpb.ListReservationsRequest{PageSize: 3}); !slices.Equal(got, all) {
		t.Errorf("pages of 3: %v, want %v", got, all)
	}
	if got := page(&fleetpb.ListReservationsRequest{PageSize: 5000}); !slices.Equal(got, all) {
		t.Errorf("page_size above the limit: %v, want %v", got, all)
	}
	if got := page(&fleetpb.ListReservationsRequest{Pool: "h100", PageSize: 1}); !slices.Equal(got, []string{"r-b", "r-d", "r-f"}) {
		t.Errorf("pool h100: %v", got)
	}
	if got := page(&fleetpb.ListReservationsRequest{State: pending, PageSize: 2}); !slices.Equal(got, []string{"r-a", "r-b", "r-d", "r-f", "r-g"}) {
		t.Errorf("pending: %v", got)
	}
	if got := page(&fleetpb.ListReservationsRequest{State: cancelled}); !slices.Equal(got, []string{"r-c"}) {
		t.Errorf("cancelled: %v", got)
	}

	first, err := e.client.List(as(t, aliceKey), &fleetpb.ListReservationsRequest{PageSize: 2})
	if err != nil {
		t.Fatal(err)
	}
	_, err = e.client.List(as(t, aliceKey), &fleetpb.ListReservationsRequest{PageSize: 2, Pool: "a100", PageToken: first.NextPageToken})
	wantCode(t, err, codes.InvalidArgument, "other pool or state filters")
	_, err = e.client.List(as(t, aliceKey), &fleetpb.ListReservationsRequest{PageToken: "garbage"})
	wantCode(t, err, codes.InvalidArgument, "page_token")
	_, err = e.client.List(as(t, aliceKey), &fleetpb.ListReservationsRequest{State: 42})
	wantCode(t, err, codes.InvalidArgument, "state 42")

	// The same over HTTP.
	var got []string
	path := "/v1/reservations?page_size=3&state=pending"
	for range 10 {
		res := e.do("GET", path, aliceKey, nil)
		if res.status != http.StatusOK {
			t.Fatalf("HTTP list: %d %s", res.status, res.body)
		}
		resp := &fleetpb.ListReservationsResponse{}
		if err := jsonIn.Unmarshal(res.body, resp); err != nil {
			t.Fatal(err)
		}
		for _, r := range resp.Reservations {
			got = append(got, r.Id)
		}
		if resp.NextPageToken == "" {
			break
		}
		if !strings.Contains(string(res.body), `"next_page_token"`) {
			t.Errorf("body does not use proto field names: %s", res.body)
		}
		path = "/v1/reservations?page_size=3&state=PENDING&page_token=" + resp.NextPageToken
	}
	if !slices.Equal(got, []string{"r-a", "r-b", "r-d", "r-f", "r-g"}) {
		t.Errorf("HTTP pending: %v", got)
	}
}

func TestCancel(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{SettleTimeout: 30 * time.Second})
	e.reservation("r-1", "alice", spec("a100", 1), t0)
	e.place("r-1", "a100", t0, alloc{id: "al-1", node: "n1", gpus: []int32{0}})

	// The projector's part: once the cancel is in the stream, apply it.
	applied := make(chan error, 1)
	go func() {
		inStream := func() bool { msgs, _ := e.tryResvMsgs(); return len(msgs) == 1 }
		if !poll.True(inStream, poll.Within(20*time.Second)) {
			applied <- nil
			return
		}
		_, err := e.db.Exec(testCtx(t), `update fleet_reservations set cancelled_at = $2 where id = $1`, "r-1", t0.Add(time.Minute))
		applied <- err
	}()
	r, err := e.client.Cancel(as(t, aliceKey), &fleetpb.CancelReservationRequest{Id: "r-1"})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-applied; err != nil {
		t.Fatal(err)
	}
	if r.State != cancelled || !r.EndedAt.AsTime().Equal(t0.Add(time.Minute)) {
		t.Errorf("Cancel returned %v, want CANCELLED as the projector wrote it", r)
	}
	msgs := e.resvMsgs()
	checkHeaders(t, msgs[0], "r-1", "cancelled", "a100")
	if ev := decodeEvent(t, msgs[0]); ev.GetCancelled() == nil || ev.ReservationId != "r-1" || ev.Owner != "alice" {
		t.Errorf("event %v", ev)
	}

	// Cancelling what has ended returns it and publishes nothing.
	e.reservation("r-failed", "alice", spec("a100", 1), t0)
	e.fail("r-failed", "no capacity", t0)
	for _, id := range []string{"r-1", "r-failed"} {
		again, err := e.client.Cancel(as(t, aliceKey), &fleetpb.CancelReservationRequest{Id: id})
		if err != nil {
			t.Fatal(err)
		}
		if !ended(again.State) {
			t.Errorf("Cancel %s: %v", id, again.State)
		}
	}
	if n := len(e.resvMsgs()); n != 1 {
		t.Errorf("%d events, want only the first cancel", n)
	}
}

func TestCancelHTTP(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	e.reservation("r-1", "alice", spec("a100", 1), t0)
	e.reservation("r-2", "alice", spec("h100", 1), t0)
	// No projector runs: after SettleTimeout the view is as it was, and the
	// cancel is stored.
	if r := e.do("POST", "/v1/reservations/r-1:cancel", aliceKey, []byte("{}")).reservation(t); r.Id != "r-1" || r.State != pending {
		t.Errorf("POST :cancel returned %v", r)
	}
	if r := e.do("DELETE", "/v1/reservations/r-2", aliceKey, nil).reservation(t); r.Id != "r-2" {
		t.Errorf("DELETE returned %v", r)
	}
	msgs := e.waitResvMsgs(2)
	checkHeaders(t, msgs[0], "r-1", "cancelled", "a100")
	checkHeaders(t, msgs[1], "r-2", "cancelled", "h100")
	if res := e.do("GET", "/v1/reservations/r-1:cancel", aliceKey, nil); res.status != http.StatusMethodNotAllowed || res.header.Get("Allow") != "POST" {
		t.Errorf("GET :cancel: %d %s", res.status, res.body)
	}
}

// A backbone that does not store the event is UNAVAILABLE, retryable.
func TestCreateBackboneDown(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{PublishTimeout: 500 * time.Millisecond})
	if err := e.js.DeleteStream(testCtx(t), subjects.StreamFleetResv); err != nil {
		t.Fatal(err)
	}
	_, err := e.client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), RequestId: "x"})
	wantCode(t, err, codes.Unavailable, "same request_id")
	res := e.do("POST", "/v1/reservations", aliceKey, []byte(`{"spec": {"pool": "a100", "gpus": 1}}`))
	if msg, code := res.apiError(t); res.status != http.StatusServiceUnavailable || code != "UNAVAILABLE" || !strings.Contains(msg, "set request_id") {
		t.Errorf("HTTP: %d %s", res.status, res.body)
	}
	if res.header.Get("Retry-After") == "" {
		t.Error("no Retry-After")
	}
}

func TestIDs(t *testing.T) {
	a, b := requestReservationID("alice", "x"), requestReservationID("alice", "x")
	if a != b || a == requestReservationID("bob", "x") || a == requestReservationID("alice", "y") {
		t.Fatalf("request ids: %s %s", a, b)
	}
	// "a" + "\x00b" and "a\x00" + "b" cannot both be owners: owners have
	// no control characters.
	prev := newReservationID()
	for range 100 {
		id := newReservationID()
		if len(id) != 28 || id <= prev {
			t.Fatalf("random ids %s then %s: want 28 characters, ordered by time", prev, id)
		}
		prev = id
	}
}

// A request_id reused with another spec is refused in both windows: while
// the first Create is only in the stream (JetStream drops the second
// publish as a duplicate; before, the caller was answered with its new
// spec while the old one was stored) and once the projector has it. A
// retry with the same spec in the first window is answered with what was
// stored.
func TestCreateRequestIDReusedBeforeProjection(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	first, err := e.client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), RequestId: "job-7"})
	if err != nil {
		t.Fatal(err)
	}
	// Not projected: the database has no row for it.
	for _, other := range []*fleetpb.ReservationSpec{spec("a100", 2), spec("h100", 1)} {
		_, err := e.client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: other, RequestId: "job-7"})
		wantCode(t, err, codes.AlreadyExists, "job-7")
	}
	res := e.do("POST", "/v1/reservations", aliceKey, []byte(`{"spec": {"pool": "a100", "gpus": 3}, "request_id": "job-7"}`))
	if res.status != http.StatusConflict {
		t.Fatalf("HTTP %d for a reused request_id, want 409: %s", res.status, res.body)
	}
	if msg, _ := res.apiError(t); !strings.Contains(msg, "another spec") {
		t.Fatalf("409 reason %q does not say why", msg)
	}
	// The same spec again: the stored reservation, with its own time.
	again, err := e.client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 1), RequestId: "job-7"})
	if err != nil {
		t.Fatal(err)
	}
	if again.Id != first.Id || !proto.Equal(again.Spec, spec("a100", 1)) || !again.CreatedAt.AsTime().Equal(first.CreatedAt.AsTime()) {
		t.Fatalf("retry got %v, first %v", again, first)
	}
	msgs := e.waitResvMsgs(1)
	if len(msgs) != 1 || !proto.Equal(decodeEvent(t, msgs[0]).GetRequested().GetSpec(), spec("a100", 1)) {
		t.Fatalf("stream holds %d requests", len(msgs))
	}

	// Projected: the database answers.
	e.reservation(first.Id, "alice", spec("a100", 1), t0)
	_, err = e.client.Create(as(t, aliceKey), &fleetpb.CreateReservationRequest{Spec: spec("a100", 2), RequestId: "job-7"})
	wantCode(t, err, codes.AlreadyExists, "job-7")
}
