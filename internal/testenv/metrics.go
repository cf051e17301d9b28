package testenv

import (
	"fmt"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Metric is the sum of a metric's samples in g, counters and gauges alike,
// over the series that carry every label given as `name="value"` (none:
// every series). A metric g does not hold reads 0.
func Metric(t testing.TB, g prometheus.Gatherer, name string, labels ...string) float64 {
	t.Helper()
	mfs, err := g.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var sum float64
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			have := map[string]bool{}
			for _, l := range m.GetLabel() {
				have[fmt.Sprintf("%s=%q", l.GetName(), l.GetValue())] = true
			}
			for _, l := range labels {
				if !have[l] {
					continue series
				}
			}
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum
}
