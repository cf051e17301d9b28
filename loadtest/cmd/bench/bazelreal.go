package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/loadtest/bazelws"
)

// The real-Bazel scenario: full `bazel test //...` builds of a generated
// workspace (loadtest/bazelws) against `millrace dev`, and what they cost
// dev and PostgreSQL per 1,000 events stored. Bazel's own CPU (its JVM and
// the actions) is a separate process: reported, not counted.
const scBazelReal = "bazel-real"

// bazelTargetCPUSPer1k is the most CPU dev may spend per 1,000 events of
// real builds, over the whole window.
const bazelTargetCPUSPer1k = 0.08

// bazelConfig sizes bazel-real (flags of the bench).
type bazelConfig struct {
	targets    int
	builds     int
	idleWindow time.Duration
	timeout    time.Duration
	// floorBuilds run after dev's against besfloor (grpc-floor's server):
	// what gRPC alone spends on the same builds.
	floorBuilds int
}

func (c *bazelConfig) register(fs *flag.FlagSet) {
	fs.IntVar(&c.targets, "bazel-targets", 500, "bazel-real: targets of the generated workspace (loadtest/bazelws; 500 make 4,126 events per build here)")
	fs.IntVar(&c.builds, "bazel-builds", 3, "bazel-real: full `bazel test //...` builds, each from a fresh output base")
	fs.DurationVar(&c.idleWindow, "bazel-idle-window", 30*time.Second, "bazel-real: the same dev's idle CPU is measured this long just before the builds (the \"less idle\" figures subtract it)")
	fs.DurationVar(&c.timeout, "bazel-timeout", 10*time.Minute, "bazel-real: longest one build may take")
	fs.IntVar(&c.floorBuilds, "bazel-floor-builds", 1, "bazel-real: builds run afterwards against besfloor (a server that only acks, as grpc-floor's), whose CPU per 1,000 events is the floor under dev's")
}

func (c *bazelConfig) validate() error {
	errs := negatives(map[string]float64{"bazel-targets": float64(c.targets), "bazel-builds": float64(c.builds),
		"bazel-idle-window": c.idleWindow.Seconds(), "bazel-timeout": c.timeout.Seconds(), "bazel-floor-builds": float64(c.floorBuilds)})
	if c.floorBuilds == 0 {
		c.floorBuilds = 1
	}
	if c.builds == 0 {
		c.builds = 3
	}
	if c.idleWindow == 0 {
		c.idleWindow = 30 * time.Second
	}
	if c.timeout == 0 {
		c.timeout = 10 * time.Minute
	}
	return errors.Join(errs...)
}

// bazelReport is bazel-real's figures. The window runs from the first
// build's start to the moment the projector has applied the last build's
// last event; "less idle" takes away what the same process spends idle
// (measured just before) over as long.
type bazelReport struct {
	Version string       `json:"bazel_version"`
	Targets int          `json:"targets"`
	Builds  []bazelBuild `json:"builds"`
	// Events are the messages the builds stored in the BES stream.
	Events int64 `json:"events"`
	// InvocationsProjected counts the builds' rows that left 'running'.
	InvocationsProjected int64   `json:"invocations_projected"`
	WindowS              float64 `json:"window_s"`
	ProjectionWaitS      float64 `json:"projection_wait_s"` // from the last build's exit to its projection
	IdleWindowS          float64 `json:"idle_window_s"`
	IdleDevCPUSPerS      float64 `json:"idle_dev_cpu_s_per_s"`
	IdlePostgresCPUSPerS float64 `json:"idle_postgres_cpu_s_per_s"`
	PostgresMeasured     string  `json:"postgres_measured"`

	DevCPUS               float64 `json:"dev_cpu_s"`
	DevPer1k              float64 `json:"dev_cpu_s_per_1k_events"`
	DevPer1kLessIdle      float64 `json:"dev_cpu_s_per_1k_events_less_idle"`
	PostgresCPUS          float64 `json:"postgres_cpu_s"`
	PostgresPer1k         float64 `json:"postgres_cpu_s_per_1k_events"`
	PostgresPer1kLessIdle float64 `json:"postgres_cpu_s_per_1k_events_less_idle"`
	BazelCPUS             float64 `json:"bazel_cpu_s"`
	BazelPer1k            float64 `json:"bazel_cpu_s_per_1k_events"`
}

// bazelBuild is one build: Bazel's exit code (the workspace fails on
// purpose: 1, BUILD_FAILURE), its wall time, the CPU of bazel and every
// process it waited for (its JVM, the actions and tests), and the events
// it stored.
type bazelBuild struct {
	ExitCode int     `json:"exit_code"`
	WallS    float64 `json:"wall_s"`
	CPUS     float64 `json:"bazel_cpu_s"`
	Events   int64   `json:"events"`
	log      string  // Bazel's output
}

// per1k is CPU-s per 1,000 events.
func cpuPer1kEvents(cpuS float64, events int64) float64 {
	if events <= 0 {
		return 0
	}
	return cpuS / float64(events) * 1000
}

// lessIdle is the CPU a window took beyond what the process spends idle
// over as long: cpuS - idle rate × window.
func lessIdle(cpuS, idleCPUSPerS, windowS float64) float64 {
	return cpuS - idleCPUSPerS*windowS
}

func (b *bench) bazelScenario(ctx context.Context, rep *scenarioReport) error {
	bc := b.cfg.bazel
	rep.Description = fmt.Sprintf("%d full `bazel test //...` builds (real Bazel, %d generated targets, fresh output base each) against `millrace dev`: "+
		"CPU-s of dev and PostgreSQL per 1,000 events stored, over the whole window and less their idle rate", bc.builds, bc.targets)
	if _, err := exec.LookPath("bazel"); err != nil {
		rep.Skipped = "no bazel on PATH: install Bazel 4.2.3 (Debian's bazel-bootstrap; `scripts/deps.sh test` as root does)"
		return nil
	}
	ws, err := mkdir(b.tmp, scBazelReal+"-ws")
	if err != nil {
		return err
	}
	// Bazel leaves read-only directories in its output bases.
	defer func() { makeWritable(ws); os.RemoveAll(ws) }()
	exp, err := bazelws.Generate(ws, bazelws.Options{Targets: bc.targets, Seed: 7})
	if err != nil {
		return err
	}
	s, db, cleanup, err := b.devStack(ctx, scBazelReal)
	if err != nil {
		return err
	}
	defer cleanup()
	idle, err := b.idleRun(ctx, s, db, bc.idleWindow)
	if err != nil {
		return err
	}
	idle.Name = "idle before the builds"
	printIdle(idle)
	run, err := b.bazelRun(ctx, s, db, exp, idle)
	if err != nil {
		return err
	}
	rep.Runs = append(rep.Runs, idle, run)
	br := run.Bazel
	floorNote := ""
	if b.floor != "" {
		fr, err := b.floorBazelRun(ctx, exp)
		if err != nil {
			return err
		}
		rep.Runs = append(rep.Runs, fr)
		per1k := cpuPer1kEvents(fr.CPU["floor"].CPUSeconds, fr.WindowEvents)
		fmt.Printf("  floor: %d builds, %d events: besfloor %.3f CPU-s per 1,000 events\n", bc.floorBuilds, fr.WindowEvents, per1k)
		floorNote = fmt.Sprintf("; besfloor (gRPC alone) on %d more builds: %s", bc.floorBuilds, num(roundFigure(per1k, 3)))
	}
	fmt.Printf("  %d builds, %d events in %.1f s: dev %.3f CPU-s per 1,000 events (%.3f less idle), PostgreSQL %.3f (%.3f), bazel %.1f\n",
		len(br.Builds), br.Events, br.WindowS, br.DevPer1k, br.DevPer1kLessIdle, br.PostgresPer1k, br.PostgresPer1kLessIdle, br.BazelPer1k)
	rep.Checks = append(rep.Checks, atMost(fmt.Sprintf("%s: millrace dev CPU-s per 1,000 events over the window of %d builds", scBazelReal, len(br.Builds)),
		br.DevPer1k, bazelTargetCPUSPer1k, "CPU-s",
		fmt.Sprintf("%d events in %.0f s; less idle (%s CPU-s/s): %s; PostgreSQL %s (less idle %s); Bazel itself %s",
			br.Events, br.WindowS, num(br.IdleDevCPUSPerS), num(roundFigure(br.DevPer1kLessIdle, 3)),
			num(roundFigure(br.PostgresPer1k, 3)), num(roundFigure(br.PostgresPer1kLessIdle, 3)), num(roundFigure(br.BazelPer1k, 2)))+floorNote))
	return nil
}

// floorBazelRun runs -bazel-floor-builds more builds, from fresh output
// bases, against besfloor, and measures its CPU per event acknowledged
// (besfloor stores nothing).
func (b *bench) floorBazelRun(ctx context.Context, exp *bazelws.Expected) (runReport, error) {
	bc := b.cfg.bazel
	f, dir, stop, err := b.freshFloor(ctx, scBazelReal+"-floor")
	if err != nil {
		return runReport{}, err
	}
	defer stop()
	procs := map[string]*proc{"floor": f.p}
	before, err := takeSnapshot(procs)
	if err != nil {
		return runReport{}, err
	}
	events0 := scrape(f.metrics).sum("millrace_bes_events_total")
	s := &fleetStack{dir: dir, bes: f.bes}
	for i := range bc.floorBuilds {
		bld, _, err := b.runBazel(ctx, s, exp, bc.builds+i)
		if err != nil {
			return runReport{}, fmt.Errorf("against besfloor: %w", err)
		}
		fmt.Printf("  floor build %d: bazel exited %d after %.1f s\n", i+1, bld.ExitCode, bld.WallS)
	}
	after, err := takeSnapshot(procs)
	if err != nil {
		return runReport{}, err
	}
	events := int64(scrape(f.metrics).sum("millrace_bes_events_total") - events0)
	if least := 2 * int64(bc.targets*bc.floorBuilds); events < least {
		return runReport{}, fmt.Errorf("besfloor acknowledged %d events, fewer than the %d of %d full builds", events, least, bc.floorBuilds)
	}
	wall := after.at.Sub(before.at)
	run := runReport{Name: fmt.Sprintf("%d bazel builds, floor", bc.floorBuilds), Mode: "bazel", NATS: "none",
		ElapsedS: round(wall.Seconds(), 2), WindowS: round(wall.Seconds(), 2), WindowEvents: events,
		EventsPerS: round(float64(events)/wall.Seconds(), 0), Invocations: int64(bc.floorBuilds)}
	run.CPU, run.Machine = cpuFigures(before, after, events, nil)
	run.Machine.Load1Start = before.loadavg()
	return run, nil
}

// bazelRun runs the builds one after another and measures the window.
func (b *bench) bazelRun(ctx context.Context, s *fleetStack, db string, exp *bazelws.Expected, idle runReport) (runReport, error) {
	bc := b.cfg.bazel
	conn, connPID, err := connectPID(ctx, s.dbURL)
	if err != nil {
		return runReport{}, err
	}
	defer conn.Close(context.Background())
	msgs0, _, _, err := streamState(ctx, s.natsURL)
	if err != nil {
		return runReport{}, err
	}
	procs := map[string]*proc{"dev": s.dev}
	meter, err := b.pg.meter(ctx, db, connPID)
	if err != nil {
		return runReport{}, err
	}
	defer meter.stop(context.Background()) // a no-op after the stop below
	before, err := takeSnapshot(procs)
	if err != nil {
		return runReport{}, err
	}
	br := &bazelReport{Version: bazelVersion(ctx), Targets: bc.targets}
	var bazelCPU time.Duration
	if br.Builds, bazelCPU, err = b.runBuilds(ctx, s, exp, msgs0); err != nil {
		return runReport{}, err
	}
	built := time.Now()
	msgs, last, _, err := streamState(ctx, s.natsURL)
	if err != nil {
		return runReport{}, err
	}
	if err := waitPosition(ctx, conn, s.dev, last, b.cfg.lagTimeout); err != nil {
		return runReport{}, err
	}
	after, err := takeSnapshot(procs)
	if err != nil {
		return runReport{}, err
	}
	cost, err := meter.stop(ctx)
	if err != nil {
		return runReport{}, err
	}
	if err := conn.QueryRow(ctx, "select count(*) from invocations where status <> 'running'").Scan(&br.InvocationsProjected); err != nil {
		return runReport{}, err
	}
	events := int64(msgs - msgs0)
	wall := after.at.Sub(before.at)
	run := runReport{Name: fmt.Sprintf("%d bazel builds", bc.builds), Mode: "bazel", NATS: natsInDev, NATSSync: b.cfg.natsSync,
		ElapsedS: round(wall.Seconds(), 2), WindowS: round(wall.Seconds(), 2), WindowEvents: events,
		EventsPerS: round(float64(events)/wall.Seconds(), 0), Invocations: int64(len(br.Builds))}
	run.CPU, run.Machine = cpuFigures(before, after, events, &cost)
	run.Machine.Load1Start = before.loadavg()
	run.Postgres = b.pgReport(cost, events)
	br.Events, br.WindowS, br.ProjectionWaitS = events, run.WindowS, round(after.at.Sub(built).Seconds(), 2)
	br.fill(run, idle, bazelCPU)
	run.Bazel = br
	return run, nil
}

// connectPID connects to the database and says which backend serves the
// connection (the meters leave the bench's own out).
func connectPID(ctx context.Context, url string) (*pgx.Conn, int, error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return nil, 0, err
	}
	var pid int
	if err := conn.QueryRow(ctx, "select pg_backend_pid()").Scan(&pid); err != nil {
		conn.Close(context.Background())
		return nil, 0, err
	}
	return conn, pid, nil
}

// fill computes the per-1,000-event figures of the window from its CPU
// and the idle run's rates.
func (br *bazelReport) fill(run, idle runReport, bazelCPU time.Duration) {
	br.IdleWindowS = idle.WindowS
	br.IdleDevCPUSPerS = idle.CPU["dev"].Cores
	br.IdlePostgresCPUSPerS = pgIdleFigure(idle).Cores
	br.PostgresMeasured = pgFigureName(run.Postgres)
	br.DevCPUS = run.CPU["dev"].CPUSeconds
	br.PostgresCPUS = pgIdleFigure(run).CPUSeconds
	br.BazelCPUS = round(bazelCPU.Seconds(), 2)
	e, w := br.Events, br.WindowS
	br.DevPer1k = round(cpuPer1kEvents(br.DevCPUS, e), 4)
	br.DevPer1kLessIdle = round(cpuPer1kEvents(lessIdle(br.DevCPUS, br.IdleDevCPUSPerS, w), e), 4)
	br.PostgresPer1k = round(cpuPer1kEvents(br.PostgresCPUS, e), 4)
	br.PostgresPer1kLessIdle = round(cpuPer1kEvents(lessIdle(br.PostgresCPUS, br.IdlePostgresCPUSPerS, w), e), 4)
	br.BazelPer1k = round(cpuPer1kEvents(br.BazelCPUS, e), 3)
}

// runBuilds runs the builds one after another; each must store the events
// of a full build. It returns them and Bazel's CPU.
func (b *bench) runBuilds(ctx context.Context, s *fleetStack, exp *bazelws.Expected, msgs0 uint64) ([]bazelBuild, time.Duration, error) {
	var builds []bazelBuild
	var bazelCPU time.Duration
	prev := msgs0
	for i := range b.cfg.bazel.builds {
		bld, cpu, err := b.runBazel(ctx, s, exp, i)
		if err != nil {
			return nil, 0, err
		}
		msgs, _, _, err := streamState(ctx, s.natsURL)
		if err != nil {
			return nil, 0, err
		}
		bld.Events, prev = int64(msgs-prev), msgs
		fmt.Printf("  build %d: bazel exited %d after %.1f s, %.1f CPU-s; %d events stored\n", i+1, bld.ExitCode, bld.WallS, bld.CPUS, bld.Events)
		// Every target sends at least target_configured and
		// target_completed: fewer events is a build that stopped early
		// (and may still exit as the workspace's failures demand).
		if least := 2 * int64(b.cfg.bazel.targets); bld.Events < least {
			return nil, 0, fmt.Errorf("build %d stored %d events, fewer than the %d of a full build of %d targets (log: %s)\n%s",
				i+1, bld.Events, least, b.cfg.bazel.targets, bld.log, tailFile(bld.log, 15))
		}
		builds = append(builds, bld)
		bazelCPU += cpu
	}
	return builds, bazelCPU, nil
}

// runBazel runs build i from a fresh output base, so that it builds and
// tests every target; Bazel must exit as the workspace demands.
func (b *bench) runBazel(ctx context.Context, s *fleetStack, exp *bazelws.Expected, i int) (bazelBuild, time.Duration, error) {
	ctx, cancel := context.WithTimeout(ctx, b.cfg.bazel.timeout)
	defer cancel()
	cmd, err := bazelws.Command(ctx, bazelws.RunOptions{
		Dir: exp.Dir, BESBackend: s.bes, ProjectID: "bench",
		OutputUserRoot: filepath.Join(exp.Dir, fmt.Sprintf("output_user_root.%d", i+1)),
		// No convenience symlinks (bazel-ws, bazel-out, ...) in the
		// workspace: the next build's //... would walk into the previous
		// build's output base through them, which is not its own and so not
		// ignored, and fail to load its external packages.
		Extra: []string{"--symlink_prefix=/"},
	})
	if err != nil {
		return bazelBuild{}, 0, err
	}
	logPath := filepath.Join(s.dir, fmt.Sprintf("bazel.%d.log", i+1))
	log, err := os.Create(logPath)
	if err != nil {
		return bazelBuild{}, 0, err
	}
	defer log.Close()
	cmd.Stdout, cmd.Stderr = log, log
	start := time.Now()
	err = cmd.Run()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		return bazelBuild{}, 0, fmt.Errorf("bazel did not run: %w", err)
	}
	ps := cmd.ProcessState
	cpu := ps.UserTime() + ps.SystemTime()
	bld := bazelBuild{ExitCode: ps.ExitCode(), WallS: round(time.Since(start).Seconds(), 2), CPUS: round(cpu.Seconds(), 2), log: logPath}
	if want, name := exp.ExitCode("test"); bld.ExitCode != want {
		return bld, cpu, fmt.Errorf("build %d: bazel exited %d, want %d (%s): the upload or the build failed (log: %s)\n%s",
			i+1, bld.ExitCode, want, name, logPath, tailFile(logPath, 15))
	}
	return bld, cpu, nil
}

// bazelVersion is what `bazel --version` says, or, where that is
// "bazel no_version" (Debian's bootstrap build), its package's version.
func bazelVersion(ctx context.Context) string {
	out, err := exec.CommandContext(ctx, "bazel", "--version").Output()
	v := strings.TrimSpace(string(out))
	if err != nil || strings.Contains(v, "no_version") {
		if pkg, err := exec.CommandContext(ctx, "dpkg-query", "-W", "-f=${Version}", "bazel-bootstrap").Output(); err == nil {
			return "bazel-bootstrap " + strings.TrimSpace(string(pkg))
		}
	}
	return v
}

// makeWritable lets a directory tree in which Bazel made outputs read-only
// be removed (root ignores the bits, other users do not).
func makeWritable(dir string) {
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			os.Chmod(p, 0o755)
		}
		return nil
	})
}

// tailFile is the last n lines of a file, indented.
func tailFile(path string, n int) string {
	p := proc{log: path}
	return p.tail(n)
}
