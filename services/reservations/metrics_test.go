package reservations

import (
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// TestRequestCodeLabel: a refused call counts under its status code as
// google.rpc.Code spells it, over gRPC and HTTP alike: the one spelling of
// every millrace series with a code label (and of the JSON errors), which
// the alerts match.
func TestRequestCodeLabel(t *testing.T) {
	t.Parallel()
	e := newEnv(t, Config{})
	reg := prometheus.NewRegistry()
	reg.MustRegister(e.srv.m.requests)
	if _, err := e.client.Create(as(t, "not-a-key-0123456789"), &fleetpb.CreateReservationRequest{Spec: spec("a100", 1)}); err == nil {
		t.Fatal("a call with an unknown key was answered")
	}
	if res := e.do("GET", "/v1/reservations/r-none", aliceKey, nil); res.status != 404 {
		t.Fatalf("GET of a reservation never made: %d %s", res.status, res.body)
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "code" {
					got = append(got, l.GetValue())
				}
			}
		}
	}
	slices.Sort(got)
	if want := []string{"NOT_FOUND", "UNAUTHENTICATED"}; !slices.Equal(got, want) {
		t.Errorf("code labels %q, want %q", got, want)
	}
}
