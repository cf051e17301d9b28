package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/loadtest/replay"
	"github.com/millrace/millrace/subjects"
)

// scProjectorsPartitioned: the builds projector scaled out over partitions
// of build events, with 1, 2 and 4 instances sharing them.
const scProjectorsPartitioned = "projectors-partitioned"

type partitionedConfig struct {
	partitions   int
	instances    string
	events       int64
	streams      int
	pacedStreams int
	pacedRate    float64
	pacedFor     time.Duration
	rounds       int
}

func (c *partitionedConfig) register(fs *flag.FlagSet) {
	fs.IntVar(&c.partitions, "partitioned-partitions", 4, "projectors-partitioned: partitions of build events (--bes-partitions)")
	fs.StringVar(&c.instances, "partitioned-instances", "1,2,4", "projectors-partitioned: how many `project builds` share the partitions, one run each")
	fs.Int64Var(&c.events, "partitioned-events", 200_000, "projectors-partitioned: events stored, then drained by each run")
	fs.IntVar(&c.streams, "partitioned-streams", 200, "projectors-partitioned: concurrent streams that store them")
	fs.IntVar(&c.pacedStreams, "partitioned-paced-streams", 300, "projectors-partitioned: concurrent paced builds of each live run")
	fs.Float64Var(&c.pacedRate, "partitioned-paced-rate", 2000, "projectors-partitioned: events/s of each live run, over all its streams")
	fs.DurationVar(&c.pacedFor, "partitioned-paced-for", 40*time.Second, "projectors-partitioned: how long each live run sends (the first quarter a warm-up)")
	fs.IntVar(&c.rounds, "partitioned-rounds", 3, "projectors-partitioned: rounds; the instance counts take turns, in reverse order every other round")
}

// counts are the instance counts of -partitioned-instances.
func (c *partitionedConfig) counts() ([]int, error) {
	var out []int
	for _, f := range strings.Split(c.instances, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 || n > c.partitions {
			return nil, fmt.Errorf("-partitioned-instances %q: counts from 1 to the partitions (%d), comma-separated", c.instances, c.partitions)
		}
		out = append(out, n)
	}
	return out, nil
}

func (c *partitionedConfig) validate() error {
	errs := negatives(map[string]float64{"partitioned-events": float64(c.events), "partitioned-streams": float64(c.streams),
		"partitioned-paced-streams": float64(c.pacedStreams), "partitioned-paced-rate": c.pacedRate, "partitioned-paced-for": c.pacedFor.Seconds()})
	if c.partitions < 2 || c.partitions > 64 {
		errs = append(errs, fmt.Errorf("-partitioned-partitions %d: from 2 to 64", c.partitions))
	}
	if c.rounds < 1 {
		errs = append(errs, fmt.Errorf("-partitioned-rounds %d: at least 1", c.rounds))
	}
	if _, err := c.counts(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// partitionedReport is what projectors-partitioned measured: per instance
// count, the medians over the rounds.
type partitionedReport struct {
	Partitions int                  `json:"partitions"`
	Rounds     int                  `json:"rounds"`
	Runs       []partitionedFigures `json:"instances"`
}

type partitionedFigures struct {
	Instances int `json:"instances"`
	// Drain: the projectors, started on standby, take the whole stream
	// from its start into a fresh database: DrainEvents, the stored events
	// and those each live run before added.
	DrainEvents     int64   `json:"drain_events"`
	DrainEventsPerS float64 `json:"drain_events_per_s"`
	// CPU per 100k events drained: the projector processes together,
	// PostgreSQL's backends of the run's database, the NATS server.
	DrainProjectorCPUPer100k float64 `json:"drain_projector_cpu_s_per_100k"`
	DrainPostgresCPUPer100k  float64 `json:"drain_postgres_cpu_s_per_100k"`
	DrainNATSCPUPer100k      float64 `json:"drain_natsd_cpu_s_per_100k"`
	// Live: paced builds while the projectors run; the lag from a build's
	// last acknowledged event to its row showing it applied and finished,
	// and the projectors' CPU per 100k events sent meanwhile. Each
	// instance also costs CPU with no event at all (its timers, pulls
	// waiting at the server, the group's heartbeats): IdleCores is what
	// they took together in IdleFor before the builds began, and
	// LiveProjectorCPUPer100kNet the CPU per event less that.
	LiveEvents                 int64          `json:"live_events"`
	LiveLag                    replay.Summary `json:"live_lag"`
	LiveProjectorCPUPer100k    float64        `json:"live_projector_cpu_s_per_100k"`
	IdleCores                  float64        `json:"idle_projector_cores"`
	LiveProjectorCPUPer100kNet float64        `json:"live_projector_cpu_s_per_100k_less_idle"`
}

// idleFor is how long the idle cost of the instances is measured.
const idleFor = 10 * time.Second

// partitionedScenario fills partitioned streams through an edge on natsd,
// then, for each instance count in turn, drains them into a fresh
// database and runs paced builds through it, with that many `project
// builds` sharing the partitions.
func (b *bench) partitionedScenario(ctx context.Context, rep *scenarioReport) error {
	c := b.cfg.partitioned
	counts, err := c.counts()
	if err != nil {
		return err
	}
	rep.Description = fmt.Sprintf("build events in %d partitions on natsd; %s `millrace project builds` share them: a drain of %d stored events into a fresh database, then %.0f paced events/s over %d builds; medians of %d rounds taking turns",
		c.partitions, c.instances, c.events, c.pacedRate, c.pacedStreams, c.rounds)
	dir, err := mkdir(b.tmp, scProjectorsPartitioned)
	if err != nil {
		return err
	}
	natsd, url, err := b.startNATSD(ctx, dir)
	if err != nil {
		return err
	}
	defer natsd.stop(stopGrace)
	part := fmt.Sprintf("MILLRACE_BES_PARTITIONS=%d", c.partitions)
	e, err := b.startEdge(ctx, dir, url, part)
	if err != nil {
		return err
	}
	defer func() { e.p.stop(stopGrace) }()
	fmt.Printf("  storing %d events over %d streams in %d partitions\n", c.events, c.streams, c.partitions)
	if _, err := replay.Run(ctx, replay.Config{Target: e.bes, Scripts: b.scripts, Streams: c.streams, Projects: projectsFor(c.streams), Events: c.events, Seed: 1}); err != nil {
		return err
	}
	r := &partitionedReport{Partitions: c.partitions, Rounds: c.rounds}
	byCount := map[int][]partitionedFigures{}
	for round := range c.rounds {
		order := slices.Clone(counts)
		if round%2 == 1 {
			slices.Reverse(order)
		}
		for _, k := range order {
			f, err := b.partitionedRun(ctx, dir, url, e, k, natsd)
			if err != nil {
				return err
			}
			byCount[k] = append(byCount[k], f)
			fmt.Printf("  %d instances: drain of %d events %.0f events/s, projectors %.2f CPU-s/100k (PostgreSQL %.2f, natsd %.2f); live lag p50 %.0f ms p99 %.0f ms, projectors %.2f CPU-s/100k (%.2f less %.3f idle cores)\n",
				k, f.DrainEvents, f.DrainEventsPerS, f.DrainProjectorCPUPer100k, f.DrainPostgresCPUPer100k, f.DrainNATSCPUPer100k, f.LiveLag.P50MS, f.LiveLag.P99MS, f.LiveProjectorCPUPer100k, f.LiveProjectorCPUPer100kNet, f.IdleCores)
		}
	}
	for _, k := range counts {
		r.Runs = append(r.Runs, medianFigures(k, byCount[k]))
	}
	rep.Partitioned = r
	one := r.Runs[0]
	for _, f := range r.Runs[1:] {
		rep.Checks = append(rep.Checks,
			atMost(fmt.Sprintf("%s: drain projector CPU per event, %d instances over %d", scProjectorsPartitioned, f.Instances, one.Instances),
				f.DrainProjectorCPUPer100k/one.DrainProjectorCPUPer100k, 1.15, "ratio", "CPU per event unchanged as instances are added (within 15 %)"),
			atMost(fmt.Sprintf("%s: live projector CPU per event less idle, %d instances over %d", scProjectorsPartitioned, f.Instances, one.Instances),
				f.LiveProjectorCPUPer100kNet/one.LiveProjectorCPUPer100kNet, 1.15, "ratio", "paced: each instance's idle cost apart (idle_projector_cores)"),
			atMost(fmt.Sprintf("%s: live lag p99, %d instances", scProjectorsPartitioned, f.Instances), f.LiveLag.P99MS/1000, pacedLagP99TargetS, "s", ""))
	}
	rep.Checks = append(rep.Checks, atMost(fmt.Sprintf("%s: live lag p99, %d instance", scProjectorsPartitioned, one.Instances), one.LiveLag.P99MS/1000, pacedLagP99TargetS, "s", ""))
	return nil
}

// partitionedRun is one instance count's drain and live run, each on a
// fresh database.
func (b *bench) partitionedRun(ctx context.Context, dir, url string, e *edge, k int, natsd *proc) (partitionedFigures, error) {
	f := partitionedFigures{Instances: k}
	lasts, err := partitionLasts(ctx, url, b.cfg.partitioned.partitions)
	if err != nil {
		return f, err
	}
	var stored int64
	for _, n := range lasts {
		stored += int64(n)
	}
	// The drain: every partition paused while the instances start and
	// join, so that each applies from the start only the partitions that
	// fall to it.
	d, err := b.partitionedDB(ctx, fmt.Sprintf("%s-drain-%d", scProjectorsPartitioned, k), func(conn *pgx.Conn) error {
		_, err := conn.Exec(ctx, `insert into consumer_paused (consumer_group, partition, paused_by) select 'builds', p, 'bench' from generate_series(0, $1 - 1) p`, len(lasts))
		return err
	})
	if err != nil {
		return f, err
	}
	defer d.close()
	procs, err := b.startPartitioned(ctx, dir, url, d, k, "drain")
	if err != nil {
		return f, err
	}
	defer stopAll(procs)
	natsBefore, _ := natsd.cpu()
	before := cpuOf(procs)
	meter, err := b.pg.meter(ctx, d.name, d.pid)
	if err != nil {
		return f, err
	}
	began := time.Now()
	if _, err := d.conn.Exec(ctx, `delete from consumer_paused where paused_by = 'bench'`); err != nil {
		return f, err
	}
	if err := waitPartitions(ctx, d.conn, lasts, procs, b.cfg.drainTimeout); err != nil {
		return f, err
	}
	elapsed := time.Since(began)
	projCPU := cpuOf(procs) - before
	natsAfter, _ := natsd.cpu()
	cost, err := meter.stop(ctx)
	if err != nil {
		return f, err
	}
	stopAll(procs)
	per100k := func(d time.Duration) float64 { return round(d.Seconds()/float64(stored)*100_000, 3) }
	f.DrainEvents, f.DrainEventsPerS = stored, math.Round(float64(stored)/elapsed.Seconds())
	f.DrainProjectorCPUPer100k, f.DrainPostgresCPUPer100k, f.DrainNATSCPUPer100k = per100k(projCPU), per100k(cost.CPUAttributed), per100k(natsAfter-natsBefore)

	// The live run: the projectors start at the streams' ends (their
	// positions written there), join, and follow paced builds.
	lasts, err = partitionLasts(ctx, url, len(lasts))
	if err != nil {
		return f, err
	}
	l, err := b.partitionedDB(ctx, fmt.Sprintf("%s-live-%d", scProjectorsPartitioned, k), func(conn *pgx.Conn) error {
		for p, last := range lasts {
			if _, err := conn.Exec(ctx, `insert into consumer_positions (consumer, stream, stream_seq) values ($1, $2, $3)`,
				fmt.Sprintf("builds_%d", p), fmt.Sprintf("BES_%d", p), int64(last)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return f, err
	}
	defer l.close()
	procs, err = b.startPartitioned(ctx, dir, url, l, k, "live")
	if err != nil {
		return f, err
	}
	defer stopAll(procs)
	if err := waitMembers(ctx, l.conn, k); err != nil {
		return f, err
	}
	idle := cpuOf(procs)
	select {
	case <-time.After(idleFor):
	case <-ctx.Done():
		return f, ctx.Err()
	}
	idleRate := (cpuOf(procs) - idle).Seconds() / idleFor.Seconds()
	lag, res, cpu, window, err := b.partitionedLive(ctx, e, l, procs)
	if err != nil {
		return f, err
	}
	events := float64(max(res.WindowEvents, 1))
	f.LiveEvents, f.LiveLag, f.IdleCores = res.WindowEvents, lag, round(idleRate, 4)
	f.LiveProjectorCPUPer100k = round(cpu.Seconds()/events*100_000, 3)
	f.LiveProjectorCPUPer100kNet = round((cpu.Seconds()-idleRate*window.Seconds())/events*100_000, 3)
	return f, nil
}

// partitionedLive sends the paced builds and returns the lag, what was
// sent, and the projectors' CPU from the end of the warm-up until every
// build was seen projected (the window's events: WindowEvents).
func (b *bench) partitionedLive(ctx context.Context, e *edge, d *partitionedDBConn, procs []*proc) (lagSum replay.Summary, res *replay.Result, cpu, window time.Duration, err error) {
	c := b.cfg.partitioned
	warmup := c.pacedFor / 4
	start := time.Now()
	lag := newLagTracker(start.Add(warmup))
	lagConn, err := pgx.Connect(ctx, d.url)
	if err != nil {
		return lagSum, nil, 0, 0, err
	}
	defer lagConn.Close(context.Background())
	lagCtx, stopLag := context.WithCancel(ctx)
	defer stopLag()
	go lag.poll(lagCtx, lagConn, b.cfg.lagPoll)
	type sample struct {
		cpu time.Duration
		at  time.Time
	}
	beforeC := make(chan sample, 1)
	cpuAt := time.AfterFunc(warmup, func() { beforeC <- sample{cpuOf(procs), time.Now()} })
	defer cpuAt.Stop()
	res, err = replay.Run(ctx, replay.Config{Target: e.bes, Scripts: b.scripts, Streams: c.pacedStreams, Projects: projectsFor(c.pacedStreams),
		Rate: c.pacedRate, Warmup: warmup, Duration: c.pacedFor, Seed: 7, OnStreamDone: lag.done})
	if err != nil {
		return lagSum, nil, 0, 0, err
	}
	lag.wait(30 * time.Second)
	before := <-beforeC
	cpu, window = cpuOf(procs)-before.cpu, time.Since(before.at)
	lag.mu.Lock()
	defer lag.mu.Unlock()
	return lag.lag.Summary(), res, cpu, window, nil
}

// partitionedDBConn is a run's database and the bench's connection to it.
type partitionedDBConn struct {
	b         *bench
	name, url string
	conn      *pgx.Conn
	pid       int
}

func (d *partitionedDBConn) close() {
	d.conn.Close(context.Background())
	d.b.pg.dropDB(d.name)
}

// partitionedDB makes a migrated database, and prepares it with prep.
func (b *bench) partitionedDB(ctx context.Context, label string, prep func(*pgx.Conn) error) (*partitionedDBConn, error) {
	name, url, err := b.pg.createDB(ctx, label)
	if err != nil {
		return nil, err
	}
	d := &partitionedDBConn{b: b, name: name, url: url}
	if err := b.migrate(ctx, url); err != nil {
		b.pg.dropDB(name)
		return nil, err
	}
	if d.conn, err = pgx.Connect(ctx, url); err != nil {
		b.pg.dropDB(name)
		return nil, err
	}
	err = d.conn.QueryRow(ctx, "select pg_backend_pid()").Scan(&d.pid)
	if err == nil {
		err = prep(d.conn)
	}
	if err != nil {
		d.close()
		return nil, err
	}
	return d, nil
}

// startPartitioned starts k `project builds` (no archiver: the projector
// alone is measured) on the run's database and waits until each is ready.
func (b *bench) startPartitioned(ctx context.Context, dir, url string, d *partitionedDBConn, k int, label string) ([]*proc, error) {
	var procs []*proc
	for i := range k {
		web, err := freeAddr()
		if err != nil {
			stopAll(procs)
			return nil, err
		}
		env := append([]string{"DATABASE_URL=" + d.url, "MILLRACE_HTTP_LISTEN=" + web, "MILLRACE_ARCHIVE_AFTER=-1s",
			fmt.Sprintf("MILLRACE_BES_PARTITIONS=%d", b.cfg.partitioned.partitions), "MILLRACE_BUILDS_GROUP_HEARTBEAT=250ms"}, natsEnv(url)...)
		p, err := startProc(fmt.Sprintf("projector-%d", i), b.cfg.bin, []string{"project", "builds"}, env,
			filepath.Join(dir, fmt.Sprintf("projector-%s-%d-of-%d.log", label, i+1, k)))
		if err != nil {
			stopAll(procs)
			return nil, err
		}
		procs = append(procs, p)
		if err := waitReady(ctx, p, "http://"+web+"/readyz", readyTimeout); err != nil {
			stopAll(procs)
			return nil, err
		}
	}
	if err := waitMembers(ctx, d.conn, k); err != nil {
		stopAll(procs)
		return nil, err
	}
	return procs, nil
}

func stopAll(procs []*proc) {
	for _, p := range procs {
		p.stop(stopGrace)
	}
}

// cpuOf is the CPU the processes have used so far.
func cpuOf(procs []*proc) time.Duration {
	var sum time.Duration
	for _, p := range procs {
		t, _ := p.cpu()
		sum += t
	}
	return sum
}

// waitMembers waits until the builds projectors' group has k live
// members, and for two heartbeats more, so that each runs its partitions.
func waitMembers(ctx context.Context, conn *pgx.Conn, k int) error {
	deadline := time.Now().Add(readyTimeout)
	for {
		var n int
		err := conn.QueryRow(ctx, `select count(*) from consumer_members where consumer_group = 'builds' and seen_at > now() - interval '1 second'`).Scan(&n)
		if err == nil && n == k {
			time.Sleep(500 * time.Millisecond)
			return nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("the builds projectors' group has %d live members, want %d (%v)", n, k, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// partitionLasts are the last sequences of the partitions' streams.
func partitionLasts(ctx context.Context, url string, n int) ([]uint64, error) {
	nc, err := nats.Connect(url, natsOptions(url)...)
	if err != nil {
		return nil, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, err
	}
	l := subjects.BESLayout{Partitions: n}
	out := make([]uint64, n)
	for p := range out {
		s, err := js.Stream(ctx, l.Stream(p))
		if err != nil {
			return nil, err
		}
		out[p] = s.CachedInfo().State.LastSeq
	}
	return out, nil
}

// waitPartitions waits until every partition's position reaches its
// stream's last sequence.
func waitPartitions(ctx context.Context, conn *pgx.Conn, lasts []uint64, procs []*proc, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		done := 0
		for p, last := range lasts {
			var pos int64
			err := conn.QueryRow(ctx, `select stream_seq from consumer_positions where consumer = $1`, fmt.Sprintf("builds_%d", p)).Scan(&pos)
			if err == nil && uint64(pos) >= last {
				done++
			}
		}
		if done == len(lasts) {
			return nil
		}
		for _, p := range procs {
			if p.exited() {
				return fmt.Errorf("%s exited: %v (log: %s)\n%s", p.name, p.exitErr(), p.log, p.tail(10))
			}
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return fmt.Errorf("%d of %d partitions drained within %s", done, len(lasts), timeout)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// medianFigures are the median of each figure over the rounds.
func medianFigures(k int, fs []partitionedFigures) partitionedFigures {
	med := func(get func(partitionedFigures) float64) float64 { return round(medianOf(fs, get), 3) }
	out := partitionedFigures{Instances: k}
	out.DrainEvents = int64(med(func(f partitionedFigures) float64 { return float64(f.DrainEvents) }))
	out.DrainEventsPerS = math.Round(med(func(f partitionedFigures) float64 { return f.DrainEventsPerS }))
	out.DrainProjectorCPUPer100k = med(func(f partitionedFigures) float64 { return f.DrainProjectorCPUPer100k })
	out.DrainPostgresCPUPer100k = med(func(f partitionedFigures) float64 { return f.DrainPostgresCPUPer100k })
	out.DrainNATSCPUPer100k = med(func(f partitionedFigures) float64 { return f.DrainNATSCPUPer100k })
	out.LiveEvents = int64(med(func(f partitionedFigures) float64 { return float64(f.LiveEvents) }))
	out.LiveProjectorCPUPer100k = med(func(f partitionedFigures) float64 { return f.LiveProjectorCPUPer100k })
	out.IdleCores = med(func(f partitionedFigures) float64 { return f.IdleCores })
	out.LiveProjectorCPUPer100kNet = med(func(f partitionedFigures) float64 { return f.LiveProjectorCPUPer100kNet })
	out.LiveLag = replay.Summary{
		Count: uint64(med(func(f partitionedFigures) float64 { return float64(f.LiveLag.Count) })),
		P50MS: med(func(f partitionedFigures) float64 { return f.LiveLag.P50MS }),
		P99MS: med(func(f partitionedFigures) float64 { return f.LiveLag.P99MS }),
		MaxMS: med(func(f partitionedFigures) float64 { return f.LiveLag.MaxMS }),
	}
	return out
}
