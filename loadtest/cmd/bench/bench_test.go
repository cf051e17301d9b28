package main

import (
	"fmt"
	"os"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/loadtest/replay"
)

func TestParseStat(t *testing.T) {
	// comm may hold spaces and parentheses; fields count from the last ')'.
	line := "4242 (post gres) (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1234 567 89 10 20 0 1 0 100 0 0\n"
	got, err := parseStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if got.comm != "post gres) (x)" || got.ppid != 1 || got.utime != 1234 || got.stime != 567 || got.cutime != 89 || got.cstime != 10 {
		t.Fatalf("parsed %+v", got)
	}
	self, err := readCPU(os.Getpid())
	if err != nil || self.comm == "" {
		t.Fatalf("own /proc stat: %+v, %v", self, err)
	}
}

func TestPromQuantile(t *testing.T) {
	s := promSample{
		`h_bucket{le="0.001"}`: 50,
		`h_bucket{le="0.002"}`: 98,
		`h_bucket{le="0.004"}`: 100,
		`h_bucket{le="+Inf"}`:  100,
		`c{step="a"}`:          3,
		`c{step="b"}`:          4,
	}
	if q := s.quantileMS("h", 0.5); q != 1 {
		t.Errorf("p50 = %v ms, want 1", q)
	}
	if q := s.quantileMS("h", 0.99); q != 4 {
		t.Errorf("p99 = %v ms, want 4", q)
	}
	if n := s.sum("c", `step="b"`); n != 4 {
		t.Errorf("sum = %v, want 4", n)
	}
}

func TestParseMemStatus(t *testing.T) {
	status := "Name:\tmillrace\nVmPeak:\t 2000000 kB\nVmHWM:\t  197680 kB\nVmRSS:\t   80848 kB\nThreads:\t12\n"
	m, err := parseMemStatus([]byte(status))
	if err != nil {
		t.Fatal(err)
	}
	if m.rss != 80848 || m.hwm != 197680 {
		t.Errorf("parsed %+v, want rss 80848 hwm 197680", m)
	}
	// A kernel thread has neither line.
	if _, err := parseMemStatus([]byte("Name:\tkthreadd\nThreads:\t1\n")); err == nil {
		t.Error("no VmRSS: no error")
	}
	self, err := readMemStatus(os.Getpid())
	if err != nil || self.rss <= 0 || self.hwm < self.rss {
		t.Fatalf("own /proc status: %+v, %v", self, err)
	}
}

func TestResetHWM(t *testing.T) {
	// The peak of this process falls to its resident set now once reset:
	// allocate and touch memory, free it, reset.
	b := make([]byte, 64<<20)
	for i := range b {
		b[i] = 1
	}
	before, err := readMemStatus(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	b = nil
	debug.FreeOSMemory()
	if err := resetHWM(os.Getpid()); err != nil {
		t.Skipf("clear_refs refused here: %v", err)
	}
	after, err := readMemStatus(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	if after.hwm >= before.hwm {
		t.Errorf("VmHWM %d KiB after the reset, %d before it: not reset", after.hwm, before.hwm)
	}
}

func TestRSSPerStream(t *testing.T) {
	// (peak - baseline) / streams, in KiB.
	if got := rssPerStreamKiB(80_000+64*1000, 80_000, 1000); got != 64 {
		t.Errorf("64 MiB over 1,000 streams: %v KiB per stream, want 64", got)
	}
	if got := rssPerStreamKiB(100_000, 90_000, 3); got != 3333.33 {
		t.Errorf("10,000 KiB over 3: %v, want 3333.33", got)
	}
	if got := rssPerStreamKiB(100, 50, 0); got != 0 {
		t.Errorf("no streams: %v, want 0", got)
	}
}

func TestLessIdle(t *testing.T) {
	// 3 CPU-s over a 100 s window of a process idling at 0.01 CPU-s/s:
	// 2 CPU-s were the builds'; per 1,000 of 10,000 events, 0.2.
	if got := lessIdle(3, 0.01, 100); !near(got, 2) {
		t.Errorf("lessIdle(3, 0.01, 100) = %v, want 2", got)
	}
	if got := cpuPer1kEvents(lessIdle(3, 0.01, 100), 10_000); !near(got, 0.2) {
		t.Errorf("per 1,000 events: %v, want 0.2", got)
	}
	if got := cpuPer1kEvents(1, 0); got != 0 {
		t.Errorf("no events: %v, want 0", got)
	}
	br := &bazelReport{Events: 10_000, WindowS: 100}
	run := runReport{CPU: map[string]cpuFigure{"dev": {CPUSeconds: 3}, "postgres_all": {CPUSeconds: 1.5}, "postgres_attributed": {CPUSeconds: 1}},
		Postgres: &pgReport{}}
	idle := runReport{WindowS: 30, CPU: map[string]cpuFigure{"dev": {Cores: 0.01}, "postgres_all": {Cores: 0.005}, "postgres_attributed": {Cores: 0.002}},
		Postgres: &pgReport{}}
	br.fill(run, idle, 40*time.Second)
	if !near(br.DevPer1k, 0.3) || !near(br.DevPer1kLessIdle, 0.2) || !near(br.PostgresPer1k, 0.15) ||
		!near(br.PostgresPer1kLessIdle, 0.1) || !near(br.BazelPer1k, 4) {
		t.Errorf("unshared server: %+v", br)
	}
	// A shared server: PostgreSQL's figures are the attributed ones.
	run.Postgres.Shared, idle.Postgres.Shared = true, true
	br.fill(run, idle, 40*time.Second)
	if !near(br.PostgresPer1k, 0.1) || !near(br.PostgresPer1kLessIdle, 0.08) {
		t.Errorf("shared server: %+v", br)
	}
}

func TestRoundFigure(t *testing.T) {
	for _, c := range []struct{ v, want float64 }{
		{0.0031234, 0.00312}, {0.04567, 0.0457}, {0.4567, 0.457}, {210.456, 210.46}, {0, 0}, {-0.0031234, -0.00312},
	} {
		if got := roundFigure(c.v, 2); got != c.want {
			t.Errorf("roundFigure(%v, 2) = %v, want %v", c.v, got, c.want)
		}
	}
	// An idle process's 0.0031 CPU-s/s is above a 0.003 target, and says so.
	c := atMost("idle", 0.0031, 0.003, "CPU-s/s", "")
	if c.Pass || c.Value != 0.0031 || num(c.Value) != "0.0031" || c.Target != "<= 0.003" {
		t.Errorf("check %+v (value prints as %s)", c, num(c.Value))
	}
}

func TestLagCheck(t *testing.T) {
	ok := &lagReport{Measured: 500, Lag: replay.Summary{P99MS: 450}}
	if c := lagCheck("lag", ok); !c.Pass || c.Value != 0.45 || c.Unit != "s" {
		t.Errorf("p99 450 ms: %+v", c)
	}
	if c := lagCheck("lag", &lagReport{Measured: 500, Lag: replay.Summary{P99MS: 1000}}); c.Pass {
		t.Errorf("p99 1 s is not under 1 s: %+v", c)
	}
	// Nothing measured is no pass.
	if c := lagCheck("lag", &lagReport{}); c.Pass {
		t.Errorf("no invocation measured: %+v", c)
	}
	if c := lagCheck("lag", nil); c.Pass {
		t.Errorf("no lag report: %+v", c)
	}
	// More than 1 % never seen projected fails the p99.
	if c := lagCheck("lag", &lagReport{Measured: 98, NotProjected: 2, Lag: replay.Summary{P99MS: 100}}); c.Pass {
		t.Errorf("2 %% not projected: %+v", c)
	}
	if c := lagCheck("lag", &lagReport{Measured: 999, NotProjected: 1, Lag: replay.Summary{P99MS: 100}}); !c.Pass {
		t.Errorf("0.1 %% not projected: %+v", c)
	}
}

func TestEdgeLimitsEnv(t *testing.T) {
	if env := edgeLimitsEnv(64); len(env) != 0 {
		t.Errorf("64 streams: %v, want the defaults", env)
	}
	if env := strings.Join(edgeLimitsEnv(1000), " "); env != "MILLRACE_BES_MAX_PENDING_PER_ADDR=1000" {
		t.Errorf("1,000 streams: %s", env)
	}
	if env := strings.Join(edgeLimitsEnv(5000), " "); env != "MILLRACE_BES_MAX_STREAMS=6250 MILLRACE_BES_MAX_PENDING_PER_ADDR=5000" {
		t.Errorf("5,000 streams: %s", env)
	}
}

func TestNewFlagsRefuseNegatives(t *testing.T) {
	m := memoryConfig{streamsList: "1000,5000", rate: 2500}
	if err := m.validate(); err != nil || len(m.streams) != 2 || m.streams[1] != 5000 || m.sample != time.Second {
		t.Errorf("defaults: %+v, %v", m, err)
	}
	for _, bad := range []memoryConfig{{streamsList: "1000,x"}, {streamsList: "0"}, {streamsList: "10", rate: -1}, {streamsList: "10", settle: -time.Second}} {
		if err := bad.validate(); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
	if err := (&idleConfig{window: -time.Second}).validate(); err == nil || !strings.Contains(err.Error(), "-idle-window") {
		t.Errorf("negative -idle-window: %v", err)
	}
	if err := (&bazelConfig{builds: -1}).validate(); err == nil || !strings.Contains(err.Error(), "-bazel-builds") {
		t.Errorf("negative -bazel-builds: %v", err)
	}
	if err := (&paced5000Config{warmupPhase: 1.5}).validate(); err == nil {
		t.Error("-paced-5000-warmup-phase 1.5: no error")
	}
	st := storageConfig{targets: "50, 500"}
	if err := st.validate(); err != nil || len(st.sizes) != 2 || st.sizes[1] != 500 || st.builds != 100 || st.warmup != 20 {
		t.Errorf("storage defaults: %+v, %v", st, err)
	}
	for _, bad := range []storageConfig{{targets: "50,x"}, {targets: "0"}, {targets: "50", builds: -1}, {targets: "50", warmup: -2}} {
		if err := bad.validate(); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
}

func TestPartitionedConfig(t *testing.T) {
	ok := partitionedConfig{partitions: 4, instances: "1, 2,4", rounds: 1}
	if n, err := ok.counts(); err != nil || fmt.Sprint(n) != "[1 2 4]" || ok.validate() != nil {
		t.Errorf("counts %v, %v, %v", n, err, ok.validate())
	}
	for _, bad := range []partitionedConfig{
		{partitions: 4, instances: "1,5", rounds: 1}, // more instances than partitions: one would idle
		{partitions: 4, instances: "0", rounds: 1},
		{partitions: 1, instances: "1", rounds: 1},
		{partitions: 4, instances: "1", rounds: 0},
		{partitions: 4, instances: "1", rounds: 1, events: -1},
	} {
		if err := bad.validate(); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
	m := medianFigures(2, []partitionedFigures{{DrainEventsPerS: 10, DrainProjectorCPUPer100k: 3}, {DrainEventsPerS: 30, DrainProjectorCPUPer100k: 1}, {DrainEventsPerS: 20, DrainProjectorCPUPer100k: 2}})
	if m.Instances != 2 || m.DrainEventsPerS != 20 || m.DrainProjectorCPUPer100k != 2 {
		t.Errorf("medians %+v", m)
	}
}
