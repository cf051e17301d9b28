package main

import (
	"github.com/millrace/millrace/loadtest/fleetsim"

	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"time"

	"github.com/millrace/millrace/loadtest/replay"
)

// scenarioReport is one scenario's JSON file.
type scenarioReport struct {
	Scenario    string      `json:"scenario"`
	Description string      `json:"description"`
	Started     time.Time   `json:"started"`
	Machine     machineInfo `json:"machine"`
	Fixtures    fixtureInfo `json:"fixtures"`
	Runs        []runReport `json:"runs"`
	// Fleet is the fleet simulator's report, for the fleet scenarios.
	Fleet *fleetsim.Report `json:"fleet,omitempty"`
	// Commits are the commit-log load runs of a commits scenario.
	Commits []commitsRun `json:"commits,omitempty"`
	// Kafka is the Kafka export scenario's figures.
	Kafka *kafkaReport `json:"kafka,omitempty"`
	// Million is the million-events scenario's figures.
	Million *millionReport `json:"million,omitempty"`
	// Pages are the console-pages scenario's figures.
	Pages *pagesReport `json:"pages,omitempty"`
	// Rolling is the edges-rolling scenario's figures.
	Rolling *rollingReport `json:"rolling,omitempty"`
	// Partition is the partition-layout scenario's figures.
	Partition *partitionReport `json:"partition,omitempty"`
	// Partitioned is the projectors-partitioned scenario's figures.
	Partitioned *partitionedReport `json:"partitioned,omitempty"`
	Checks      []check            `json:"checks"`
	Error       string             `json:"error,omitempty"`
	// Skipped says why a scenario did not run (e.g. bazel-real without
	// Bazel); it has no checks then, and is not a failure.
	Skipped string `json:"skipped,omitempty"`
}

// runReport is one load run within a scenario.
type runReport struct {
	Name        string `json:"name"`
	Mode        string `json:"mode"` // "flat out", "paced" or "drain"
	Streams     int    `json:"streams,omitempty"`
	Connections int    `json:"connections,omitempty"`
	Projects    int    `json:"projects,omitempty"`
	NATS        string `json:"nats"` // "embedded in the edge" or "natsd process"
	NATSSync    string `json:"nats_sync"`

	TargetEventsPerS float64 `json:"target_events_per_s,omitempty"`
	ElapsedS         float64 `json:"elapsed_s"`
	// WindowS is the measured part of the run (paced: after the warm-up).
	WindowS float64 `json:"window_s"`
	// Events stored (tool + lifecycle) in the window; the whole run below.
	WindowEvents    int64   `json:"window_events"`
	EventsPerS      float64 `json:"events_per_s"`
	ToolEvents      int64   `json:"tool_events"`
	LifecycleEvents int64   `json:"lifecycle_events"`
	Invocations     int64   `json:"invocations_completed"`
	Truncated       int64   `json:"invocations_cut_short,omitempty"`
	Failed          int64   `json:"invocations_failed"`

	Errors       map[string]int64 `json:"errors"`
	ErrorSamples []string         `json:"error_samples,omitempty"`
	// Retried are the failures the client tried again as Bazel does, by
	// kind; StreamsResumed the streams that went on from their first
	// unacknowledged event (replay.Result).
	Retried        map[string]int64 `json:"retried,omitempty"`
	StreamsResumed int64            `json:"streams_resumed,omitempty"`

	AckLatency       *replay.Summary `json:"ack_latency,omitempty"`
	WarmupAckLatency *replay.Summary `json:"warmup_ack_latency,omitempty"`
	LifecycleLatency *replay.Summary `json:"lifecycle_latency,omitempty"`
	Lag              *lagReport      `json:"projection_lag,omitempty"`

	// CPU per process over the window, per 100k window events.
	CPU      map[string]cpuFigure `json:"cpu"`
	Machine  *machineCPUReport    `json:"machine_cpu,omitempty"`
	Postgres *pgReport            `json:"postgres,omitempty"`
	Drain    *drainReport         `json:"drain,omitempty"`
	// Server is what the edge and projector report in their /metrics.
	Server *serverFigures `json:"server_metrics,omitempty"`
	// Memory is edge-memory's RSS per open stream.
	Memory *memoryReport `json:"memory,omitempty"`
	// Bazel is bazel-real's builds and CPU per 1,000 events.
	Bazel *bazelReport `json:"bazel,omitempty"`
	// Storage is the storage scenario's figures for one workspace size.
	Storage *storageReport `json:"storage,omitempty"`
}

type cpuFigure struct {
	CPUSeconds    float64 `json:"cpu_s"`
	Per100kEvents float64 `json:"cpu_s_per_100k_events"`
	EventsPerCPUS float64 `json:"events_per_cpu_s"`
	// Cores is CPU seconds per wall second (to 4 decimals: an idle
	// process's share is a few thousandths).
	Cores float64 `json:"cores"`
	// CtxSwitchesPerEvent counts the process's threads' context switches
	// (voluntary and involuntary) per event, CtxSwitchesPerS per second.
	CtxSwitchesPerEvent float64 `json:"ctx_switches_per_event,omitempty"`
	CtxSwitchesPerS     float64 `json:"ctx_switches_per_s,omitempty"`
}

func figure(cpu time.Duration, events int64, wall time.Duration) cpuFigure {
	f := cpuFigure{CPUSeconds: round(cpu.Seconds(), 3)}
	if events > 0 {
		f.Per100kEvents = round(cpu.Seconds()/float64(events)*1e5, 3)
	}
	if cpu > 0 {
		f.EventsPerCPUS = math.Round(float64(events) / cpu.Seconds())
	}
	if wall > 0 {
		f.Cores = round(cpu.Seconds()/wall.Seconds(), 4)
	}
	return f
}

type machineCPUReport struct {
	BusyCPUS float64 `json:"busy_cpu_s"`
	// UnaccountedCPUS is busy CPU not in any measured process (other work
	// on the machine, and the kernel's share not charged to a process).
	UnaccountedCPUS float64 `json:"unaccounted_cpu_s"`
	StealCPUS       float64 `json:"steal_cpu_s"`
	// OtherCores is UnaccountedCPUS per wall second: how many of the
	// machine's cores other work took meanwhile.
	OtherCores float64 `json:"other_load_cores"`
	// OtherCoresBefore is the other work measured just before the run
	// (paced runs wait for it to fall below 0.25 cores, up to -quiet-wait).
	OtherCoresBefore float64 `json:"other_load_cores_before,omitempty"`
	Load1Start       string  `json:"loadavg_start"`
}

type pgReport struct {
	Shared bool `json:"shared"`
	// Note says how to read the figures when the server is shared.
	Note          string  `json:"note,omitempty"`
	CPUAllS       float64 `json:"cpu_all_processes_s"`
	CPUAttributed float64 `json:"cpu_attributed_s"`
	WALBytes      int64   `json:"wal_bytes"`
	WALPerEvent   float64 `json:"wal_bytes_per_event"`
	OtherXacts    int64   `json:"other_databases_transactions"`
	OtherBackends int     `json:"other_databases_backends_seen"`
}

type lagReport struct {
	// Measured: invocations whose stream ended after the warm-up, seen projected.
	Measured       int            `json:"invocations_measured"`
	NotProjected   int            `json:"invocations_not_projected"`
	PollIntervalMS float64        `json:"poll_interval_ms"`
	Lag            replay.Summary `json:"lag"`
	WarmupLag      replay.Summary `json:"warmup_lag"`
}

type drainReport struct {
	StreamMessages   uint64           `json:"stream_messages"`
	DrainS           float64          `json:"drain_s"`
	EventsPerS       float64          `json:"events_per_s"`
	Rows             map[string]int64 `json:"rows"`
	RowsTotal        int64            `json:"rows_total"`
	RowsPerS         float64          `json:"rows_per_s"`
	InvocationStatus map[string]int64 `json:"invocations_by_status"`
	DeadLetters      uint64           `json:"dead_letters"`
}

// check is one figure compared with its target.
type check struct {
	Name   string  `json:"name"`
	Value  float64 `json:"value"`
	Unit   string  `json:"unit"`
	Target string  `json:"target"`
	Pass   bool    `json:"pass"`
	Note   string  `json:"note,omitempty"`
}

func (c check) verdict() string {
	if c.Pass {
		return "PASS"
	}
	return "FAIL"
}

func atLeast(name string, v, target float64, unit, note string) check {
	return check{Name: name, Value: roundFigure(v, 1), Unit: unit, Target: fmt.Sprintf(">= %s", num(target)), Pass: v >= target, Note: note}
}

func atMost(name string, v, target float64, unit, note string) check {
	return check{Name: name, Value: roundFigure(v, 2), Unit: unit, Target: fmt.Sprintf("<= %s", num(target)), Pass: v <= target, Note: note}
}

// exactly is a check that v is target: a count that must come out even.
func exactly(name string, v, target float64, unit, note string) check {
	return check{Name: name, Value: v, Unit: unit, Target: fmt.Sprintf("= %s", num(target)), Pass: v == target, Note: note}
}

func below(name string, v, target float64, unit, note string) check {
	return check{Name: name, Value: roundFigure(v, 2), Unit: unit, Target: fmt.Sprintf("< %s", num(target)), Pass: v < target, Note: note}
}

// roundFigure rounds v to digits decimals, or to 3 significant digits
// when it is below 1 (CPU-s per second of an idle process, CPU-s per
// 1,000 events), so that a value near a small target does not print as 0.
func roundFigure(v float64, digits int) float64 {
	if a := math.Abs(v); a > 0 && a < 1 {
		return round(v, max(digits, 2-int(math.Floor(math.Log10(a)))))
	}
	return round(v, digits)
}

// summary is summary.json.
type summary struct {
	Started   time.Time         `json:"started"`
	Finished  time.Time         `json:"finished"`
	DurationS float64           `json:"duration_s"`
	Command   string            `json:"command"`
	Machine   machineInfo       `json:"machine"`
	Fixtures  fixtureInfo       `json:"fixtures"`
	Scenarios []scenarioSummary `json:"scenarios"`
	Checks    []check           `json:"checks"`
	Passed    int               `json:"passed"`
	Failed    int               `json:"failed"`
}

type scenarioSummary struct {
	Scenario string `json:"scenario"`
	File     string `json:"file"`
	Error    string `json:"error,omitempty"`
	Skipped  string `json:"skipped,omitempty"`
}

type fixtureInfo struct {
	Files        []string `json:"files"`
	Builds       int      `json:"builds"`
	Skipped      []string `json:"skipped,omitempty"`
	EventsMin    int      `json:"events_per_build_min"`
	EventsMax    int      `json:"events_per_build_max"`
	EventsMean   float64  `json:"events_per_build_mean"`
	BytesPerTool float64  `json:"bytes_per_tool_event_mean"`
}

type machineInfo struct {
	NProc      int    `json:"nproc"`
	CPUModel   string `json:"cpu_model"`
	MemTotal   string `json:"mem_total"`
	Kernel     string `json:"kernel"`
	GoVersion  string `json:"go_version"`
	Date       string `json:"date"`
	GitCommit  string `json:"git_commit"`
	GitDirty   bool   `json:"git_dirty"`
	Millrace   string `json:"millrace_version"`
	Postgres   string `json:"postgres"`
	PGURL      string `json:"postgres_url"`
	PGPrivate  bool   `json:"postgres_private_cluster"`
	PGLocal    bool   `json:"postgres_processes_visible"`
	Loadavg    string `json:"loadavg_at_start"`
	NoFileSoft uint64 `json:"rlimit_nofile"`
}

func collectMachine(ctx context.Context, bin string, pg *pgServer, nofile uint64) machineInfo {
	m := machineInfo{
		NProc:      runtime.NumCPU(),
		GoVersion:  runtime.Version(),
		Date:       time.Now().UTC().Format(time.RFC3339),
		Kernel:     strings.TrimSpace(readFile("/proc/sys/kernel/osrelease")),
		Loadavg:    strings.TrimSpace(readFile("/proc/loadavg")),
		NoFileSoft: nofile,
	}
	m.CPUModel = procField("/proc/cpuinfo", "model name")
	m.MemTotal = procField("/proc/meminfo", "MemTotal")
	if out, err := exec.CommandContext(ctx, "git", "rev-parse", "HEAD").Output(); err == nil {
		m.GitCommit = strings.TrimSpace(string(out))
	}
	if out, err := exec.CommandContext(ctx, "git", "status", "--porcelain").Output(); err == nil {
		m.GitDirty = len(strings.TrimSpace(string(out))) > 0
	}
	if out, err := exec.CommandContext(ctx, bin, "version").Output(); err == nil {
		m.Millrace = strings.TrimSpace(string(out))
	}
	if pg != nil {
		m.Postgres = pg.version
		m.PGURL = redact(pg.srv.URL)
		m.PGPrivate = pg.srv.Private
		m.PGLocal = pg.local
	}
	return m
}

func readFile(path string) string {
	b, _ := os.ReadFile(path)
	return string(b)
}

func procField(path, key string) string {
	f, err := os.Open(path)
	if err != nil {
		return ""
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if ok && strings.TrimSpace(k) == key {
			return strings.Join(strings.Fields(v), " ")
		}
	}
	return ""
}

func writeJSON(path string, v any) error {
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, append(b, '\n'), 0o644)
}

// printTable writes the runs as a table a person can read.
func printTable(w io.Writer, reports []*scenarioReport) {
	fmt.Fprintf(w, "\n%-16s %-24s %9s %9s %8s %8s %8s %8s %8s %8s %7s\n",
		"scenario", "run", "events", "events/s", "edge", "natsd", "proj", "pg", "ack p50", "ack p99", "errors")
	fmt.Fprintf(w, "%-16s %-24s %9s %9s %8s %8s %8s %8s %8s %8s %7s\n",
		"", "", "", "", "CPU/100k", "CPU/100k", "CPU/100k", "CPU/100k", "ms", "ms", "")
	for _, r := range reports {
		for _, run := range r.Runs {
			if run.Mode == "idle" {
				printIdleRow(w, r.Scenario, run)
				continue
			}
			cpu := func(k string) string {
				if f, ok := run.CPU[k]; ok {
					return fmt.Sprintf("%.2f", f.Per100kEvents)
				}
				return "-"
			}
			pg := "-"
			if _, ok := run.CPU["postgres_attributed"]; ok {
				pg = cpu("postgres_attributed")
			}
			p50, p99 := "-", "-"
			if run.AckLatency != nil && run.AckLatency.Count > 0 {
				p50, p99 = fmt.Sprintf("%.2f", run.AckLatency.P50MS), fmt.Sprintf("%.2f", run.AckLatency.P99MS)
			}
			var errs int64
			for _, n := range run.Errors {
				errs += n
			}
			nats := cpu("natsd")
			if nats == "-" && run.NATS == natsEmbedded {
				nats = "(in edge)"
			}
			fmt.Fprintf(w, "%-16s %-24s %9d %9.0f %8s %8s %8s %8s %8s %8s %7d\n",
				r.Scenario, run.Name, run.WindowEvents, run.EventsPerS, cpu("edge"), nats, cpu("projector"), pg, p50, p99, errs)
			if run.Lag != nil {
				fmt.Fprintf(w, "%-16s %-24s projection lag p50 %.0f ms, p99 %.0f ms over %d invocations (%d not projected)\n",
					"", "", run.Lag.Lag.P50MS, run.Lag.Lag.P99MS, run.Lag.Measured, run.Lag.NotProjected)
			}
			if m := run.Memory; m != nil {
				fmt.Fprintf(w, "%-16s %-24s edge RSS %d KiB at the peak, %d KiB baseline: %.1f KiB per open stream (%d open at most)\n",
					"", "", m.PeakRSSKiB, m.BaselineRSSKiB, m.PerStreamKiB, m.OpenStreamsMax)
			}
			if br := run.Bazel; br != nil {
				fmt.Fprintf(w, "%-16s %-24s CPU-s per 1,000 events: dev %.3f (%.3f less idle), PostgreSQL %.3f (%.3f less idle), bazel %.1f\n",
					"", "", br.DevPer1k, br.DevPer1kLessIdle, br.PostgresPer1k, br.PostgresPer1kLessIdle, br.BazelPer1k)
			}
			if d := run.Drain; d != nil {
				fmt.Fprintf(w, "%-16s %-24s drained %d messages in %.1f s (%.0f events/s), %d rows (%.0f rows/s)",
					"", "", d.StreamMessages, d.DrainS, d.EventsPerS, d.RowsTotal, d.RowsPerS)
				if run.Postgres != nil {
					fmt.Fprintf(w, ", WAL %.0f B/event", run.Postgres.WALPerEvent)
				}
				fmt.Fprintln(w)
			}
		}
	}
}

// printIdleRow: an idle run's figures are per second, not per event.
func printIdleRow(w io.Writer, scenario string, run runReport) {
	fmt.Fprintf(w, "%-16s %-24s", scenario, run.Name)
	for _, k := range slices.Sorted(maps.Keys(run.CPU)) {
		if f := run.CPU[k]; k != "bench_client" {
			fmt.Fprintf(w, " %s %s CPU-s/s", k, num(f.Cores))
			if f.CtxSwitchesPerS > 0 {
				fmt.Fprintf(w, " (%.0f switches/s)", f.CtxSwitchesPerS)
			}
			fmt.Fprint(w, ";")
		}
	}
	fmt.Fprintln(w)
}

func printChecks(w io.Writer, checks []check) {
	fmt.Fprintf(w, "\n%-4s  %-72s %14s  %s\n", "", "target", "value", "goal")
	for _, c := range checks {
		fmt.Fprintf(w, "%-4s  %-72s %14s  %s %s\n", c.verdict(), c.Name, num(c.Value), c.Target, c.Unit)
		if c.Note != "" {
			fmt.Fprintf(w, "      (%s)\n", c.Note)
		}
	}
}

func round(v float64, digits int) float64 {
	p := math.Pow(10, float64(digits))
	return math.Round(v*p) / p
}

func num(v float64) string {
	if a := math.Abs(v); a > 0 && a < 0.1 {
		return fmt.Sprintf("%.3g", v)
	}
	if v == math.Trunc(v) && math.Abs(v) >= 1000 {
		s := fmt.Sprintf("%.0f", v)
		var b strings.Builder
		for i, c := range s {
			if i > 0 && (len(s)-i)%3 == 0 && s[i-1] != '-' {
				b.WriteByte(',')
			}
			b.WriteRune(c)
		}
		return b.String()
	}
	if math.Abs(v) >= 100 {
		return fmt.Sprintf("%.0f", v)
	}
	return fmt.Sprintf("%.2f", v)
}

func summaryPtr(h *replay.Histogram) *replay.Summary {
	s := h.Summary()
	return &s
}

// redact hides a password in a database URL.
func redact(u string) string {
	if i := strings.Index(u, "://"); i >= 0 {
		if at := strings.Index(u[i+3:], "@"); at >= 0 {
			cred := u[i+3 : i+3+at]
			if user, _, ok := strings.Cut(cred, ":"); ok {
				return u[:i+3] + user + ":***" + u[i+3+at:]
			}
		}
	}
	return u
}

func sanitize(s string) string {
	var b strings.Builder
	for _, c := range strings.ToLower(s) {
		if c >= 'a' && c <= 'z' || c >= '0' && c <= '9' {
			b.WriteRune(c)
		} else {
			b.WriteByte('_')
		}
	}
	return b.String()
}
