package reservations

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// FuzzCreateJSON feeds the HTTP decoding and the checks of Create what a
// client may send as a body. Run it with
//
//	go test -run '^$' -fuzz FuzzCreateJSON ./services/reservations/
//
// Whatever the bytes, decoding and checking must not panic and must refuse
// with INVALID_ARGUMENT; a request they accept must survive a JSON round
// trip unchanged and still be accepted.
func FuzzCreateJSON(f *testing.F) {
	for _, seed := range []string{
		`{"spec": {"pool": "a100", "gpus": 2}}`,
		`{"spec": {"pool": "a100.east", "gpus": 8, "model": "A100-80GB", "labels": {"zone": "z1", "rack": "7"}, "min_gpu_memory_mib": "81920"}, "request_id": "nightly-7", "wait": "30s"}`,
		`{"spec": {"pool": "h100", "nodes": 16}, "requestId": "train-1", "wait": "1.5s"}`,
		`{"spec": {"pool": "a100", "gpus": 2, "nodes": 1}}`,
		`{"spec": {"pool": "", "gpus": 99}, "wait": "-3s"}`,
		`{"spec": {"pool": "a\u0000b", "gpus": 1}}`,
		`{}`,
		`null`,
		`[]`,
		``,
	} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, body []byte) {
		req, err := decodeCreateJSON(body)
		if err != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("decode refused with %v", err)
			}
			return
		}
		if err := checkCreate(req, DefaultMaxWait); err != nil {
			if status.Code(err) != codes.InvalidArgument {
				t.Fatalf("check refused with %v", err)
			}
			return
		}
		out, err := jsonOut.Marshal(req)
		if err != nil {
			t.Fatalf("accepted request does not encode: %v", err)
		}
		again, err := decodeCreateJSON(out)
		if err != nil {
			t.Fatalf("re-decode of %s: %v", out, err)
		}
		if !proto.Equal(req, again) {
			t.Fatalf("round trip changed %v into %v", req, again)
		}
		if err := checkCreate(again, DefaultMaxWait); err != nil {
			t.Fatalf("round trip made an accepted request invalid: %v", err)
		}
		if w := req.GetWait().AsDuration(); w < 0 || w > DefaultMaxWait {
			t.Fatalf("accepted wait %s", w)
		}
	})
}
