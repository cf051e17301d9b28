package commits

import (
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"

	commitspb "github.com/millrace/millrace/schemas/commits"
)

// TestRequestCodeLabel: a call counts under its status code as
// google.rpc.Code spells it, the one spelling of every millrace series
// with a code label (and of the JSON errors), which the alerts match.
func TestRequestCodeLabel(t *testing.T) {
	e := startEdge(t, Config{})
	if _, err := e.client.Get(as("not-a-key-of-this-edge"), &commitspb.GetRequest{World: "w1", Id: "d"}); err == nil {
		t.Fatal("a call with an unknown key was answered")
	}
	if _, err := e.client.Get(as(keyW1), &commitspb.GetRequest{World: "w1", Id: "never-written"}); err == nil {
		t.Fatal("a document never written was found")
	}
	got := codeLabels(t, e.reg, "millrace_commits_requests_total")
	slices.Sort(got)
	if want := []string{"NOT_FOUND", "UNAUTHENTICATED"}; !slices.Equal(got, want) {
		t.Errorf("code labels %q, want %q", got, want)
	}
}

// codeLabels are the values of the code label of family name in reg.
func codeLabels(t *testing.T, reg *prometheus.Registry, name string) []string {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var codes []string
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "code" {
					codes = append(codes, l.GetValue())
				}
			}
		}
	}
	return codes
}
