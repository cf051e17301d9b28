package main

import (
	"encoding/json"
	"math"
	"slices"
	"strings"
	"testing"
)

func TestABOrder(t *testing.T) {
	want := map[int]string{
		1: "A B",
		2: "A B B A",
		3: "A B B A A B",
		4: "A B B A A B B A",
	}
	for rounds, w := range want {
		got := abOrder(rounds)
		if s := sidesString(got); s != w {
			t.Errorf("abOrder(%d) = %s, want %s", rounds, s, w)
		}
		// Every side runs once per round.
		if a, b := count(got, sideA), count(got, sideB); a != rounds || b != rounds {
			t.Errorf("abOrder(%d): %d A, %d B", rounds, a, b)
		}
	}
}

func count(order []abSide, s abSide) int {
	n := 0
	for _, o := range order {
		if o == s {
			n++
		}
	}
	return n
}

func TestStatsOf(t *testing.T) {
	s := statsOf([]float64{3, 1, 2, 10})
	if s.Median != 2.5 || s.Min != 1 || s.Max != 10 || !near(float64(s.Spread), 9/2.5) {
		t.Errorf("stats of 3 1 2 10: %+v", s)
	}
	if !slices.Equal(s.Values, []float64{3, 1, 2, 10}) {
		t.Errorf("values reordered: %v", s.Values)
	}
	if s := statsOf([]float64{4, 5, 6}); s.Median != 5 || !near(float64(s.Spread), 0.4) {
		t.Errorf("stats of 4 5 6: %+v", s)
	}
	if s := statsOf([]float64{0, 0}); s.Spread != 0 {
		t.Errorf("equal zeros: spread %v, want 0", s.Spread)
	}
	if s := statsOf([]float64{0, 0, 3}); !math.IsInf(float64(s.Spread), 1) {
		t.Errorf("median 0, rounds differ: spread %v, want unbounded", s.Spread)
	}
}

func TestCompareFigure(t *testing.T) {
	cases := []struct {
		name    string
		a, b    []float64
		ratio   float64
		noise   float64
		verdict string
	}{
		// A spread 10 %, B spread 4 %: a 5 % move is noise.
		{"within A's spread", []float64{100, 95, 105}, []float64{104, 105, 106}, 1.05, 0.1, verdictWithin},
		// The larger spread counts, whichever side it is.
		{"within B's spread", []float64{100, 100, 100}, []float64{90, 96, 100}, 0.96, 10.0 / 96, verdictWithin},
		{"higher", []float64{100, 98, 102}, []float64{120, 121, 119}, 1.2, 0.04, verdictHigher},
		{"lower", []float64{100, 98, 102}, []float64{80, 81, 79}, 0.8, 0.04, verdictLower},
		// Identical rounds of a count: no noise, and equal.
		{"equal, no spread", []float64{7, 7}, []float64{7, 7}, 1, 0, verdictWithin},
		{"zeros", []float64{0, 0}, []float64{0, 0}, 1, 0, verdictWithin},
		{"from zero", []float64{0, 0}, []float64{1, 1}, math.Inf(1), 0, verdictHigher},
		{"A's median 0, rounds differ", []float64{0, 0, 2}, []float64{1, 1, 1}, math.Inf(1), math.Inf(1), verdictWithin},
		{"only A", []float64{1}, nil, 0, 0, verdictOnlyA},
		{"only B", nil, []float64{1}, 0, 0, verdictOnlyB},
	}
	for _, c := range cases {
		f := compareFigure(c.name, "u", c.a, c.b)
		if f.Verdict != c.verdict {
			t.Errorf("%s: verdict %q, want %q (%+v)", c.name, f.Verdict, c.verdict, f)
		}
		if !near(float64(f.Ratio), c.ratio) || !near(float64(f.Noise), c.noise) {
			t.Errorf("%s: ratio %v noise %v, want %v and %v", c.name, f.Ratio, f.Noise, c.ratio, c.noise)
		}
	}
	// The bound is inclusive (values exact in binary): A's spread is 0.5.
	a := []float64{0.75, 1, 1.25}
	if f := compareFigure("bound", "", a, []float64{1.5, 1.5}); f.Verdict != verdictWithin {
		t.Errorf("|1.5 - 1| <= spread 0.5: %q", f.Verdict)
	}
	if f := compareFigure("past the bound", "", a, []float64{1.5 + 1.0/64, 1.5 + 1.0/64}); f.Verdict != verdictHigher {
		t.Errorf("|1.515 - 1| > spread 0.5: %q", f.Verdict)
	}
}

func near(got, want float64) bool {
	if math.IsInf(want, 0) {
		return got == want
	}
	return math.Abs(got-want) < 1e-3
}

func TestCompareRuns(t *testing.T) {
	v := func(x float64) []abValue {
		return []abValue{{Name: "cpu", Unit: "CPU-s", Value: x}, {Name: "rate", Value: 10 * x}}
	}
	runs := []abRun{
		{Side: sideA, Round: 1, Figures: v(2)},
		{Side: sideB, Round: 1, Figures: append(v(3), abValue{Name: "new in B", Value: 1})},
		{Side: sideB, Round: 2, Figures: v(3.2)},
		{Side: sideA, Round: 2, Figures: v(100), Error: "edge exited"}, // left out
		{Side: sideA, Round: 3, Figures: v(2.2)},
	}
	fs := compareRuns(runs)
	var names []string
	for _, f := range fs {
		names = append(names, f.Name)
	}
	if strings.Join(names, ",") != "cpu,rate,new in B" {
		t.Fatalf("figures %v", names)
	}
	cpu := fs[0]
	if !slices.Equal(cpu.A.Values, []float64{2, 2.2}) || !slices.Equal(cpu.B.Values, []float64{3, 3.2}) || cpu.Unit != "CPU-s" {
		t.Errorf("cpu: %+v", cpu)
	}
	if !near(float64(cpu.Ratio), 3.1/2.1) || cpu.Verdict != verdictHigher {
		t.Errorf("cpu: ratio %v verdict %q", cpu.Ratio, cpu.Verdict)
	}
	if fs[2].Verdict != verdictOnlyB {
		t.Errorf("new in B: %q", fs[2].Verdict)
	}
}

func TestABReportJSON(t *testing.T) {
	// An unbounded ratio or spread must not make the report unwritable.
	f := compareFigure("from zero", "", []float64{0, 0, 1}, []float64{2, 2})
	b, err := json.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(b), `"ratio_b_over_a":null`) || !strings.Contains(string(b), `"spread":null`) {
		t.Errorf("json: %s", b)
	}
}

func TestABFigures(t *testing.T) {
	rep := &scenarioReport{
		Checks: []check{{Name: "edge events per CPU-second", Unit: "events/CPU-s", Value: 30000}},
		Runs: []runReport{{Name: "8 streams", EventsPerS: 40000,
			CPU:        map[string]cpuFigure{"edge": {Per100kEvents: 3.1}, "bench_client": {Per100kEvents: 2}},
			Errors:     map[string]int64{"unavailable": 2},
			Postgres:   &pgReport{WALPerEvent: 80},
			AckLatency: nil}},
		Kafka: &kafkaReport{DrainMessages: 200000, EdgeJetStreamCPUS: 2, MessagesPerCPUS: 1e5},
	}
	got := map[string]float64{}
	for _, v := range abFigures(rep) {
		if _, dup := got[v.Name]; dup {
			t.Errorf("figure %q twice", v.Name)
		}
		got[v.Name] = v.Value
	}
	for name, want := range map[string]float64{
		"edge events per CPU-second":                           30000,
		"8 streams: events/s":                                  40000,
		"8 streams: edge CPU-s per 100k events":                3.1,
		"8 streams: bench_client CPU-s per 100k events":        2,
		"8 streams: WAL bytes per event":                       80,
		"8 streams: errors":                                    2,
		"drain: messages per CPU-second of the exporter":       1e5,
		"drain: edge (with JetStream) CPU-s per 100k messages": 1,
	} {
		if v, ok := got[name]; !ok || !near(v, want) {
			t.Errorf("%s = %v (present %v), want %v", name, v, ok, want)
		}
	}
}

func TestABConfigValidate(t *testing.T) {
	c := abConfig{a: "old", rounds: 0}
	if err := c.validate("bin/millrace"); err != nil || c.b != "bin/millrace" || c.rounds != 3 {
		t.Errorf("defaults: %+v, %v", c, err)
	}
	for _, bad := range []abConfig{{a: "old", rounds: 1}, {a: "old", rounds: -1}, {b: "new"}} {
		if err := bad.validate("bin/millrace"); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
	if off := (abConfig{rounds: 3}); off.on() || off.validate("bin/millrace") != nil {
		t.Errorf("without -a: A/B mode on or an error")
	}
}

func TestABFiguresNewScenarios(t *testing.T) {
	rep := &scenarioReport{Runs: []runReport{
		{Name: "idle 1m0s", Mode: "idle", WindowS: 60, Postgres: &pgReport{WALBytes: 6000},
			CPU: map[string]cpuFigure{"dev": {Cores: 0.045, CtxSwitchesPerS: 1400}, "postgres_all": {Cores: 0.01}}},
		{Name: "1000 streams", Mode: "paced", EventsPerS: 2500, CPU: map[string]cpuFigure{"edge": {Per100kEvents: 20}},
			Memory: &memoryReport{PerStreamKiB: 580, PerStreamSampledKiB: 570, BaselineRSSKiB: 80000, PeakRSSKiB: 660000}},
		{Name: "3 bazel builds", Mode: "bazel", WindowEvents: 10440,
			Bazel: &bazelReport{Events: 10440, DevPer1k: 0.5, DevPer1kLessIdle: 0.3, PostgresPer1k: 0.2, PostgresPer1kLessIdle: 0.15, BazelPer1k: 30}},
	}}
	got := map[string]float64{}
	for _, v := range abFigures(rep) {
		got[v.Name] = v.Value
	}
	for name, want := range map[string]float64{
		"idle 1m0s: dev CPU-s per second":                                 0.045,
		"idle 1m0s: dev context switches per second":                      1400,
		"idle 1m0s: postgres_all CPU-s per second":                        0.01,
		"idle 1m0s: WAL bytes per second":                                 100,
		"1000 streams: edge RSS per open stream":                          580,
		"1000 streams: edge RSS per open stream, from the largest sample": 570,
		"1000 streams: edge baseline RSS":                                 80000,
		"1000 streams: edge peak RSS":                                     660000,
		"1000 streams: edge CPU-s per 100k events":                        20,
		"3 bazel builds: dev CPU-s per 1,000 events":                      0.5,
		"3 bazel builds: dev CPU-s per 1,000 events, less idle":           0.3,
		"3 bazel builds: PostgreSQL CPU-s per 1,000 events":               0.2,
		"3 bazel builds: PostgreSQL CPU-s per 1,000 events, less idle":    0.15,
		"3 bazel builds: bazel CPU-s per 1,000 events":                    30,
		"3 bazel builds: events":                                          10440,
	} {
		if v, ok := got[name]; !ok || !near(v, want) {
			t.Errorf("%s = %v (present %v), want %v", name, v, ok, want)
		}
	}
	// An idle run has no events: no per-event figures.
	for name := range got {
		if strings.HasPrefix(name, "idle 1m0s: ") && (strings.Contains(name, "per 100k") || strings.Contains(name, "events/s")) {
			t.Errorf("idle run has per-event figure %q", name)
		}
	}
}
