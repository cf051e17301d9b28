package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// A/B mode: every selected scenario runs against two millrace binaries in
// turn (abOrder), in one bench, so that both see the same machine; each
// figure is compared between them (abstats.go) in ab-<scenario>.json and
// ab-summary.json. The natsd, the fixtures and PostgreSQL are shared:
// only the millrace binary differs between the runs.

type abConfig struct {
	a, b   string
	rounds int
}

func (c *abConfig) register(fs *flag.FlagSet) {
	fs.StringVar(&c.a, "a", "", "A/B mode: the millrace binary of the baseline, A; each selected scenario then runs -rounds times against A and against B, alternately (A B B A A B ...), and ab-<scenario>.json and ab-summary.json in -out compare each figure (loadtest/README.md)")
	fs.StringVar(&c.b, "b", "", "A/B mode: the millrace binary compared with A (empty: -bin)")
	fs.IntVar(&c.rounds, "rounds", 3, "A/B mode: runs of each scenario per binary (0: 3; at least 2, since the rounds' spread is the noise estimate)")
}

func (c *abConfig) on() bool { return c.a != "" }

// validate fills the defaults (B is -bin) and refuses what cannot run.
func (c *abConfig) validate(bin string) error {
	if !c.on() {
		if c.b != "" {
			return errors.New("-b needs -a (the binary to compare it with)")
		}
		return nil
	}
	if c.b == "" {
		c.b = bin
	}
	switch {
	case c.rounds == 0:
		c.rounds = 3
	case c.rounds < 2:
		return fmt.Errorf("-rounds %d: want at least 2 (the spread of the rounds is the noise estimate)", c.rounds)
	}
	return nil
}

// abBinary is one side of the comparison.
type abBinary struct {
	Path    string `json:"path"`
	Version string `json:"version"` // what `millrace version` says
}

func describeBinary(ctx context.Context, path string) abBinary {
	b := abBinary{Path: path}
	if out, err := exec.CommandContext(ctx, path, "version").Output(); err == nil {
		b.Version = strings.TrimSpace(string(out))
	}
	return b
}

// abRun is one run of a scenario in an A/B comparison.
type abRun struct {
	Side      abSide    `json:"side"`
	Round     int       `json:"round"` // 1, 2, ...: the side's own count
	Started   time.Time `json:"started"`
	DurationS float64   `json:"duration_s"`
	// OtherLoadCores is the most of the machine other work took in any of
	// the run's measured intervals (BES and commit-log runs), to tell a
	// round that other work disturbed.
	OtherLoadCores float64   `json:"other_load_cores_max,omitempty"`
	Error          string    `json:"error,omitempty"`
	Figures        []abValue `json:"figures"`
}

// abReport is ab-<scenario>.json.
type abReport struct {
	Scenario    string     `json:"scenario"`
	Description string     `json:"description"`
	A           abBinary   `json:"a"`
	B           abBinary   `json:"b"`
	Order       []abSide   `json:"order"`
	Rule        string     `json:"rule"`
	Runs        []abRun    `json:"runs"`
	Figures     []abFigure `json:"figures"`
	Within      int        `json:"within_noise"`
	Outside     []string   `json:"outside_noise"`
	// Errors are the failed runs; their figures are left out.
	Errors []string `json:"errors,omitempty"`
	// Skipped says why the scenario did not run (bazel-real without Bazel).
	Skipped string `json:"skipped,omitempty"`
}

// abSummary is ab-summary.json.
type abSummary struct {
	Started   time.Time           `json:"started"`
	Finished  time.Time           `json:"finished"`
	DurationS float64             `json:"duration_s"`
	Command   string              `json:"command"`
	Machine   machineInfo         `json:"machine"`
	Fixtures  fixtureInfo         `json:"fixtures"`
	A         abBinary            `json:"a"`
	B         abBinary            `json:"b"`
	Rounds    int                 `json:"rounds"`
	Order     []abSide            `json:"order"`
	Rule      string              `json:"rule"`
	Scenarios []abScenarioSummary `json:"scenarios"`
}

type abScenarioSummary struct {
	Scenario string   `json:"scenario"`
	File     string   `json:"file"`
	Figures  int      `json:"figures"`
	Within   int      `json:"within_noise"`
	Outside  []string `json:"outside_noise"`
	Errors   []string `json:"errors,omitempty"`
	Skipped  string   `json:"skipped,omitempty"`
}

// runAB is the A/B mode's main loop: scenario by scenario, all the rounds
// of one before the next, so that the two binaries' runs of a scenario
// are minutes apart, not the length of the whole bench.
func (b *bench) runAB(ctx context.Context, started time.Time) error {
	c := b.cfg
	bins := map[abSide]abBinary{sideA: describeBinary(ctx, c.ab.a), sideB: describeBinary(ctx, c.ab.b)}
	order := abOrder(c.ab.rounds)
	sum := abSummary{Started: started, Command: strings.Join(os.Args, " "), Machine: b.machine, Fixtures: b.fixtureInfo,
		A: bins[sideA], B: bins[sideB], Rounds: c.ab.rounds, Order: order, Rule: abNoiseRule}
	fmt.Printf("bench: A/B, %d rounds each, order %s\n  A: %s (%s)\n  B: %s (%s)\n", c.ab.rounds, sidesString(order),
		bins[sideA].Path, bins[sideA].Version, bins[sideB].Path, bins[sideB].Version)
	var failed []string
	for _, name := range allScenarios {
		if !c.scenarios[name] || ctx.Err() != nil {
			continue
		}
		rep := b.abScenario(ctx, name, order, bins)
		file := filepath.Join(c.out, "ab-"+name+".json")
		if err := writeJSON(file, rep); err != nil {
			return err
		}
		sum.Scenarios = append(sum.Scenarios, abScenarioSummary{Scenario: name, File: filepath.Base(file),
			Figures: len(rep.Figures), Within: rep.Within, Outside: rep.Outside, Errors: rep.Errors, Skipped: rep.Skipped})
		printAB(os.Stdout, rep)
		failed = append(failed, rep.Errors...)
	}
	sum.Finished = time.Now()
	sum.DurationS = round(sum.Finished.Sub(started).Seconds(), 1)
	if err := writeJSON(filepath.Join(c.out, "ab-summary.json"), sum); err != nil {
		return err
	}
	printABSummary(os.Stdout, sum, c.out)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	if len(failed) > 0 {
		return fmt.Errorf("%d runs failed: %s", len(failed), strings.Join(failed, "; "))
	}
	return nil
}

// abScenario runs one scenario in order and compares its figures.
func (b *bench) abScenario(ctx context.Context, name string, order []abSide, bins map[abSide]abBinary) *abReport {
	rep := &abReport{Scenario: name, A: bins[sideA], B: bins[sideB], Order: order, Rule: abNoiseRule, Outside: []string{}}
	defer func() { b.cfg.bin = bins[sideB].Path }()
	rounds := map[abSide]int{}
	for i, side := range order {
		if ctx.Err() != nil {
			break
		}
		rounds[side]++
		fmt.Printf("\n=== %s: run %d of %d, %s round %d\n", name, i+1, len(order), side, rounds[side])
		b.cfg.bin = bins[side].Path
		run := abRun{Side: side, Round: rounds[side], Started: time.Now()}
		sr := b.runScenario(ctx, name)
		// Nothing a run leaves behind may serve the other binary's next run.
		b.releaseKept()
		run.DurationS = round(time.Since(run.Started).Seconds(), 1)
		run.Error, run.Figures = sr.Error, abFigures(sr)
		for _, r := range sr.Runs {
			if r.Machine != nil {
				run.OtherLoadCores = max(run.OtherLoadCores, r.Machine.OtherCores)
			}
		}
		for _, r := range sr.Commits {
			run.OtherLoadCores = max(run.OtherLoadCores, r.OtherLoadCores)
		}
		rep.Description = sr.Description
		rep.Runs = append(rep.Runs, run)
		if sr.Skipped != "" {
			rep.Skipped = sr.Skipped
			fmt.Printf("bench: %s skipped: %s\n", name, sr.Skipped)
			break // the other rounds would be skipped too
		}
		if sr.Error != "" {
			msg := fmt.Sprintf("%s %s%d: %s", name, side, run.Round, sr.Error)
			fmt.Printf("bench: %s\n", msg)
			rep.Errors = append(rep.Errors, msg)
		}
	}
	rep.Figures = compareRuns(rep.Runs)
	for _, f := range rep.Figures {
		if f.Verdict == verdictWithin {
			rep.Within++
		} else {
			rep.Outside = append(rep.Outside, f.Name)
		}
	}
	return rep
}

// compareRuns gathers each figure's values per side, from the runs that
// did not fail, in the order the figures first appear.
func compareRuns(runs []abRun) []abFigure {
	var names []string
	units := map[string]string{}
	values := map[abSide]map[string][]float64{sideA: {}, sideB: {}}
	for _, r := range runs {
		if r.Error != "" {
			continue
		}
		for _, v := range r.Figures {
			if _, ok := units[v.Name]; !ok {
				names = append(names, v.Name)
				units[v.Name] = v.Unit
			}
			values[r.Side][v.Name] = append(values[r.Side][v.Name], v.Value)
		}
	}
	out := make([]abFigure, 0, len(names))
	for _, n := range names {
		out = append(out, compareFigure(n, units[n], values[sideA][n], values[sideB][n]))
	}
	return out
}

func sidesString(order []abSide) string {
	s := make([]string, len(order))
	for i, o := range order {
		s[i] = string(o)
	}
	return strings.Join(s, " ")
}

// printAB writes one scenario's comparison as a table.
func printAB(w io.Writer, rep *abReport) {
	width := len("figure")
	for _, f := range rep.Figures {
		width = max(width, min(len(f.Name), 90))
	}
	fmt.Fprintf(w, "\nA/B %s (%s)\n", rep.Scenario, sidesString(rep.Order))
	fmt.Fprintf(w, "%-*s %-14s %12s %12s %8s %8s %8s  %s\n", width, "figure", "unit", "A median", "B median", "B/A", "A spread", "B spread", "verdict")
	for _, f := range rep.Figures {
		fmt.Fprintf(w, "%-*s %-14s %12s %12s %8s %8s %8s  %s\n", width, f.Name, f.Unit,
			medianString(f.A), medianString(f.B), ratioString(f.Ratio, f.Verdict), pct(f.A), pct(f.B), f.Verdict)
	}
	for _, e := range rep.Errors {
		fmt.Fprintf(w, "failed (left out): %s\n", e)
	}
}

func medianString(s abStats) string {
	if len(s.Values) == 0 {
		return "-"
	}
	if math.Abs(s.Median) >= 1000 {
		return num(math.Round(s.Median)) // with thousands separators
	}
	if v := math.Abs(s.Median); v > 0 && v < 0.1 {
		return fmt.Sprintf("%.3g", s.Median) // per-document ratios of the fold
	}
	return num(s.Median)
}

func ratioString(r jfloat, verdict string) string {
	switch {
	case verdict == verdictOnlyA || verdict == verdictOnlyB:
		return "-"
	case math.IsInf(float64(r), 0):
		return "inf"
	}
	return fmt.Sprintf("%.3f", float64(r))
}

func pct(s abStats) string {
	switch v := float64(s.Spread); {
	case len(s.Values) == 0:
		return "-"
	case math.IsInf(v, 0):
		return "inf"
	default:
		return fmt.Sprintf("%.1f%%", v*100)
	}
}

func printABSummary(w io.Writer, sum abSummary, out string) {
	var figures, within int
	fmt.Fprintln(w)
	for _, s := range sum.Scenarios {
		figures += s.Figures
		within += s.Within
		fmt.Fprintf(w, "A/B %-20s %3d figures, %3d within noise", s.Scenario, s.Figures, s.Within)
		if len(s.Outside) > 0 {
			fmt.Fprintf(w, "; outside: %s", strings.Join(s.Outside, "; "))
		}
		if len(s.Errors) > 0 {
			fmt.Fprintf(w, "; %d runs failed", len(s.Errors))
		}
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "\nbench: A/B %d figures, %d within noise, %d outside, in %.0f s; reports in %s (ab-*.json)\n",
		figures, within, figures-within, sum.DurationS, out)
	if figures > within {
		// Even two identical binaries read outside on some figures: the
		// range of a few rounds is a rough estimate of the noise.
		fmt.Fprintf(w, "bench: with %d rounds, identical binaries read outside noise on some figures by chance; "+
			"run the scenarios again with more -rounds before reading a difference into one (loadtest/README.md)\n", sum.Rounds)
	}
}
