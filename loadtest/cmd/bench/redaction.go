package main

import (
	"context"
	"flag"
	"fmt"
	"sort"
)

// The redaction A/B scenario: the same flat-out replay into `millrace serve
// bes` with JetStream in its own process (so that the edge's CPU is the
// edge's alone), with redaction off and on in alternating runs of one
// bench, and the edge's CPU per event of each compared. Redaction must cost
// at most 10 % of the edge's CPU per event.
const scEdgeRedaction = "edge-redaction"

type redactionConfig struct {
	rounds  int
	streams int
	events  int64
}

func (c *redactionConfig) register(fs *flag.FlagSet) {
	fs.IntVar(&c.rounds, "redaction-rounds", 3, "edge-redaction: pairs of runs (off, on)")
	fs.IntVar(&c.streams, "redaction-streams", 8, "edge-redaction: concurrent streams per run")
	fs.Int64Var(&c.events, "redaction-events", 100_000, "edge-redaction: events per run")
}

func (b *bench) redactionScenario(ctx context.Context, rep *scenarioReport) error {
	rep.Description = "flat-out replay into `millrace serve bes --nats-url` (natsd apart), MILLRACE_BES_REDACT=false and true in alternating runs; edge CPU per event"
	rc := b.cfg.redaction
	savedEvents := b.cfg.events
	b.cfg.events = rc.events
	defer func() { b.cfg.events = savedEvents; b.edgeEnv = nil }()
	// per: edge CPU per event; rel: the same over natsd's CPU per event
	// in the same run. natsd does the same work in both variants (it
	// stores the same number of events of nearly the same size), so rel
	// cancels what the machine's other work does to both processes.
	per, rel := map[bool][]float64{}, map[bool][]float64{}
	for i := 0; i < rc.rounds; i++ {
		for _, on := range []bool{false, true} {
			b.edgeEnv = []string{fmt.Sprintf("MILLRACE_BES_REDACT=%t", on)}
			run, err := b.flatRun(ctx, scEdgeRedaction, rc.streams, true, false)
			if err != nil {
				return err
			}
			run.Name = fmt.Sprintf("%d streams, redaction %s, round %d", rc.streams, onOff(on), i+1)
			rep.Runs = append(rep.Runs, run)
			b.printRun(run)
			per[on] = append(per[on], run.CPU["edge"].Per100kEvents)
			if n := run.CPU["natsd"].Per100kEvents; n > 0 {
				rel[on] = append(rel[on], round(run.CPU["edge"].Per100kEvents/n, 3))
			}
		}
	}
	off, on := median(per[false]), median(per[true])
	note := fmt.Sprintf("edge CPU-s per 100k events, median of %d runs each: off %.3f, on %.3f (runs: off %v, on %v)", rc.rounds, off, on, per[false], per[true])
	rep.Checks = append(rep.Checks, atMost(scEdgeRedaction+": edge CPU per event with redaction, relative to without", on/off, 1.10, "x", note))
	fmt.Printf("  %s\n", note)
	if len(rel[false]) > 0 && len(rel[true]) > 0 {
		roff, ron := median(rel[false]), median(rel[true])
		note := fmt.Sprintf("edge CPU over natsd CPU in the same run, median: off %.3f, on %.3f (runs: off %v, on %v)", roff, ron, rel[false], rel[true])
		rep.Checks = append(rep.Checks, atMost(scEdgeRedaction+": the same, each run's edge CPU taken relative to its natsd's (machine noise cancelled)", ron/roff, 1.10, "x", note))
		fmt.Printf("  %s\n", note)
	}
	return nil
}

func onOff(on bool) string {
	if on {
		return "on"
	}
	return "off"
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}
