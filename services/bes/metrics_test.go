package bes

import (
	"context"
	"slices"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
)

// TestRejectionCodeLabel: a refused request counts under its status code
// as google.rpc.Code spells it, the one spelling of every millrace series
// with a code label (and of the JSON errors), which the alerts match.
func TestRejectionCodeLabel(t *testing.T) {
	reg := prometheus.NewRegistry()
	s, err := New(Config{}, nil, nil, NewMetrics(reg), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := s.PublishLifecycleEvent(context.Background(), &buildpb.PublishLifecycleEventRequest{}); err == nil {
		t.Fatal("a lifecycle request without an event was accepted")
	}
	if got := codeLabels(t, reg, "millrace_bes_rejections_total"); !slices.Equal(got, []string{"INVALID_ARGUMENT"}) {
		t.Errorf("code labels %q, want [INVALID_ARGUMENT]", got)
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
