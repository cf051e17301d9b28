package main

import (
	"context"
	"errors"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/loadtest/besrecord"
	"github.com/millrace/millrace/loadtest/replay"
	"github.com/millrace/millrace/subjects"
)

const (
	natsEmbedded = "embedded in the edge"
	natsApart    = "natsd process"
	stopGrace    = 30 * time.Second
	readyTimeout = 60 * time.Second
	// streamsPerProject keeps each project well under the edge's default
	// per-project limit (half of MILLRACE_BES_MAX_STREAMS = 1000).
	streamsPerProject = 250
)

type bench struct {
	cfg         config
	scripts     []*replay.Script
	fixtureInfo fixtureInfo
	pg          *pgServer
	tmp         string
	natsd       string
	floor       string // besfloor, built for grpc-floor
	floorFig    *floorFigures
	machine     machineInfo
	reports     []*scenarioReport
	// kept is the backbone the last flat-out run left filled for the
	// projector scenario.
	kept *backbone
	// edgeEnv is added to the environment of the edges started next.
	edgeEnv []string
}

// backbone is a JetStream server holding a filled BES stream.
type backbone struct {
	url    string
	server *proc  // natsd, or the edge that embeds the server
	label  string // natsApart or natsEmbedded
	dir    string
	keep   bool
}

func (bb *backbone) close() {
	if bb == nil {
		return
	}
	if err := bb.server.stop(stopGrace); err != nil {
		fmt.Printf("bench: %v\n", err)
	}
	if !bb.keep {
		os.RemoveAll(bb.dir)
	}
}

func (b *bench) releaseKept() {
	b.kept.close()
	b.kept = nil
}

func (b *bench) loadFixtures() error {
	files, err := filepath.Glob(b.cfg.fixtures)
	if err != nil {
		return err
	}
	if len(files) == 0 {
		return fmt.Errorf("no recordings match %s: record some with loadtest/cmd/besrecord (see loadtest/README.md)", b.cfg.fixtures)
	}
	sort.Strings(files)
	info := fixtureInfo{EventsMin: math.MaxInt}
	var toolBytes, toolEvents int
	for _, f := range files {
		recs, err := besrecord.Read(f)
		if err != nil {
			return err
		}
		scripts, skipped := replay.Scripts(recs)
		for _, s := range skipped {
			info.Skipped = append(info.Skipped, fmt.Sprintf("%s: %v", filepath.Base(f), s))
		}
		for _, s := range scripts {
			n := s.Events()
			info.EventsMin, info.EventsMax = min(info.EventsMin, n), max(info.EventsMax, n)
			info.EventsMean += float64(n)
			for _, ts := range s.Streams {
				for _, r := range ts.Requests {
					toolBytes += len(r.GetOrderedBuildEvent().GetEvent().GetBazelEvent().GetValue())
					toolEvents++
				}
			}
		}
		b.scripts = append(b.scripts, scripts...)
		info.Files = append(info.Files, filepath.Base(f))
	}
	if len(b.scripts) == 0 {
		return fmt.Errorf("no complete build in %s (%v)", b.cfg.fixtures, info.Skipped)
	}
	info.Builds = len(b.scripts)
	info.EventsMean = round(info.EventsMean/float64(len(b.scripts)), 1)
	info.BytesPerTool = round(float64(toolBytes)/float64(toolEvents), 1)
	b.fixtureInfo = info
	return nil
}

func buildNATSD(ctx context.Context, dir string) (string, error) { return goBuild(ctx, dir, "natsd") }

// goBuild builds ./loadtest/cmd/<name> into dir.
func goBuild(ctx context.Context, dir, name string) (string, error) {
	out := filepath.Join(dir, name)
	cmd := exec.CommandContext(ctx, "go", "build", "-o", out, "./loadtest/cmd/"+name)
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("build %s: %w\n%s", name, err, b)
	}
	return out, nil
}

func (b *bench) runScenario(ctx context.Context, name string) *scenarioReport {
	rep := &scenarioReport{Scenario: name, Started: time.Now(), Machine: b.machine, Fixtures: b.fixtureInfo}
	var err error
	switch name {
	case scEdgeEmbedded, scEdgeNATSApart:
		apart := name == scEdgeNATSApart
		rep.Description = "flat-out replay into `millrace serve bes` with JetStream embedded in the edge process"
		if apart {
			rep.Description = "flat-out replay into `millrace serve bes --nats-url` with JetStream in its own process (natsd)"
		}
		for i, n := range b.cfg.streams {
			// The last run leaves its stream for the projector scenario
			// (not in A/B mode: the projector then fills its own stream
			// with its own binary).
			keep := i == len(b.cfg.streams)-1 && b.cfg.scenarios[scProjector] && !b.cfg.ab.on() &&
				(apart || !b.cfg.scenarios[scEdgeNATSApart])
			var run runReport
			run, err = b.flatRun(ctx, name, n, apart, keep)
			if err != nil {
				break
			}
			rep.Runs = append(rep.Runs, run)
			b.printRun(run)
			ef := run.CPU["edge"]
			busy := ""
			if m := run.Machine; m != nil && m.OtherCores > 0.25 {
				busy = fmt.Sprintf("other work on the machine took %.1f of its %d cores meanwhile", m.OtherCores, b.machine.NProc)
			}
			if apart {
				rep.Checks = append(rep.Checks, atLeast(fmt.Sprintf("%s %s: edge events per CPU-second (edge alone)", name, run.Name),
					float64(ef.EventsPerCPUS), 25000, "events/CPU-s", busy))
			} else {
				rep.Checks = append(rep.Checks, atLeast(fmt.Sprintf("%s %s: edge events per CPU-second (edge + embedded JetStream)", name, run.Name),
					float64(ef.EventsPerCPUS), 25000, "events/CPU-s", join("the edge process also runs the JetStream server here", busy)))
			}
		}
	case scProjector:
		rep.Description = "`millrace project builds` drains a filled BES stream into a fresh database"
		var run runReport
		run, err = b.drainRun(ctx)
		if err == nil {
			rep.Runs = append(rep.Runs, run)
			b.printRun(run)
			rep.Checks = append(rep.Checks, b.projectorChecks(name, run, drainWALTarget)...)
		}
	case scProjectorLive, scPaced1000, scPaced1000Apart, scPaced5000:
		err = b.liveScenario(ctx, name, rep)
	case scEdgeMemory:
		err = b.memoryScenario(ctx, rep)
	case scGRPCFloor:
		err = b.floorScenario(ctx, rep)
	case scIdle:
		err = b.idleScenario(ctx, rep)
	case scBazelReal:
		err = b.bazelScenario(ctx, rep)
	case scStorage:
		err = b.storageScenario(ctx, rep)
	case scFleetPlacer:
		err = b.placerScenario(ctx, rep)
	case scFleetSessions, scFleetPlace, scFleetActive, scFleetRehome, scFleetChurn:
		err = b.fleetScenario(ctx, name, rep)
	case scCommits3Writers, scCommits1Writer, scCommitsFold, scCommitsColdStart:
		err = b.commitsScenario(ctx, name, rep)
	case scKafkaExport:
		err = b.kafkaScenario(ctx, rep)
	case scEdgeRedaction:
		err = b.redactionScenario(ctx, rep)
	case scMillionEvents:
		err = b.millionScenario(ctx, rep)
	case scConsolePages:
		err = b.pagesScenario(ctx, rep)
	case scEdgesRolling:
		err = b.rollingScenario(ctx, rep)
	case scPartitionLayout:
		err = b.partitionScenario(ctx, rep)
	case scProjectorsPartitioned:
		err = b.partitionedScenario(ctx, rep)
	}
	if err != nil {
		rep.Error = err.Error()
	}
	return rep
}

func join(a, b string) string {
	if a == "" || b == "" {
		return a + b
	}
	return a + "; " + b
}

// liveScenario is a paced replay with the projector running: projector-live,
// paced-1000 and paced-5000.
func (b *bench) liveScenario(ctx context.Context, name string, rep *scenarioReport) error {
	c := b.cfg
	sp := pacedSpec{streams: c.liveStreams, rate: c.liveRate, warmup: c.liveWarmup, window: c.liveDuration, warmupPhase: c.warmupPhase}
	rep.Description = "paced replay into `millrace serve bes` (embedded JetStream) while `millrace project builds` runs; projection lag"
	switch name {
	case scPaced1000, scPaced1000Apart:
		sp = pacedSpec{streams: c.pacedStreams, rate: c.pacedRate, warmup: c.warmup, window: c.duration, warmupPhase: c.warmupPhase,
			edgeEnv: edgeLimitsEnv(c.pacedStreams), natsApart: name == scPaced1000Apart}
		rep.Description = "many slow streams, as 1,000 concurrent CI builds: `millrace serve bes` + `millrace project builds`; ack latency and projection lag"
		if sp.natsApart {
			rep.Description = "paced-1000 with JetStream in its own process (natsd), so that the edge's CPU is its own: `millrace serve bes --nats-url` + `millrace project builds`"
		}
	case scPaced5000:
		p := c.paced5000
		sp = pacedSpec{streams: p.streams, rate: p.rate, warmup: p.warmup, window: p.duration, warmupPhase: p.warmupPhase,
			warmupEvents: p.warmupEvents, edgeEnv: edgeLimitsEnv(p.streams)}
		rep.Description = "5,000 slow streams at the same total rate as paced-1000: `millrace serve bes` + `millrace project builds`; ack latency and projection lag"
	}
	run, err := b.pacedRun(ctx, name, sp)
	if err != nil {
		return err
	}
	rep.Runs = append(rep.Runs, run)
	b.printRun(run)
	// The drain's targets, applied to live traffic: the cost per event
	// depends on how many invocations a batch touches.
	rep.Checks = append(rep.Checks, b.projectorChecks(fmt.Sprintf("%s (live, %d streams)", name, sp.streams), run, liveWALTarget)...)
	if name != scProjectorLive {
		rep.Checks = append(rep.Checks, manyStreamsChecks(name, run, sp, b.machine.NProc, b.floorCPUNote())...)
	}
	return nil
}

// Targets of the paced runs (loadtest/README.md, "Scenarios").
const (
	drainWALTarget      = 250   // WAL bytes per event of the drain
	liveWALTarget       = 150   // ... and of the live runs
	pacedEdgeTarget     = 15000 // edge (with embedded JetStream) events per CPU-second
	pacedAckP99TargetMS = 10
	pacedLagP99TargetS  = 1
)

// manyStreamsChecks are paced-1000's and paced-5000's own targets: the
// edge's events per CPU-second, ack p99 and projection lag p99.
// floorNote, when not empty, is added to the edge's CPU check (what
// grpc-floor measured in the same run).
func manyStreamsChecks(name string, run runReport, sp pacedSpec, nproc int, floorNote string) []check {
	note := fmt.Sprintf("%.0f events/s achieved of %.0f asked", run.EventsPerS, sp.rate)
	if m := run.Machine; m != nil && m.OtherCores > 0.25 {
		note += fmt.Sprintf("; other work on the machine took %.1f of its %d cores meanwhile", m.OtherCores, nproc)
	}
	cs := []check{
		atLeast(fmt.Sprintf("%s: edge events per CPU-second at %d paced streams (edge + embedded JetStream)", name, sp.streams),
			run.CPU["edge"].EventsPerCPUS, pacedEdgeTarget, "events/CPU-s", join(join("the edge process also runs the JetStream server here", note), floorNote)),
		below(fmt.Sprintf("%s: ack p99 at %d paced streams", name, sp.streams), run.AckLatency.P99MS, pacedAckP99TargetMS, "ms", note),
	}
	return append(cs, lagCheck(fmt.Sprintf("%s: projection lag p99 at %d paced streams", name, sp.streams), run.Lag))
}

// lagCheck is projection lag p99 < 1 s. Without a measured invocation
// there is nothing to pass, and invocations never seen projected (within
// -lag-timeout) count as lags beyond any target: more than 1 % of them
// fail the p99 whatever the others did.
func lagCheck(name string, l *lagReport) check {
	if l == nil {
		return check{Name: name, Unit: "s", Target: fmt.Sprintf("< %s", num(pacedLagP99TargetS)), Note: "projection lag not measured"}
	}
	c := below(name, l.Lag.P99MS/1000, pacedLagP99TargetS, "s", fmt.Sprintf("%d invocations measured, %d not projected", l.Measured, l.NotProjected))
	switch total := l.Measured + l.NotProjected; {
	case l.Measured == 0:
		c.Pass = false
		c.Note = "no invocation's stream ended in the measured window: lengthen the window or raise the warm-up phase"
	case l.NotProjected*100 > total:
		c.Pass = false
		c.Note += " (more than 1 % not projected within -lag-timeout)"
	}
	return c
}

func (b *bench) projectorChecks(name string, run runReport, walTarget float64) []check {
	var cs []check
	pf := run.CPU["projector"]
	cs = append(cs, atLeast(name+": projector events per CPU-second", float64(pf.EventsPerCPUS), 50000, "events/CPU-s", ""))
	if pg := run.Postgres; pg != nil {
		fig, note := run.CPU["postgres_all"], "all postgres processes"
		if pg.Shared {
			fig = run.CPU["postgres_attributed"]
			note = "server shared with other databases: the backends of the bench's database plus the server's background writers"
		}
		if _, ok := run.CPU["postgres_all"]; ok {
			cs = append(cs, atLeast(name+": PostgreSQL events per CPU-second", float64(fig.EventsPerCPUS), 100000, "events/CPU-s", note))
		}
		walNote := ""
		if pg.Shared {
			walNote = "WAL is server-wide: other databases' writes are included"
		}
		cs = append(cs, atMost(name+": WAL bytes per event", pg.WALPerEvent, walTarget, "bytes/event", walNote))
	}
	return cs
}

func (b *bench) printRun(r runReport) {
	fmt.Printf("  %-22s %8d events in %5.1f s = %7.0f events/s", r.Name, r.WindowEvents, r.WindowS, r.EventsPerS)
	for _, k := range []string{"edge", "natsd", "projector", "postgres_attributed"} {
		if f, ok := r.CPU[k]; ok {
			fmt.Printf("; %s %.2f CPU-s/100k (%d ev/CPU-s)", k, f.Per100kEvents, int64(f.EventsPerCPUS))
		}
	}
	if r.AckLatency != nil && r.AckLatency.Count > 0 {
		fmt.Printf("; ack p50 %.2f ms p99 %.2f ms", r.AckLatency.P50MS, r.AckLatency.P99MS)
	}
	if r.Lag != nil {
		fmt.Printf("; lag p99 %.0f ms", r.Lag.Lag.P99MS)
	}
	if len(r.Errors) > 0 {
		fmt.Printf("; errors %v", r.Errors)
	}
	fmt.Println()
}

func projectsFor(streams int) []string {
	n := (streams + streamsPerProject - 1) / streamsPerProject
	ps := make([]string, n)
	for i := range ps {
		ps[i] = fmt.Sprintf("bench-%d", i)
	}
	return ps
}

// edge is a running `millrace serve bes`.
type edge struct {
	p       *proc
	bes     string
	natsURL string
	metrics string // its /metrics URL
	// ready, env and dir start it again as it was (restartEdge); starts
	// counts its processes, each with a log of its own in dir.
	ready, dir, name string
	env              []string
	starts           int
}

// startEdge starts the edge; natsURL empty embeds JetStream in it. extra
// is added to its environment.
func (b *bench) startEdge(ctx context.Context, dir, natsURL string, extra ...string) (*edge, error) {
	bes, err := freeAddr()
	if err != nil {
		return nil, err
	}
	web, err := freeAddr()
	if err != nil {
		return nil, err
	}
	env := []string{
		"MILLRACE_BES_LISTEN=" + bes,
		"MILLRACE_HTTP_LISTEN=" + web,
		"MILLRACE_NATS_SYNC=" + b.cfg.natsSync,
		"MILLRACE_SHUTDOWN_TIMEOUT=10s",
	}
	if natsURL == "" {
		na, err := freeAddr()
		if err != nil {
			return nil, err
		}
		env = append(env, "MILLRACE_NATS_DIR="+filepath.Join(dir, "nats"), "MILLRACE_NATS_LISTEN="+na)
		natsURL = "nats://" + na
		embeddedNATS(natsURL, filepath.Join(dir, "nats"))
	} else {
		env = append(env, natsEnv(natsURL)...)
	}
	env = append(append(env, b.edgeEnv...), extra...)
	e := &edge{bes: bes, natsURL: natsURL, metrics: "http://" + web + "/metrics", ready: "http://" + web + "/readyz",
		dir: dir, name: "edge", env: env}
	if err := b.restartEdge(ctx, e); err != nil {
		return nil, err
	}
	return e, nil
}

// restartEdge starts e's process (again) on its addresses and waits until
// it is ready.
func (b *bench) restartEdge(ctx context.Context, e *edge) error {
	e.starts++
	log := filepath.Join(e.dir, e.name+".log")
	if e.starts > 1 {
		log = filepath.Join(e.dir, fmt.Sprintf("%s-%d.log", e.name, e.starts))
	}
	p, err := startProc(e.name, b.cfg.bin, []string{"serve", "bes"}, e.env, log)
	if err != nil {
		return err
	}
	if err := waitReady(ctx, p, e.ready, readyTimeout); err != nil {
		p.stop(stopGrace)
		return err
	}
	e.p = p
	return nil
}

// startNATSD starts JetStream in its own process.
func (b *bench) startNATSD(ctx context.Context, dir string) (*proc, string, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, "", err
	}
	p, err := startProc("natsd", b.natsd, []string{"-listen", addr, "-dir", filepath.Join(dir, "nats"), "-sync", b.cfg.natsSync}, nil, filepath.Join(dir, "natsd.log"))
	if err != nil {
		return nil, "", err
	}
	url := "nats://" + addr
	deadline := time.Now().Add(readyTimeout)
	for {
		nc, err := nats.Connect(url, nats.Timeout(time.Second))
		if err == nil {
			js, _ := jetstream.New(nc)
			_, err = js.AccountInfo(ctx)
			nc.Close()
			if err == nil {
				return p, url, nil
			}
		}
		if p.exited() || time.Now().After(deadline) || ctx.Err() != nil {
			p.stop(stopGrace)
			return nil, "", fmt.Errorf("natsd at %s not ready: %v (log: %s)\n%s", url, err, p.log, p.tail(10))
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// startProjector starts `project builds` and returns it with its /metrics URL.
func (b *bench) startProjector(ctx context.Context, dir, natsURL, dbURL string, wait bool) (*proc, string, error) {
	web, err := freeAddr()
	if err != nil {
		return nil, "", err
	}
	env := append([]string{"DATABASE_URL=" + dbURL, "MILLRACE_HTTP_LISTEN=" + web}, natsEnv(natsURL)...)
	if b.cfg.buildsBatch > 0 {
		env = append(env, fmt.Sprintf("MILLRACE_BUILDS_BATCH=%d", b.cfg.buildsBatch))
	}
	if b.cfg.buildsMaxWait > 0 {
		env = append(env, "MILLRACE_BUILDS_MAX_WAIT="+b.cfg.buildsMaxWait.String())
	}
	p, err := startProc("projector", b.cfg.bin, []string{"project", "builds"}, env, filepath.Join(dir, "projector.log"))
	if err != nil {
		return nil, "", err
	}
	if wait {
		if err := waitReady(ctx, p, "http://"+web+"/readyz", readyTimeout); err != nil {
			p.stop(stopGrace)
			return nil, "", err
		}
	}
	return p, "http://" + web + "/metrics", nil
}

func (b *bench) migrate(ctx context.Context, dbURL string) error {
	cmd := exec.CommandContext(ctx, b.cfg.bin, "migrate")
	cmd.Env = append(cleanEnv(), "DATABASE_URL="+dbURL)
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("millrace migrate: %w\n%s", err, out)
	}
	return nil
}

// snapshot is the CPU of the measured processes at one moment.
type snapshot struct {
	at      time.Time
	procs   map[string]time.Duration
	ctxsw   map[string]int64
	self    time.Duration
	machine machineCPU
}

func takeSnapshot(procs map[string]*proc) (snapshot, error) {
	s := snapshot{at: time.Now(), procs: map[string]time.Duration{}, ctxsw: map[string]int64{}, machine: readMachineCPU()}
	for name, p := range procs {
		if p == nil {
			continue
		}
		d, err := p.cpu()
		if err != nil {
			return s, err
		}
		s.procs[name] = d
		s.ctxsw[name] = ctxSwitches(p.pid())
	}
	if t, err := readCPU(os.Getpid()); err == nil {
		s.self = t.self()
	}
	s.ctxsw["bench_client"] = ctxSwitches(os.Getpid())
	return s, nil
}

// cpuFigures turns two snapshots into per-process figures for events.
func cpuFigures(before, after snapshot, events int64, pg *pgCost) (map[string]cpuFigure, *machineCPUReport) {
	wall := after.at.Sub(before.at)
	out := map[string]cpuFigure{}
	var known time.Duration
	for name, a := range after.procs {
		d := a - before.procs[name]
		out[name] = figure(d, events, wall)
		known += d
	}
	self := after.self - before.self
	out["bench_client"] = figure(self, events, wall)
	for name, f := range out {
		a, ok := after.ctxsw[name]
		if !ok {
			continue
		}
		d := float64(a - before.ctxsw[name])
		if events > 0 {
			f.CtxSwitchesPerEvent = round(d/float64(events), 2)
		}
		if wall > 0 {
			f.CtxSwitchesPerS = round(d/wall.Seconds(), 1)
		}
		out[name] = f
	}
	known += self
	if pg != nil && pg.CPUAll > 0 {
		out["postgres_all"] = figure(pg.CPUAll, events, wall)
		out["postgres_attributed"] = figure(pg.CPUAttributed, events, wall)
		known += pg.CPUAll
	}
	m := after.machine.sub(before.machine)
	return out, &machineCPUReport{
		BusyCPUS:        round(m.busy.Seconds(), 2),
		UnaccountedCPUS: round((m.busy - known).Seconds(), 2),
		StealCPUS:       round(m.steal.Seconds(), 2),
		OtherCores:      round((m.busy-known).Seconds()/wall.Seconds(), 2),
	}
}

func fillRun(name string, res *replay.Result, streams int, nats string, syncSetting string) runReport {
	r := runReport{
		Name:             name,
		Streams:          streams,
		Connections:      streams,
		Projects:         len(projectsFor(streams)),
		NATS:             nats,
		NATSSync:         syncSetting,
		ElapsedS:         round(res.Elapsed.Seconds(), 2),
		WindowS:          round(res.Window.Seconds(), 2),
		WindowEvents:     res.WindowEvents,
		ToolEvents:       res.ToolEvents,
		LifecycleEvents:  res.LifecycleEvents,
		Invocations:      res.Invocations,
		Truncated:        res.Truncated,
		Failed:           res.Failed,
		Errors:           res.Errors,
		ErrorSamples:     res.ErrorSamples,
		Retried:          res.Retried,
		StreamsResumed:   res.Resumed,
		AckLatency:       summaryPtr(res.Ack),
		LifecycleLatency: summaryPtr(res.Lifecycle),
	}
	if res.Window > 0 {
		r.EventsPerS = math.Round(float64(res.WindowEvents) / res.Window.Seconds())
	}
	return r
}

// flatRun replays -events flat out with n streams into a fresh edge.
func (b *bench) flatRun(ctx context.Context, scenario string, n int, apart, keep bool) (runReport, error) {
	dir, err := mkdir(b.tmp, scenario)
	if err != nil {
		return runReport{}, err
	}
	cleanDir := true
	defer func() {
		if cleanDir && !b.cfg.keep {
			os.RemoveAll(dir)
		}
	}()
	procs := map[string]*proc{}
	var natsd *proc
	natsURL, label := "", natsEmbedded
	if apart {
		var err error
		if natsd, natsURL, err = b.startNATSD(ctx, dir); err != nil {
			return runReport{}, err
		}
		procs["natsd"] = natsd
		label = natsApart
	}
	e, err := b.startEdge(ctx, dir, natsURL)
	if err != nil {
		if natsd != nil {
			natsd.stop(stopGrace)
		}
		return runReport{}, err
	}
	procs["edge"] = e.p
	stopAll := func() {
		if err := e.p.stop(stopGrace); err != nil {
			fmt.Printf("bench: %v\n", err)
		}
		if natsd != nil {
			natsd.stop(stopGrace)
		}
	}

	before, err := takeSnapshot(procs)
	if err != nil {
		stopAll()
		return runReport{}, err
	}
	promBefore := scrape(e.metrics)
	res, err := replay.Run(ctx, replay.Config{
		Target: e.bes, Scripts: b.scripts, Streams: n, Projects: projectsFor(n), Events: b.cfg.events, Seed: 1,
	})
	if err != nil {
		stopAll()
		return runReport{}, err
	}
	after, err := takeSnapshot(procs)
	if err != nil {
		stopAll()
		return runReport{}, err
	}
	run := fillRun(fmt.Sprintf("%d streams", n), res, n, label, b.cfg.natsSync)
	run.Mode = "flat out"
	run.CPU, run.Machine = cpuFigures(before, after, res.Events(), nil)
	run.Machine.Load1Start = before.loadavg()
	run.Server = serverReport(scrape(e.metrics).delta(promBefore), nil)

	if !keep {
		stopAll()
		return run, nil
	}
	// Leave the filled stream for the projector scenario.
	b.releaseKept()
	cleanDir = false
	if apart {
		if err := e.p.stop(stopGrace); err != nil {
			fmt.Printf("bench: %v\n", err)
		}
		b.kept = &backbone{url: natsURL, server: natsd, label: natsApart, dir: dir, keep: b.cfg.keep}
	} else {
		b.kept = &backbone{url: e.natsURL, server: e.p, label: natsEmbedded, dir: dir, keep: b.cfg.keep}
	}
	return run, nil
}

func (s snapshot) loadavg() string { return strings.TrimSpace(readFile("/proc/loadavg")) }

// streamState is the BES stream's message count and last sequence.
func streamState(ctx context.Context, url string) (msgs, last uint64, dead uint64, err error) {
	nc, err := nats.Connect(url, natsOptions(url, nats.Timeout(5*time.Second))...)
	if err != nil {
		return 0, 0, 0, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return 0, 0, 0, err
	}
	s, err := js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		return 0, 0, 0, fmt.Errorf("stream %s: %w", subjects.StreamBES, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, 0, 0, err
	}
	if d, err := js.Stream(ctx, subjects.StreamDead); err == nil {
		if di, err := d.Info(ctx); err == nil {
			dead = di.State.Msgs
		}
	}
	return info.State.Msgs, info.State.LastSeq, dead, nil
}

// position is the builds projector's committed stream sequence.
func position(ctx context.Context, conn *pgx.Conn) (uint64, error) {
	var pos int64
	err := conn.QueryRow(ctx, "select stream_seq from consumer_positions where consumer = 'builds'").Scan(&pos)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	return uint64(pos), err
}

// waitPosition polls until the projector has committed up to seq.
func waitPosition(ctx context.Context, conn *pgx.Conn, p *proc, seq uint64, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		pos, err := position(ctx, conn)
		if err != nil {
			return err
		}
		if pos >= seq {
			return nil
		}
		if p.exited() {
			return fmt.Errorf("projector exited at position %d of %d: %v\n%s", pos, seq, p.err, p.tail(15))
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("projector at position %d of %d after %s (log %s)\n%s", pos, seq, timeout, p.log, p.tail(10))
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// fillBackbone fills a stream when no flat-out run left one.
func (b *bench) fillBackbone(ctx context.Context) error {
	dir, err := mkdir(b.tmp, "projector-fill")
	if err != nil {
		return err
	}
	natsd, url, err := b.startNATSD(ctx, dir)
	if err != nil {
		return err
	}
	bb := &backbone{url: url, server: natsd, label: natsApart, dir: dir, keep: b.cfg.keep}
	e, err := b.startEdge(ctx, dir, url)
	if err != nil {
		bb.close()
		return err
	}
	n := b.cfg.streams[len(b.cfg.streams)-1]
	fmt.Printf("  filling the stream: %d events, %d streams\n", b.cfg.events, n)
	_, err = replay.Run(ctx, replay.Config{Target: e.bes, Scripts: b.scripts, Streams: n, Projects: projectsFor(n), Events: b.cfg.events, Seed: 1})
	e.p.stop(stopGrace)
	if err != nil {
		bb.close()
		return err
	}
	b.kept = bb
	return nil
}

// drainRun runs the projector over the kept stream into a fresh database.
func (b *bench) drainRun(ctx context.Context) (runReport, error) {
	if b.kept == nil {
		if err := b.fillBackbone(ctx); err != nil {
			return runReport{}, err
		}
	}
	defer b.releaseKept()
	bb := b.kept
	msgs, last, _, err := streamState(ctx, bb.url)
	if err != nil {
		return runReport{}, err
	}
	db, dbURL, err := b.pg.createDB(ctx, scProjector)
	if err != nil {
		return runReport{}, err
	}
	defer b.pg.dropDB(db)
	if err := b.migrate(ctx, dbURL); err != nil {
		return runReport{}, err
	}
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return runReport{}, err
	}
	defer conn.Close(context.Background())
	var connPID int
	if err := conn.QueryRow(ctx, "select pg_backend_pid()").Scan(&connPID); err != nil {
		return runReport{}, err
	}

	meter, err := b.pg.meter(ctx, db, connPID)
	if err != nil {
		return runReport{}, err
	}
	natsBefore, err := bb.server.cpu()
	if err != nil {
		return runReport{}, err
	}
	natsCtxBefore := ctxSwitches(bb.server.pid())
	before, _ := takeSnapshot(nil)
	p, projMetrics, err := b.startProjector(ctx, bb.dir, bb.url, dbURL, false)
	if err != nil {
		return runReport{}, err
	}
	defer p.stop(stopGrace)
	if err := waitPosition(ctx, conn, p, last, b.cfg.drainTimeout); err != nil {
		return runReport{}, err
	}
	drained := time.Since(before.at)
	projCPU, err := p.cpu()
	if err != nil {
		return runReport{}, err
	}
	projCtx := ctxSwitches(p.pid())
	natsAfter, _ := bb.server.cpu()
	natsCtxAfter := ctxSwitches(bb.server.pid())
	after, _ := takeSnapshot(nil)
	projProm := scrape(projMetrics)
	cost, err := meter.stop(ctx)
	if err != nil {
		return runReport{}, err
	}
	if err := p.stop(stopGrace); err != nil {
		fmt.Printf("bench: %v\n", err)
	}

	events := int64(msgs)
	run := runReport{
		Name: fmt.Sprintf("drain %d events", msgs), Mode: "drain", NATS: bb.label, NATSSync: b.cfg.natsSync,
		ElapsedS: round(drained.Seconds(), 2), WindowS: round(drained.Seconds(), 2), WindowEvents: events,
		EventsPerS: math.Round(float64(events) / drained.Seconds()),
	}
	before.procs, after.procs = map[string]time.Duration{"projector": 0}, map[string]time.Duration{"projector": projCPU}
	natsName := "natsd"
	if bb.label == natsEmbedded {
		natsName = "edge_embedded_nats"
	}
	before.procs[natsName], after.procs[natsName] = natsBefore, natsAfter
	after.ctxsw["projector"] = projCtx
	before.ctxsw[natsName], after.ctxsw[natsName] = natsCtxBefore, natsCtxAfter
	run.CPU, run.Machine = cpuFigures(before, after, events, &cost)
	run.Machine.Load1Start = before.loadavg()
	run.Postgres = b.pgReport(cost, events)
	run.Server = serverReport(nil, projProm)
	d := &drainReport{StreamMessages: msgs, DrainS: run.ElapsedS, EventsPerS: run.EventsPerS, Rows: map[string]int64{}, InvocationStatus: map[string]int64{}}
	if err := tableCounts(ctx, conn, d); err != nil {
		return run, err
	}
	d.RowsPerS = math.Round(float64(d.RowsTotal) / drained.Seconds())
	_, _, d.DeadLetters, _ = streamState(ctx, bb.url)
	run.Drain = d
	return run, nil
}

func (b *bench) pgReport(c pgCost, events int64) *pgReport {
	r := &pgReport{
		CPUAllS:       round(c.CPUAll.Seconds(), 3),
		CPUAttributed: round(c.CPUAttributed.Seconds(), 3),
		WALBytes:      c.WALBytes,
		OtherXacts:    c.OtherXacts,
		OtherBackends: c.OtherBackends,
	}
	if events > 0 {
		r.WALPerEvent = round(float64(c.WALBytes)/float64(events), 1)
	}
	// A handful of stray transactions (monitoring, statistics flushed
	// late) is not sharing; a test suite running meanwhile is.
	r.Shared = c.OtherXacts > 50 || c.OtherBackends > 0
	if r.Shared {
		r.Note = fmt.Sprintf("the server was shared: %d transactions in other databases and %d of their client backends seen during the run; "+
			"cpu_all_processes_s and WAL include their work, cpu_attributed_s counts only this database's backends and the background writers", c.OtherXacts, c.OtherBackends)
	}
	if !b.pg.local {
		r.Note = "PostgreSQL's processes are not visible on this machine: CPU not measured. " + r.Note
	}
	return r
}

// tableCounts counts the projection's rows.
func tableCounts(ctx context.Context, conn *pgx.Conn, d *drainReport) error {
	rows, err := conn.Query(ctx, `select tablename from pg_tables where schemaname = 'public'
		and tablename not in ('consumer_positions', 'millrace_schema_version') order by 1`)
	if err != nil {
		return err
	}
	tables, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	for _, t := range tables {
		var n int64
		if err := conn.QueryRow(ctx, "select count(*) from "+pgx.Identifier{t}.Sanitize()).Scan(&n); err != nil {
			return err
		}
		d.Rows[t] = n
		d.RowsTotal += n
	}
	rows, err = conn.Query(ctx, "select status, count(*) from invocations group by 1")
	if err != nil {
		return err
	}
	var status string
	var n int64
	_, err = pgx.ForEachRow(rows, []any{&status, &n}, func() error {
		d.InvocationStatus[status] = n
		return nil
	})
	return err
}
