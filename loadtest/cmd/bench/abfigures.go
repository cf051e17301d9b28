package main

import (
	"fmt"
	"maps"
	"math"
	"slices"

	"github.com/millrace/millrace/loadtest/fleetsim"
	"github.com/millrace/millrace/loadtest/replay"
)

// abValue is one figure of one run of a scenario.
type abValue struct {
	Name  string  `json:"name"`
	Unit  string  `json:"unit,omitempty"`
	Value float64 `json:"value"`
}

type addFigure func(name, unit string, v float64)

// abFigures lists the figures of one scenario report: each check's value
// (the figures with targets, in every family of scenarios), then what the
// scenario measured besides (CPU of each process per unit of work,
// rates, latencies, WAL), each named after the run it comes from so that
// a figure is the same one in every round.
func abFigures(rep *scenarioReport) []abValue {
	var out []abValue
	seen := map[string]int{}
	add := func(name, unit string, v float64) {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return
		}
		if seen[name]++; seen[name] > 1 {
			name = fmt.Sprintf("%s (%d)", name, seen[name])
		}
		out = append(out, abValue{Name: name, Unit: unit, Value: v})
	}
	for _, c := range rep.Checks {
		add(c.Name, c.Unit, c.Value)
	}
	for _, r := range rep.Runs {
		runFigures(r, add)
	}
	for _, r := range rep.Commits {
		commitsFigures(r, add)
	}
	if rep.Kafka != nil {
		kafkaFigures(rep.Kafka, add)
	}
	if rep.Fleet != nil {
		fleetFigures(rep.Fleet, add)
	}
	return out
}

// runFigures: a BES (or placer) run, as printTable shows it and more.
func runFigures(r runReport, add addFigure) {
	p := r.Name + ": "
	if r.Mode == "idle" {
		idleFigures(p, r, add)
		return
	}
	add(p+"events/s", "events/s", r.EventsPerS)
	for _, k := range slices.Sorted(maps.Keys(r.CPU)) {
		f := r.CPU[k]
		add(p+k+" CPU-s per 100k events", "CPU-s", f.Per100kEvents)
		if f.CtxSwitchesPerEvent > 0 {
			add(p+k+" context switches per event", "switches", f.CtxSwitchesPerEvent)
		}
	}
	latency(p+"ack latency", r.AckLatency, add)
	if r.Lag != nil {
		latency(p+"projection lag", &r.Lag.Lag, add)
	}
	if r.Postgres != nil {
		add(p+"WAL bytes per event", "bytes", r.Postgres.WALPerEvent)
	}
	if r.Drain != nil {
		add(p+"rows/s", "rows/s", r.Drain.RowsPerS)
	}
	if m := r.Memory; m != nil {
		add(p+"edge RSS per open stream", "KiB", m.PerStreamKiB)
		add(p+"edge RSS per open stream, from the largest sample", "KiB", m.PerStreamSampledKiB)
		add(p+"edge baseline RSS", "KiB", float64(m.BaselineRSSKiB))
		add(p+"edge peak RSS", "KiB", float64(m.PeakRSSKiB))
	}
	if br := r.Bazel; br != nil {
		add(p+"dev CPU-s per 1,000 events", "CPU-s", br.DevPer1k)
		add(p+"dev CPU-s per 1,000 events, less idle", "CPU-s", br.DevPer1kLessIdle)
		add(p+"PostgreSQL CPU-s per 1,000 events", "CPU-s", br.PostgresPer1k)
		add(p+"PostgreSQL CPU-s per 1,000 events, less idle", "CPU-s", br.PostgresPer1kLessIdle)
		add(p+"bazel CPU-s per 1,000 events", "CPU-s", br.BazelPer1k)
		add(p+"events", "events", float64(br.Events))
	}
	var errs int64
	for _, n := range r.Errors {
		errs += n
	}
	add(p+"errors", "errors", float64(errs))
}

// idleFigures: an idle run has no events; its figures are per second.
func idleFigures(p string, r runReport, add addFigure) {
	for _, k := range slices.Sorted(maps.Keys(r.CPU)) {
		f := r.CPU[k]
		add(p+k+" CPU-s per second", "CPU-s/s", f.Cores)
		if f.CtxSwitchesPerS > 0 {
			add(p+k+" context switches per second", "switches/s", f.CtxSwitchesPerS)
		}
	}
	if r.Postgres != nil && r.WindowS > 0 {
		add(p+"WAL bytes per second", "bytes/s", round(float64(r.Postgres.WALBytes)/r.WindowS, 1))
	}
}

func latency(name string, s *replay.Summary, add addFigure) {
	if s == nil || s.Count == 0 {
		return
	}
	add(name+" p50", "ms", s.P50MS)
	add(name+" p99", "ms", s.P99MS)
}

// commitsFigures: one run of the commit-log load generator.
func commitsFigures(run commitsRun, add addFigure) {
	p, r := run.Name+": ", run.Report
	if r == nil {
		return
	}
	if w := r.Write; w != nil && w.WindowAcked > 0 {
		add(p+"acknowledged writes/s", "writes/s", w.AckedPerS)
		latency(p+"put latency", &w.Latency, add)
	}
	for _, pr := range r.Processes {
		if pr.Per1kWrites > 0 {
			add(p+pr.Name+" CPU-s per 1,000 writes", "CPU-s", pr.Per1kWrites)
		}
		if pr.FoldCPUS > 0 {
			add(p+pr.Name+" CPU-s over the fold", "CPU-s", pr.FoldCPUS)
		}
	}
	if f := r.Fold; f != nil {
		add(p+"fold documents/s", "docs/s", f.DocsPerS)
		add(p+"fold documents per CPU-second of the compactor's process", "docs/CPU-s", f.DocsPerCPUS)
		add(p+"fold bucket operations per changed document", "ops", f.BucketOpsPerDoc)
		add(p+"fold stream deletions per changed document", "deletions", f.DeletionsPerDoc)
	}
	if v := r.Verify; v != nil {
		add(p+"oracle reads/s", "reads/s", v.ReadsPerS)
		if len(v.List) > 0 && v.List[0].Error == "" {
			add(p+"first List page", "ms", v.List[0].FirstPageMS)
		}
	}
}

// kafkaFigures: the exporter's drain and paced load.
func kafkaFigures(k *kafkaReport, add addFigure) {
	add("drain: messages/s", "messages/s", k.DrainMessagesPerS)
	add("drain: messages per CPU-second of the exporter", "messages/CPU-s", k.MessagesPerCPUS)
	if k.DrainMessages > 0 {
		add("drain: edge (with JetStream) CPU-s per 100k messages", "CPU-s", k.EdgeJetStreamCPUS/float64(k.DrainMessages)*1e5)
	}
	if k.PacedEvents > 0 {
		add("paced: exporter CPU-s per 100k events", "CPU-s", k.PacedExporterCPUS/float64(k.PacedEvents)*1e5)
	}
	add("paced: export delay p50", "ms", k.DelayP50MS)
	add("paced: export delay p99", "ms", k.DelayP99MS)
	add("paced: Kafka produce p99", "ms", k.ProduceP99MS)
	add("export errors", "errors", k.ExportErrors)
}

// fleetFigures: the fleet simulator's report (the last run's, for
// fleet-churn).
func fleetFigures(r *fleetsim.Report, add addFigure) {
	add("fleet: sessions held at the peak", "sessions", float64(r.Sessions.Peak))
	latency("fleet: first Welcome", &r.Sessions.FirstWelcome, add)
	if r.Placements.Placed > 0 {
		add("fleet: placements/s", "placements/s", r.Placements.PerSecond)
		latency("fleet: place-to-active", &r.Placements.PlaceToActive, add)
	}
	latency("fleet: re-home", &r.Rehome.Summary, add)
	if r.RSSPerSessionKiB > 0 {
		add("fleet: gateway RSS per session", "KiB", r.RSSPerSessionKiB)
	}
	var gw float64
	for _, g := range r.Gateways {
		gw += g.CPUS
	}
	if len(r.Gateways) > 0 {
		add("fleet: gateways' CPU-s", "CPU-s", gw)
	}
	add("fleet: simulator CPU-s", "CPU-s", r.Simulator.CPUS)
	if r.Liveness != nil {
		latency("fleet: liveness lag", &r.Liveness.Lag, add)
	}
}
