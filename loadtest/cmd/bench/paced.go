package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/loadtest/replay"
	"github.com/millrace/millrace/services/bes"
)

// quietThreshold is how much of the machine other work may take before a
// latency measurement waits for it to go away.
const quietThreshold = 0.25 // cores

// waitQuiet waits up to max for the machine's busy CPU (nothing of the
// bench's runs between scenarios) to fall below quietThreshold, and
// returns the last reading in cores.
func waitQuiet(ctx context.Context, max time.Duration) float64 {
	deadline := time.Now().Add(max)
	said := false
	for {
		before, self0 := readMachineCPU(), selfCPU()
		select {
		case <-ctx.Done():
			return 0
		case <-time.After(2 * time.Second):
		}
		m := readMachineCPU().sub(before)
		other := (m.busy - (selfCPU() - self0)).Seconds() / 2
		if other < quietThreshold || time.Now().After(deadline) {
			if said {
				fmt.Printf("  other work now takes %.2f cores\n", other)
			}
			return round(other, 2)
		}
		if !said {
			fmt.Printf("  waiting up to %s for other work on the machine (%.2f cores) to stop\n", max, other)
			said = true
		}
	}
}

func selfCPU() time.Duration {
	t, _ := readCPU(os.Getpid())
	return t.self()
}

// pacedSpec is one paced run's load.
type pacedSpec struct {
	streams        int
	rate           float64 // events/s over all streams
	warmup, window time.Duration
	warmupPhase    float64
	warmupEvents   int      // replay.Config.WarmupEvents (0: no bound)
	edgeEnv        []string // added to the edge's environment
	// natsApart runs JetStream in its own process (natsd), so that the
	// edge's CPU is its own: paced-1000-nats-apart.
	natsApart bool
}

// edgeLimitsEnv lifts the edge's stream limits for n streams where its
// defaults would refuse some: --bes-max-streams (2,000) to n and a quarter
// (a stream that ends and the next that opens overlap for a moment), and
// --bes-max-pending-per-addr (64) to n, since every stream of the bench
// comes from 127.0.0.1 where n builds would come from many hosts, and
// streams that open at once wait up to a pacing interval for their first
// event. The per-project limit is half of the first, far above the
// bench's 250 per project. paced-1000 takes them too: its warm-up spreads
// the streams' starts, but when the machine stalls, more than 64 of its
// streams wait for a first event at once and were refused
// (ResourceExhausted), which no fleet of many hosts would see.
func edgeLimitsEnv(n int) []string {
	var env []string
	if n+n/4 > bes.DefaultMaxStreams {
		env = append(env, fmt.Sprintf("MILLRACE_BES_MAX_STREAMS=%d", n+n/4))
	}
	if n > bes.DefaultMaxPendingPerAddr {
		env = append(env, fmt.Sprintf("MILLRACE_BES_MAX_PENDING_PER_ADDR=%d", n))
	}
	return env
}

// paced5000Config sizes paced-5000 (flags of the bench).
type paced5000Config struct {
	streams          int
	rate             float64
	warmup, duration time.Duration
	warmupPhase      float64
	warmupEvents     int
}

// paced-5000's warm-up differs from paced-1000's: at 0.5 events/s a build
// lasts 3 to 17 minutes, so only streams that start near the end of their
// build finish within the window (and give projection lag), and the
// history of 5,000 streams spread over their builds is too much to send
// in a warm-up (at -warmup-phase 0.5, 360,000 events in 20 s swamped the
// edge and the projector into the window). A stream starts anywhere in its
// first 100 events instead: short builds (86 events) anywhere in their
// lives, long ones early: about 220,000 events, over a 90 s warm-up (in
// 60 s, acks of the warm-up took up to 14 s and its backlog ran into the
// window).
func (c *paced5000Config) register(fs *flag.FlagSet) {
	fs.IntVar(&c.streams, "paced-5000-streams", 5000, "paced-5000: concurrent streams, each on its own connection")
	fs.Float64Var(&c.rate, "paced-5000-rate", 2500, "paced-5000: total events/s over all streams (paced-1000's: 0.5 per stream)")
	fs.DurationVar(&c.duration, "paced-5000-duration", 60*time.Second, "paced-5000: measured time after the warm-up")
	fs.DurationVar(&c.warmup, "paced-5000-warmup", 90*time.Second, "paced-5000: warm-up that spreads the invocations over their lives")
	fs.Float64Var(&c.warmupPhase, "paced-5000-warmup-phase", 1, "paced-5000: as -warmup-phase, for its streams")
	fs.IntVar(&c.warmupEvents, "paced-5000-warmup-events", 100, "paced-5000: a stream's first invocation starts within its first this many events too, which bounds what the warm-up sends (0: no bound)")
}

func (c *paced5000Config) validate() error {
	errs := negatives(map[string]float64{"paced-5000-streams": float64(c.streams), "paced-5000-rate": c.rate,
		"paced-5000-duration": c.duration.Seconds(), "paced-5000-warmup": c.warmup.Seconds(), "paced-5000-warmup-events": float64(c.warmupEvents)})
	if c.warmupPhase < 0 || c.warmupPhase > 1 {
		errs = append(errs, fmt.Errorf("-paced-5000-warmup-phase %v: want a fraction of the build, 0..1 (0: all of it)", c.warmupPhase))
	}
	return errors.Join(errs...)
}

// negatives names each flag whose value is negative.
func negatives(vals map[string]float64) []error {
	var errs []error
	for _, name := range slices.Sorted(maps.Keys(vals)) {
		if vals[name] < 0 {
			errs = append(errs, fmt.Errorf("-%s is negative", name))
		}
	}
	return errs
}

// pacedRun replays at a fixed rate into an edge (embedded JetStream) with
// the projector running, and measures ack latency and projection lag.
func (b *bench) pacedRun(ctx context.Context, scenario string, sp pacedSpec) (runReport, error) {
	n, rate, warmup, window := sp.streams, sp.rate, sp.warmup, sp.window
	dir, err := mkdir(b.tmp, scenario)
	if err != nil {
		return runReport{}, err
	}
	if !b.cfg.keep {
		defer os.RemoveAll(dir)
	}
	db, dbURL, err := b.pg.createDB(ctx, scenario)
	if err != nil {
		return runReport{}, err
	}
	defer b.pg.dropDB(db)
	if err := b.migrate(ctx, dbURL); err != nil {
		return runReport{}, err
	}
	natsURL, nats := "", natsEmbedded
	var natsd *proc
	if sp.natsApart {
		if natsd, natsURL, err = b.startNATSD(ctx, dir); err != nil {
			return runReport{}, err
		}
		defer natsd.stop(stopGrace)
		nats = natsApart
	}
	e, err := b.startEdge(ctx, dir, natsURL, sp.edgeEnv...)
	if err != nil {
		return runReport{}, err
	}
	defer e.p.stop(stopGrace)
	proj, projMetrics, err := b.startProjector(ctx, dir, e.natsURL, dbURL, true)
	if err != nil {
		return runReport{}, err
	}
	defer proj.stop(stopGrace)
	// Two connections of the bench's own: one polls for lag, the other
	// for the projector's position. Their backends are not the projector's
	// cost.
	var conns [2]*pgx.Conn
	var connPIDs []int
	for i := range conns {
		c, err := pgx.Connect(ctx, dbURL)
		if err != nil {
			return runReport{}, err
		}
		defer c.Close(context.Background())
		var pid int
		if err := c.QueryRow(ctx, "select pg_backend_pid()").Scan(&pid); err != nil {
			return runReport{}, err
		}
		conns[i], connPIDs = c, append(connPIDs, pid)
	}
	lagConn, conn := conns[0], conns[1]

	procs := map[string]*proc{"edge": e.p, "projector": proj}
	if natsd != nil {
		procs["natsd"] = natsd
	}
	var quiet float64
	if b.cfg.quietWait > 0 {
		quiet = waitQuiet(ctx, b.cfg.quietWait)
	}
	start := time.Now()
	measureFrom := start.Add(warmup)
	lag := newLagTracker(measureFrom)
	lagCtx, stopLag := context.WithCancel(ctx)
	lagDone := make(chan error, 1)
	go func() { lagDone <- lag.poll(lagCtx, lagConn, b.cfg.lagPoll) }()
	defer stopLag()

	// The window's CPU and PostgreSQL figures start at the end of the
	// warm-up.
	type windowStart struct {
		snap       snapshot
		meter      *pgMeter
		edge, proj promSample
		err        error
	}
	wsC := make(chan windowStart, 1)
	received := false
	defer func() {
		if received {
			return
		}
		// The run failed: let the window's goroutine finish and stop its
		// meter.
		go func() {
			if ws := <-wsC; ws.meter != nil {
				ws.meter.stop(context.Background())
			}
		}()
	}()
	go func() {
		select {
		case <-time.After(time.Until(measureFrom)):
		case <-ctx.Done():
			wsC <- windowStart{err: ctx.Err()}
			return
		}
		var ws windowStart
		ws.edge, ws.proj = scrape(e.metrics), scrape(projMetrics)
		ws.snap, ws.err = takeSnapshot(procs)
		if ws.err == nil {
			ws.meter, ws.err = b.pg.meter(ctx, db, connPIDs...)
		}
		wsC <- ws
	}()

	fmt.Printf("  %d streams at %.0f events/s: %s warm-up, then %s measured\n", n, rate, warmup, window)
	res, err := replay.Run(ctx, replay.Config{
		Target: e.bes, Scripts: b.scripts, Streams: n, Projects: projectsFor(n),
		Rate: rate, Warmup: warmup, WarmupPhase: sp.warmupPhase, WarmupEvents: sp.warmupEvents, Duration: warmup + window, Seed: 1,
		OnStreamDone: lag.done,
	})
	if err != nil {
		return runReport{}, err
	}
	edgeAfter, err := takeSnapshot(procs)
	if err != nil {
		return runReport{}, err
	}
	edgeProm := scrape(e.metrics)
	ws := <-wsC
	received = true
	if ws.meter != nil {
		defer ws.meter.stop(context.Background()) // a no-op after the stop below
	}
	if ws.err != nil {
		return runReport{}, ws.err
	}
	// The projector's and PostgreSQL's share ends once everything sent is
	// projected.
	_, last, _, err := streamState(ctx, e.natsURL)
	if err != nil {
		return runReport{}, err
	}
	if err := waitPosition(ctx, conn, proj, last, b.cfg.lagTimeout); err != nil {
		return runReport{}, err
	}
	projAfter, err := takeSnapshot(procs)
	if err != nil {
		return runReport{}, err
	}
	projProm := scrape(projMetrics)
	cost, err := ws.meter.stop(ctx)
	if err != nil {
		return runReport{}, err
	}
	lag.wait(b.cfg.lagTimeout)
	stopLag()
	<-lagDone

	run := fillRun(fmt.Sprintf("%d streams paced", n), res, n, nats, b.cfg.natsSync)
	run.Mode = "paced"
	run.TargetEventsPerS = rate
	run.WarmupAckLatency = summaryPtr(res.WarmupAck)
	events := res.WindowEvents
	edgeFig, _ := cpuFigures(ws.snap, edgeAfter, events, nil)
	projFig, machine := cpuFigures(ws.snap, projAfter, events, &cost)
	run.CPU = map[string]cpuFigure{
		"edge":                edgeFig["edge"],
		"bench_client":        edgeFig["bench_client"],
		"projector":           projFig["projector"],
		"postgres_all":        projFig["postgres_all"],
		"postgres_attributed": projFig["postgres_attributed"],
	}
	if natsd != nil {
		run.CPU["natsd"] = edgeFig["natsd"]
	}
	run.Machine = machine
	run.Machine.Load1Start = ws.snap.loadavg()
	run.Machine.OtherCoresBefore = quiet
	run.Postgres = b.pgReport(cost, events)
	run.Lag = lag.report(b.cfg.lagPoll)
	run.Server = serverReport(edgeProm.delta(ws.edge), projProm.delta(ws.proj))
	return run, nil
}

// lagTracker measures projection lag: from the moment the last event of an
// invocation's stream was acknowledged to the first poll that sees its row
// with that event applied (last_sequence) and a final status. Waiting for
// the last event, not only for the status, matters for slow streams: Bazel's
// BuildFinished comes a few events before the end, and at a few events per
// second a row can look finished seconds before the stream ends.
type lagTracker struct {
	from time.Time

	mu           sync.Mutex
	pending      map[string]replay.StreamDone
	lag, warmLag replay.Histogram
	measured     int
	empty        *sync.Cond
}

func newLagTracker(from time.Time) *lagTracker {
	l := &lagTracker{from: from, pending: map[string]replay.StreamDone{}}
	l.empty = sync.NewCond(&l.mu)
	return l
}

func (l *lagTracker) done(d replay.StreamDone) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.pending[d.InvocationID] = d
}

// maxPollIDs bounds one poll's id list.
const maxPollIDs = 5000

func (l *lagTracker) poll(ctx context.Context, conn *pgx.Conn, every time.Duration) error {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		l.mu.Lock()
		ids := make([]string, 0, min(len(l.pending), maxPollIDs))
		seqs := make([]int64, 0, cap(ids))
		for id, d := range l.pending {
			if len(ids) == maxPollIDs {
				break
			}
			ids, seqs = append(ids, id), append(seqs, d.LastSequence)
		}
		l.mu.Unlock()
		if len(ids) == 0 {
			continue
		}
		// The query's snapshot is taken when it starts: a row it sees was
		// committed before then (and after the previous poll, at worst).
		// A build is (project, invocation id), but the replay gives every
		// stream a fresh UUID, so here the id alone names one build.
		seen := time.Now()
		rows, err := conn.Query(ctx, `select i.id from invocations i
			join unnest($1::text[], $2::bigint[]) as p(id, seq) on i.id = p.id
			where i.status <> 'running' and i.last_sequence >= p.seq`, ids, seqs)
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		found, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return err
		}
		l.mu.Lock()
		for _, id := range found {
			at := l.pending[id].LastAck
			delete(l.pending, id)
			if at.Before(l.from) {
				l.warmLag.Record(seen.Sub(at))
			} else {
				l.lag.Record(seen.Sub(at))
				l.measured++
			}
		}
		if len(l.pending) == 0 {
			l.empty.Broadcast()
		}
		l.mu.Unlock()
	}
}

// wait blocks until every finished invocation was seen projected, or timeout.
func (l *lagTracker) wait(timeout time.Duration) {
	timer := time.AfterFunc(timeout, func() {
		l.mu.Lock()
		l.empty.Broadcast()
		l.mu.Unlock()
	})
	defer timer.Stop()
	deadline := time.Now().Add(timeout)
	l.mu.Lock()
	defer l.mu.Unlock()
	for len(l.pending) > 0 && time.Now().Before(deadline) {
		l.empty.Wait()
	}
}

func (l *lagTracker) report(poll time.Duration) *lagReport {
	l.mu.Lock()
	defer l.mu.Unlock()
	return &lagReport{
		Measured:       l.measured,
		NotProjected:   len(l.pending),
		PollIntervalMS: float64(poll) / 1e6,
		Lag:            l.lag.Summary(),
		WarmupLag:      l.warmLag.Summary(),
	}
}
