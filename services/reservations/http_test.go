package reservations

import (
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/poll"
)

// TestHTTPRoundTrip drives the JSON API as curl would, and checks the
// bodies use the .proto field names.
func TestHTTPRoundTrip(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{SettleTimeout: 10 * time.Second})
	res := e.do("POST", "/v1/reservations", aliceKey,
		[]byte(`{"spec": {"pool": "a100", "gpus": 4, "model": "A100", "labels": {"zone": "z1"}, "min_gpu_memory_mib": "40000"}, "request_id": "nightly-7"}`))
	if res.status != http.StatusOK || res.header.Get("Content-Type") != "application/json" {
		t.Fatalf("create: %d %v %s", res.status, res.header, res.body)
	}
	var doc map[string]any
	if err := json.Unmarshal(res.body, &doc); err != nil {
		t.Fatal(err)
	}
	id, _ := doc["id"].(string)
	if id != requestReservationID("alice", "nightly-7") || doc["state"] != "RESERVATION_STATE_PENDING" || doc["owner"] != "alice" {
		t.Errorf("create body %s", res.body)
	}
	if _, ok := doc["created_at"]; !ok {
		t.Errorf("no created_at in %s", res.body)
	}
	sp, _ := doc["spec"].(map[string]any)
	if sp["pool"] != "a100" || sp["gpus"] != float64(4) || sp["min_gpu_memory_mib"] != "40000" {
		t.Errorf("spec %v", sp)
	}
	// camelCase is accepted on input too.
	if r := e.do("POST", "/v1/reservations", aliceKey, []byte(`{"spec": {"pool": "a100", "gpus": 4, "model": "A100", "labels": {"zone": "z1"}, "minGpuMemoryMib": 40000}, "requestId": "nightly-7"}`)).reservation(t); r.Id != id {
		t.Errorf("camelCase retry got %s", r.Id)
	}
	msgs := e.waitResvMsgs(1)
	ev := decodeEvent(t, msgs[0])
	if ev.GetRequested().GetSpec().GetMinGpuMemoryMib() != 40000 || ev.GetRequested().GetSpec().GetLabels()["zone"] != "z1" {
		t.Errorf("event %v", ev)
	}

	// The projector and the placer do their part.
	e.reservation(id, "alice", ev.GetRequested().GetSpec(), ev.At.AsTime())
	e.place(id, "a100", t0, alloc{id: "al-1", node: "n7", gpus: []int32{0, 1, 2, 3}})
	e.report("al-1", "n7", "bound", t0.Add(time.Second))

	res = e.do("GET", "/v1/reservations/"+id, aliceKey, nil)
	doc = nil
	if err := json.Unmarshal(res.body, &doc); err != nil {
		t.Fatal(err)
	}
	allocs, _ := doc["allocations"].([]any)
	if doc["state"] != "RESERVATION_STATE_ACTIVE" || len(allocs) != 1 {
		t.Fatalf("get: %s", res.body)
	}
	a := allocs[0].(map[string]any)
	if a["node_id"] != "n7" || a["state"] != "ALLOCATION_STATE_BOUND" || len(a["gpu_indices"].([]any)) != 4 {
		t.Errorf("allocation %v", a)
	}
	for _, k := range []string{"placed_at", "active_at"} {
		if _, ok := doc[k]; !ok {
			t.Errorf("no %s in %s", k, res.body)
		}
	}

	res = e.do("GET", "/v1/reservations?pool=a100", aliceKey, nil)
	var list struct {
		Reservations []map[string]any `json:"reservations"`
	}
	if err := json.Unmarshal(res.body, &list); err != nil || len(list.Reservations) != 1 || list.Reservations[0]["id"] != id {
		t.Fatalf("list: %s %v", res.body, err)
	}

	// Cancel; the projector applies it once it is in the stream.
	go func() {
		if poll.True(func() bool { msgs, _ := e.tryResvMsgs(); return len(msgs) == 2 }, poll.Within(20*time.Second)) {
			e.db.Exec(testCtx(t), `update fleet_reservations set cancelled_at = now() where id = $1`, id)
		}
	}()
	r := e.do("POST", "/v1/reservations/"+id+":cancel", aliceKey, nil).reservation(t)
	if r.State != cancelled || r.EndedAt == nil {
		t.Errorf("cancel returned %v", r)
	}
	checkHeaders(t, e.resvMsgs()[1], id, "cancelled", "a100")
}
