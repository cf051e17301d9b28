package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/loadtest/balancer"
	"github.com/millrace/millrace/loadtest/replay"
)

// scEdgesRolling: several edges behind a balancer, restarted one after the
// other under paced builds.
const scEdgesRolling = "edges-rolling"

type rollingConfig struct {
	edges, streams, builds int
	rate                   float64
	first, apart           time.Duration
	shutdown               time.Duration
}

func (c *rollingConfig) register(fs *flag.FlagSet) {
	fs.IntVar(&c.edges, "rolling-edges", 2, "edges-rolling: BES edges behind the balancer")
	fs.IntVar(&c.streams, "rolling-streams", 200, "edges-rolling: concurrent paced builds, each on its own connection")
	fs.IntVar(&c.builds, "rolling-builds", 600, "edges-rolling: builds to complete in all")
	fs.Float64Var(&c.rate, "rolling-rate", 1500, "edges-rolling: total events/s over all streams")
	fs.DurationVar(&c.first, "rolling-first", 15*time.Second, "edges-rolling: when the first edge is restarted")
	fs.DurationVar(&c.apart, "rolling-apart", 10*time.Second, "edges-rolling: from one edge back to the next one's restart")
	fs.DurationVar(&c.shutdown, "rolling-shutdown", 5*time.Second, "edges-rolling: the edges' MILLRACE_SHUTDOWN_TIMEOUT (open streams are cut then; their clients resume)")
}

func (c *rollingConfig) validate() error {
	errs := negatives(map[string]float64{"rolling-streams": float64(c.streams), "rolling-builds": float64(c.builds), "rolling-rate": c.rate,
		"rolling-first": c.first.Seconds(), "rolling-apart": c.apart.Seconds(), "rolling-shutdown": c.shutdown.Seconds()})
	if c.edges < 2 {
		errs = append(errs, fmt.Errorf("-rolling-edges %d: a rolling restart needs at least 2", c.edges))
	}
	return errors.Join(errs...)
}

// rollingReport is what edges-rolling measured.
type rollingReport struct {
	Edges    int              `json:"edges"`
	Restarts []restartFigures `json:"restarts"`
	// AckDuringRestarts are the acks of events first sent from a restart's
	// SIGTERM until the edge was ready again plus 2 s (its clients' resumes
	// included), AckOutside the rest.
	AckDuringRestarts replay.Summary `json:"ack_latency_during_restarts"`
	AckOutside        replay.Summary `json:"ack_latency_outside_restarts"`
	// ProjectedEvents and ProjectedBuilds are the load's tool events and
	// finished builds in the projection at the end.
	ProjectedEvents int64 `json:"projected_tool_events"`
	ProjectedBuilds int64 `json:"projected_builds"`
	// Connections the balancer gave each edge, and those no edge took.
	Connections map[string]int `json:"balancer_connections"`
	Refused     int            `json:"balancer_refused"`
}

type restartFigures struct {
	Edge int `json:"edge"`
	// AtS is the SIGTERM's time into the run; StopS how long the process
	// took to exit; ReadyS from the SIGTERM until the new process was ready.
	AtS    float64 `json:"at_s"`
	StopS  float64 `json:"stop_s"`
	ReadyS float64 `json:"ready_s"`
}

// rollingScenario runs the edges on natsd with the builds projector, the
// balancer in front, and the load generator's paced builds through it
// while the edges restart one by one.
func (b *bench) rollingScenario(ctx context.Context, rep *scenarioReport) error {
	c := b.cfg.rolling
	rep.Description = fmt.Sprintf("%d `millrace serve bes` behind a TCP balancer on one natsd, `millrace project builds`; %d paced builds resume (as Bazel) while the edges restart one after the other", c.edges, c.builds)
	dir, err := mkdir(b.tmp, scEdgesRolling)
	if err != nil {
		return err
	}
	if !b.cfg.keep {
		defer os.RemoveAll(dir)
	}
	db, dbURL, err := b.pg.createDB(ctx, scEdgesRolling)
	if err != nil {
		return err
	}
	defer b.pg.dropDB(db)
	if err := b.migrate(ctx, dbURL); err != nil {
		return err
	}
	natsd, natsURL, err := b.startNATSD(ctx, dir)
	if err != nil {
		return err
	}
	defer natsd.stop(stopGrace)
	var edges []*edge
	var backends []string
	for i := range c.edges {
		edir, err := mkdir(dir, fmt.Sprintf("edge-%d", i+1))
		if err != nil {
			return err
		}
		e, err := b.startEdge(ctx, edir, natsURL, "MILLRACE_SHUTDOWN_TIMEOUT="+c.shutdown.String())
		if err != nil {
			return err
		}
		defer func() { e.p.stop(stopGrace) }()
		edges, backends = append(edges, e), append(backends, e.bes)
	}
	proj, _, err := b.startProjector(ctx, dir, natsURL, dbURL, true)
	if err != nil {
		return err
	}
	defer proj.stop(stopGrace)
	bal, err := balancer.Start("127.0.0.1:0", backends...)
	if err != nil {
		return err
	}
	defer bal.Close()

	const step = 250 * time.Millisecond
	start := time.Now()
	type window struct{ from, to time.Duration }
	var windows []window
	restarts := make(chan error, 1)
	go func() {
		var rs []restartFigures
		next := c.first
		for i, e := range edges {
			if d := time.Until(start.Add(next)); d > 0 {
				select {
				case <-time.After(d):
				case <-ctx.Done():
					restarts <- ctx.Err()
					return
				}
			}
			at := time.Now()
			e.p.stop(stopGrace) // a cut at the shutdown timeout is the point; its exit status is not
			stopped := time.Now()
			if err := b.restartEdge(ctx, e); err != nil {
				restarts <- fmt.Errorf("edge %d: %w", i+1, err)
				return
			}
			ready := time.Now()
			rs = append(rs, restartFigures{Edge: i + 1, AtS: round(at.Sub(start).Seconds(), 2),
				StopS: round(stopped.Sub(at).Seconds(), 2), ReadyS: round(ready.Sub(at).Seconds(), 2)})
			windows = append(windows, window{at.Sub(start), ready.Sub(start) + 2*time.Second})
			fmt.Printf("  edge %d: SIGTERM at %.1f s, exited after %.1f s, ready again %.1f s after the SIGTERM\n",
				i+1, at.Sub(start).Seconds(), stopped.Sub(at).Seconds(), ready.Sub(at).Seconds())
			next = ready.Sub(start) + c.apart
		}
		rep.Rolling = &rollingReport{Edges: c.edges, Restarts: rs}
		restarts <- nil
	}()

	fmt.Printf("  %d builds over %d streams at %.0f events/s through %d edges\n", c.builds, c.streams, c.rate, c.edges)
	res, err := replay.Run(ctx, replay.Config{Target: bal.Addr(), Scripts: b.scripts, Streams: c.streams, Projects: projectsFor(c.streams),
		Rate: c.rate, Events: eventsFor(b.scripts, c.builds), Seed: 1, SeriesStep: step})
	if err != nil {
		return err
	}
	if err := <-restarts; err != nil {
		return err
	}
	run := fillRun(fmt.Sprintf("%d builds, %d streams paced, %d edges", c.builds, c.streams, c.edges), res, c.streams, natsApart, b.cfg.natsSync)
	run.Mode = "paced"
	run.TargetEventsPerS = c.rate
	rep.Runs = append(rep.Runs, run)
	b.printRun(run)

	during, outside := new(replay.Histogram), new(replay.Histogram)
	for i, h := range res.AckSeries {
		at := time.Duration(i) * step
		in := false
		for _, w := range windows {
			in = in || (at+step > w.from && at <= w.to)
		}
		if in {
			during.Merge(h)
		} else {
			outside.Merge(h)
		}
	}
	rr := rep.Rolling
	rr.AckDuringRestarts, rr.AckOutside = during.Summary(), outside.Summary()
	rr.Connections, rr.Refused = bal.Served()

	// Every acknowledged event projected once, every build complete.
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())
	deadline := time.Now().Add(b.cfg.lagTimeout)
	for {
		err := conn.QueryRow(ctx, "select count(*) filter (where status <> 'running'), coalesce(sum(event_count), 0) from invocations").
			Scan(&rr.ProjectedBuilds, &rr.ProjectedEvents)
		if err != nil {
			return err
		}
		if rr.ProjectedBuilds >= res.Invocations && rr.ProjectedEvents >= res.ToolEvents || time.Now().After(deadline) {
			break
		}
		time.Sleep(200 * time.Millisecond)
	}
	rep.Checks = append(rep.Checks,
		exactly(scEdgesRolling+": builds failed or cut short", float64(res.Failed+res.Truncated), 0, "builds",
			fmt.Sprintf("%d complete; errors %v", res.Invocations, res.Errors)),
		exactly(scEdgesRolling+": builds projected finished", float64(rr.ProjectedBuilds), float64(res.Invocations), "builds", ""),
		exactly(scEdgesRolling+": acknowledged tool events projected, once each", float64(rr.ProjectedEvents), float64(res.ToolEvents), "events", ""),
		atLeast(scEdgesRolling+": streams resumed after a restart cut them", float64(res.Resumed), 1, "streams",
			"0 would mean the restarts cut no stream, and tested nothing"),
	)
	fmt.Printf("  acks during the restarts: p50 %.1f ms, p99 %.1f ms, max %.1f ms (%d); outside: p99 %.1f ms (%d); %d streams resumed\n",
		rr.AckDuringRestarts.P50MS, rr.AckDuringRestarts.P99MS, rr.AckDuringRestarts.MaxMS, rr.AckDuringRestarts.Count,
		rr.AckOutside.P99MS, rr.AckOutside.Count, res.Resumed)
	return nil
}

// eventsFor is the event budget that starts n builds of scripts, taken
// round robin (replay.Config.Events stops starting builds once the builds
// started hold that many).
func eventsFor(scripts []*replay.Script, n int) int64 {
	var total int64
	for i := range n - 1 {
		total += int64(scripts[i%len(scripts)].Events())
	}
	return total + 1
}
