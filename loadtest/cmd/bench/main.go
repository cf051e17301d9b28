// Command bench is millrace's load test (`make bench`): it replays recorded
// Bazel build events (loadtest/fixtures/*.besrec) against the real binary
// (bin/millrace) in several scenarios, each on fresh state, measures
// throughput, latency and the CPU each process spends per event, and writes
// one JSON report per scenario and a summary to -out. Everything listens on
// 127.0.0.1 and every run stops by itself. See loadtest/README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Scenario names, in the order they run.
const (
	scEdgeEmbedded  = "edge-embedded"
	scEdgeNATSApart = "edge-nats-apart"
	scProjector     = "projector"
	scProjectorLive = "projector-live"
	scPaced1000     = "paced-1000"
	scPaced5000     = "paced-5000"
	// scPaced1000Apart is paced-1000 with JetStream in its own process.
	scPaced1000Apart = "paced-1000-nats-apart"
)

var allScenarios = append(append(append([]string{scEdgeEmbedded, scEdgeNATSApart, scProjector, scProjectorLive, scGRPCFloor, scPaced1000, scPaced1000Apart, scPaced5000,
	scEdgeMemory, scIdle, scBazelReal, scStorage}, fleetScenarios...), commitsScenarios...), scKafkaExport, scEdgeRedaction, scMillionEvents, scConsolePages, scEdgesRolling, scPartitionLayout, scProjectorsPartitioned)

type config struct {
	out, bin, natsd, fixtures, tmp, pgDir string
	scenarios                             map[string]bool

	events   int64 // flat out: events per run
	streams  []int // flat out: concurrent streams per run
	natsSync string

	pacedStreams int
	pacedRate    float64
	duration     time.Duration // paced-1000 measured window
	warmup       time.Duration
	warmupPhase  float64

	paced5000 paced5000Config

	liveStreams  int
	liveRate     float64
	liveDuration time.Duration
	liveWarmup   time.Duration

	buildsBatch   int           // projector: events per transaction (0: the binary's default)
	buildsMaxWait time.Duration // projector: fetch wait (0: the binary's default)

	quietWait time.Duration // paced runs: how long to wait for the machine to calm down first

	lagPoll, lagTimeout, drainTimeout time.Duration
	keep                              bool

	fleet       fleetConfig
	commits     commitsConfig
	kafka       kafkaConfig
	redaction   redactionConfig
	memory      memoryConfig
	idle        idleConfig
	bazel       bazelConfig
	storage     storageConfig
	ab          abConfig
	million     millionConfig
	rolling     rollingConfig
	partition   partitionConfig
	partitioned partitionedConfig
}

func main() {
	var c config
	var scenarios, streams string
	flag.StringVar(&c.out, "out", "loadtest/results", "directory for the JSON reports")
	flag.StringVar(&c.bin, "bin", "bin/millrace", "the millrace binary to run (make build); in A/B mode -a and -b name the two instead")
	flag.StringVar(&c.natsd, "natsd", "", "natsd binary; empty: build ./loadtest/cmd/natsd")
	flag.StringVar(&c.fixtures, "fixtures", "loadtest/fixtures/*.besrec", "recordings to replay (glob)")
	flag.StringVar(&c.tmp, "tmp", os.TempDir(), "where the scenarios' state (file stores, logs) goes")
	flag.StringVar(&c.pgDir, "pg-dir", "var/pg", "private PostgreSQL cluster, used only when DATABASE_URL is unset and 127.0.0.1:5432 does not answer")
	flag.StringVar(&scenarios, "scenarios", strings.Join(allScenarios, ","), "scenarios to run, comma-separated: "+strings.Join(allScenarios, ", "))
	flag.Int64Var(&c.events, "events", 200_000, "flat-out runs: events to replay per run")
	flag.StringVar(&streams, "streams", "8,64", "flat-out runs: concurrent streams, one run per number")
	flag.StringVar(&c.natsSync, "nats-sync", "1s", `JetStream fsync interval ("always" fsyncs every write)`)
	flag.IntVar(&c.pacedStreams, "paced-streams", 1000, "paced-1000: concurrent streams")
	flag.Float64Var(&c.pacedRate, "paced-rate", 2500, "paced-1000: total events/s over all streams")
	flag.DurationVar(&c.duration, "duration", 60*time.Second, "paced-1000: measured time after the warm-up")
	flag.DurationVar(&c.warmup, "warmup", 20*time.Second, "paced-1000: warm-up that spreads the invocations over their lives")
	flag.Float64Var(&c.warmupPhase, "warmup-phase", 0.5, "paced runs: each stream's first invocation starts at a random point within this fraction of its build, sent during the warm-up")
	flag.IntVar(&c.liveStreams, "live-streams", 64, "projector-live: concurrent streams")
	flag.Float64Var(&c.liveRate, "live-rate", 5000, "projector-live: total events/s")
	flag.DurationVar(&c.liveDuration, "live-duration", 30*time.Second, "projector-live: measured time after the warm-up")
	flag.DurationVar(&c.liveWarmup, "live-warmup", 10*time.Second, "projector-live: warm-up")
	flag.IntVar(&c.buildsBatch, "builds-batch", 0, "projector: MILLRACE_BUILDS_BATCH (0: the binary's default)")
	flag.DurationVar(&c.buildsMaxWait, "builds-max-wait", 0, "projector: MILLRACE_BUILDS_MAX_WAIT (0: the binary's default)")
	flag.DurationVar(&c.quietWait, "quiet-wait", time.Minute, "paced runs: wait up to this long for other work on the machine to fall below a quarter of a core (latency is not the system's own otherwise)")
	flag.DurationVar(&c.lagPoll, "lag-poll", 50*time.Millisecond, "how often projection lag is polled")
	flag.DurationVar(&c.lagTimeout, "lag-timeout", 60*time.Second, "how long to wait for the last invocations to be projected")
	flag.DurationVar(&c.drainTimeout, "drain-timeout", 5*time.Minute, "projector: longest drain before giving up")
	flag.BoolVar(&c.keep, "keep", false, "keep the scenarios' state, logs and the databases of the scenarios that run `millrace dev`")
	c.fleet.register(flag.CommandLine)
	c.commits.register(flag.CommandLine)
	c.kafka.register(flag.CommandLine)
	c.redaction.register(flag.CommandLine)
	c.paced5000.register(flag.CommandLine)
	c.memory.register(flag.CommandLine)
	c.idle.register(flag.CommandLine)
	c.bazel.register(flag.CommandLine)
	c.storage.register(flag.CommandLine)
	c.ab.register(flag.CommandLine)
	c.million.register(flag.CommandLine)
	c.rolling.register(flag.CommandLine)
	c.partition.register(flag.CommandLine)
	c.partitioned.register(flag.CommandLine)
	flag.Parse()
	if err := c.parseLists(scenarios, streams); err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		os.Exit(2)
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, c)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "bench: %v\n", err)
		os.Exit(1)
	}
}

// parseLists reads the comma-separated flags and checks the A/B flags.
func (c *config) parseLists(scenarios, streams string) error {
	c.scenarios = map[string]bool{}
	for _, s := range strings.Split(scenarios, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		if !contains(allScenarios, s) {
			return fmt.Errorf("unknown scenario %q (want %s)", s, strings.Join(allScenarios, ", "))
		}
		c.scenarios[s] = true
	}
	for _, s := range strings.Split(streams, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n <= 0 {
			return fmt.Errorf("-streams %q: want positive numbers, comma-separated", streams)
		}
		c.streams = append(c.streams, n)
	}
	if err := errors.Join(c.checkNegatives(), c.paced5000.validate(), c.memory.validate(), c.idle.validate(), c.bazel.validate(), c.storage.validate(), c.rolling.validate(), c.partition.validate(), c.partitioned.validate()); err != nil {
		return err
	}
	return c.ab.validate(c.bin)
}

// checkNegatives refuses, at start, a negative count, rate or duration of
// the shared flags, and a warm-up phase that is not a fraction: a scenario
// would otherwise fail minutes into the run.
func (c *config) checkNegatives() error {
	var errs []error
	for name, v := range map[string]float64{
		"events": float64(c.events), "paced-streams": float64(c.pacedStreams), "paced-rate": c.pacedRate,
		"live-streams": float64(c.liveStreams), "live-rate": c.liveRate, "builds-batch": float64(c.buildsBatch),
		"duration": c.duration.Seconds(), "warmup": c.warmup.Seconds(), "live-duration": c.liveDuration.Seconds(),
		"live-warmup": c.liveWarmup.Seconds(), "builds-max-wait": c.buildsMaxWait.Seconds(),
	} {
		if v < 0 {
			errs = append(errs, fmt.Errorf("-%s is negative", name))
		}
	}
	if c.warmupPhase < 0 || c.warmupPhase > 1 {
		errs = append(errs, fmt.Errorf("-warmup-phase %v: want a fraction of the build, 0..1 (0: all of it)", c.warmupPhase))
	}
	return errors.Join(errs...)
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

func run(ctx context.Context, c config) error {
	started := time.Now()
	b, cleanup, err := setup(ctx, c)
	if err != nil {
		return err
	}
	defer cleanup()
	if c.ab.on() {
		return b.runAB(ctx, started)
	}
	return b.runAll(ctx, started)
}

// setup checks the binaries and opens what every scenario shares: the
// fixtures, a state directory, natsd, PostgreSQL. cleanup undoes it.
func setup(ctx context.Context, c config) (b *bench, cleanup func(), err error) {
	bins := []*string{&c.bin}
	if c.ab.on() {
		bins = []*string{&c.ab.a, &c.ab.b}
	}
	for _, p := range bins {
		if *p, err = resolveBinary(*p); err != nil {
			return nil, nil, err
		}
	}
	if c.ab.on() {
		c.bin = c.ab.b
	}
	nofile := raiseNoFile()

	b = &bench{cfg: c}
	if err := b.loadFixtures(); err != nil {
		return nil, nil, err
	}
	if b.tmp, err = mkdir(c.tmp, "millrace-bench"); err != nil {
		return nil, nil, err
	}
	removeTmp := func() {
		if !c.keep {
			os.RemoveAll(b.tmp)
		} else {
			fmt.Printf("bench: state and logs kept in %s\n", b.tmp)
		}
	}
	if b.natsd = c.natsd; b.natsd == "" && (c.scenarios[scEdgeNATSApart] || c.scenarios[scEdgeRedaction] || c.scenarios[scEdgeMemory] || c.scenarios[scProjector] || c.scenarios[scMillionEvents] || c.scenarios[scEdgesRolling] || c.scenarios[scPartitionLayout] || c.scenarios[scProjectorsPartitioned] || c.scenarios[scPaced1000Apart] || anyOf(c.scenarios, commitsScenarios)) {
		if b.natsd, err = buildNATSD(ctx, b.tmp); err != nil {
			removeTmp()
			return nil, nil, err
		}
	}
	if c.scenarios[scGRPCFloor] || c.scenarios[scBazelReal] {
		if b.floor, err = buildFloor(ctx, b.tmp); err != nil {
			removeTmp()
			return nil, nil, err
		}
	}
	if b.pg, err = openPG(ctx, c.pgDir); err != nil {
		removeTmp()
		return nil, nil, fmt.Errorf("PostgreSQL: %w", err)
	}
	b.machine = collectMachine(ctx, c.bin, b.pg, nofile)
	fmt.Printf("bench: %d builds from %d fixture files (%d-%d events each); %s; PostgreSQL at %s; %d CPUs\n",
		b.fixtureInfo.Builds, len(b.fixtureInfo.Files), b.fixtureInfo.EventsMin, b.fixtureInfo.EventsMax,
		b.machine.GoVersion, b.machine.PGURL, b.machine.NProc)
	return b, func() { b.releaseKept(); b.pg.close(); removeTmp() }, nil
}

// resolveBinary makes path absolute, after checking it is there.
func resolveBinary(path string) (string, error) {
	if _, err := os.Stat(path); err != nil {
		return "", fmt.Errorf("%s: %w (run `make build` first)", path, err)
	}
	if abs, err := filepath.Abs(path); err == nil {
		return abs, nil
	}
	return path, nil
}

// runAll runs each selected scenario once against -bin: `make bench`.
func (b *bench) runAll(ctx context.Context, started time.Time) error {
	c := b.cfg
	sum := summary{Started: started, Command: strings.Join(os.Args, " "), Machine: b.machine, Fixtures: b.fixtureInfo}
	for _, name := range allScenarios {
		if !c.scenarios[name] {
			continue
		}
		if ctx.Err() != nil {
			break
		}
		fmt.Printf("\n=== %s\n", name)
		rep := b.runScenario(ctx, name)
		file := filepath.Join(c.out, name+".json")
		if err := writeJSON(file, rep); err != nil {
			return err
		}
		b.reports = append(b.reports, rep)
		sum.Scenarios = append(sum.Scenarios, scenarioSummary{Scenario: name, File: filepath.Base(file), Error: rep.Error, Skipped: rep.Skipped})
		sum.Checks = append(sum.Checks, rep.Checks...)
		if rep.Error != "" {
			fmt.Printf("bench: %s failed: %s\n", name, rep.Error)
		}
		if rep.Skipped != "" {
			fmt.Printf("bench: %s skipped: %s\n", name, rep.Skipped)
		}
	}
	sum.Finished = time.Now()
	sum.DurationS = round(sum.Finished.Sub(started).Seconds(), 1)
	for _, ch := range sum.Checks {
		if ch.Pass {
			sum.Passed++
		} else {
			sum.Failed++
		}
	}
	if err := writeJSON(filepath.Join(c.out, "summary.json"), sum); err != nil {
		return err
	}
	printTable(os.Stdout, b.reports)
	printChecks(os.Stdout, sum.Checks)
	fmt.Printf("\nbench: %d passed, %d failed in %.0f s; reports in %s\n", sum.Passed, sum.Failed, sum.DurationS, c.out)
	if ctx.Err() != nil {
		return ctx.Err()
	}
	for _, s := range sum.Scenarios {
		if s.Error != "" {
			return fmt.Errorf("scenario %s: %s", s.Scenario, s.Error)
		}
	}
	return nil
}

// raiseNoFile lifts the soft file-descriptor limit to the hard one: a
// thousand streams on their own connections need a few thousand
// descriptors here and in the edge (which inherits the limit).
func raiseNoFile() uint64 {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0
	}
	if lim.Cur < lim.Max {
		lim.Cur = lim.Max
		syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim)
		syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
	}
	return lim.Cur
}
