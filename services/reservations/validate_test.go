package reservations

import (
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// badCreates are requests each wrong in one field, with what the error
// must mention.
func badCreates() []struct {
	name    string
	req     *fleetpb.CreateReservationRequest
	mention string
} {
	ok := func(f func(*fleetpb.CreateReservationRequest)) *fleetpb.CreateReservationRequest {
		r := &fleetpb.CreateReservationRequest{Spec: &fleetpb.ReservationSpec{Pool: "a100", Gpus: 1}}
		f(r)
		return r
	}
	labels := func(n int) map[string]string {
		m := map[string]string{}
		for i := range n {
			m[fmt.Sprint("k", i)] = "v"
		}
		return m
	}
	return []struct {
		name    string
		req     *fleetpb.CreateReservationRequest
		mention string
	}{
		{"no spec", &fleetpb.CreateReservationRequest{}, "spec is required"},
		{"no pool", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Pool = "" }), "spec.pool is required"},
		{"long pool", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Pool = strings.Repeat("p", 254) }), "spec.pool is 254 bytes"},
		{"control in pool", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Pool = "a\nb" }), "spec.pool contains a control character"},
		{"nothing asked", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Gpus = 0 }), "set one of spec.gpus"},
		{"gpus and nodes", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Nodes = 2 }), "set exactly one"},
		{"too many gpus", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Gpus = 65 }), "spec.gpus is 65"},
		{"too many nodes", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Gpus, r.Spec.Nodes = 0, 1025 }), "spec.nodes is 1025"},
		{"long model", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Model = strings.Repeat("m", 129) }), "spec.model is 129 bytes"},
		{"too many labels", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Labels = labels(33) }), "33 labels"},
		{"empty label key", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Labels = map[string]string{"": "x"} }), "a key of spec.labels is required"},
		{"NUL in label", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.Labels = map[string]string{"k": "a\x00b"} }), "spec.labels[k] contains a control character"},
		{"huge memory", ok(func(r *fleetpb.CreateReservationRequest) { r.Spec.MinGpuMemoryMib = 1 << 40 }), "spec.min_gpu_memory_mib"},
		{"long request_id", ok(func(r *fleetpb.CreateReservationRequest) { r.RequestId = strings.Repeat("x", 129) }), "request_id is 129 bytes"},
		{"long wait", ok(func(r *fleetpb.CreateReservationRequest) { r.Wait = durationpb.New(61 * time.Second) }), "the longest wait is 1m0s"},
		{"negative wait", ok(func(r *fleetpb.CreateReservationRequest) { r.Wait = durationpb.New(-time.Second) }), "wait is -1s"},
	}
}

func TestValidation(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	for _, c := range badCreates() {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			_, err := e.client.Create(as(t, aliceKey), c.req)
			wantCode(t, err, codes.InvalidArgument, c.mention)

			body, err := jsonOut.Marshal(c.req)
			if err != nil {
				t.Fatal(err)
			}
			res := e.do("POST", "/v1/reservations", aliceKey, body)
			msg, code := res.apiError(t)
			if res.status != http.StatusBadRequest || code != "INVALID_ARGUMENT" || !strings.Contains(msg, c.mention) {
				t.Errorf("HTTP %d %s, want 400 INVALID_ARGUMENT mentioning %q", res.status, res.body, c.mention)
			}
			if msg != status.Convert(err).Message() && err != nil {
				t.Errorf("HTTP says %q, gRPC %q", msg, status.Convert(err).Message())
			}
		})
	}
	// What only HTTP can get wrong.
	for _, c := range []struct {
		name, method, path, body string
		hdr                      []string
		status                   int
		mention                  string
	}{
		{"not JSON", "POST", "/v1/reservations", `{"spec": `, nil, 400, "not a CreateReservationRequest in JSON"},
		{"unknown field", "POST", "/v1/reservations", `{"spec": {"pool": "a", "gpu": 1}}`, nil, 400, "gpu"},
		{"invalid UTF-8", "POST", "/v1/reservations", "{\"spec\": {\"pool\": \"a\xffb\", \"gpus\": 1}}", nil, 400, "UTF-8"},
		{"bad wait", "POST", "/v1/reservations", `{"spec": {"pool": "a", "gpus": 1}, "wait": "soon"}`, nil, 400, `Duration value "soon"`},
		{"empty body", "POST", "/v1/reservations", ``, nil, 400, "body is empty"},
		{"huge body", "POST", "/v1/reservations", `{"request_id": "` + strings.Repeat("x", MaxRequestBytes) + `"}`, nil, 413, "larger than 65536 bytes"},
		{"not JSON content", "POST", "/v1/reservations", `pool=a`, []string{"Content-Type", "application/x-www-form-urlencoded"}, 415, "application/json"},
		{"bad state", "GET", "/v1/reservations?state=DONE", ``, nil, 400, `state "DONE"`},
		{"bad page_size", "GET", "/v1/reservations?page_size=-1", ``, nil, 400, "page_size"},
		{"unknown parameter", "GET", "/v1/reservations?owner=bob", ``, nil, 400, `"owner"`},
		{"long id", "GET", "/v1/reservations/" + strings.Repeat("r", 129), ``, nil, 400, "id is 129 bytes"},
		{"no such path", "GET", "/v1/reservationsx", ``, nil, 404, "no such path"},
		{"nested path", "GET", "/v1/reservations/a/b", ``, nil, 404, "no such path"},
		{"wrong method", "PUT", "/v1/reservations", ``, nil, 405, "use GET, POST"},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			var body []byte
			if c.body != "" || c.method == "POST" {
				body = []byte(c.body)
			}
			res := e.do(c.method, c.path, aliceKey, body, c.hdr...)
			msg, _ := res.apiError(t)
			if res.status != c.status || !strings.Contains(msg, c.mention) {
				t.Errorf("%d %s, want %d mentioning %q", res.status, res.body, c.status, c.mention)
			}
		})
	}
	if msgs := e.resvMsgs(); len(msgs) != 0 {
		t.Errorf("refused requests published %d events", len(msgs))
	}
}

// Invalid UTF-8 cannot be sent over gRPC (proto3 strings), so check the
// checks directly.
func TestCheckCreateUTF8(t *testing.T) {
	req := &fleetpb.CreateReservationRequest{Spec: &fleetpb.ReservationSpec{Pool: "a\xffb", Gpus: 1}}
	err := checkCreate(req, time.Minute)
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "UTF-8") {
		t.Fatalf("got %v", err)
	}
	valid := &fleetpb.CreateReservationRequest{Spec: &fleetpb.ReservationSpec{Pool: "a100", Nodes: 1024, Model: "H100", MinGpuMemoryMib: 80 << 10}, RequestId: "x", Wait: durationpb.New(time.Minute)}
	if err := checkCreate(valid, time.Minute); err != nil {
		t.Fatalf("valid request refused: %v", err)
	}
}
