package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"math"
	"net/url"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/loadtest/synth"
	"github.com/millrace/millrace/projectors/builds"
)

// million-events: one invocation of a million events (loadtest/synth, made
// up as it is sent) through `millrace serve bes` (JetStream in natsd) and
// `millrace project builds`, each its own process, so that each one's peak
// resident set is its own (VmHWM, reset when the invocation starts). Then
// the paged reads of projectors/builds on the finished build, each timed.
const scMillionEvents = "million-events"

// readLimit is the most a paged read may take on the finished build.
const readLimit = 100 * time.Millisecond

type millionConfig struct {
	events      int
	outputBytes int
	readRuns    int
}

func (c *millionConfig) register(fs *flag.FlagSet) {
	fs.IntVar(&c.events, "million-events", 1_000_000, "million-events: tool events of the one invocation")
	fs.IntVar(&c.outputBytes, "million-output-bytes", synth.DefaultOutputBytes, "million-events: console output per progress event (two in ten events)")
	fs.IntVar(&c.readRuns, "million-read-runs", 5, "million-events: times each read function is timed (the worst counts)")
}

// millionReport is the scenario's figures.
type millionReport struct {
	Events      int   `json:"events"` // tool events of the invocation
	Targets     int   `json:"targets"`
	Tests       int   `json:"tests"`
	OutputBytes int64 `json:"output_bytes"` // folded console output, both streams
	OutputPages int32 `json:"output_pages"`

	SendS      float64 `json:"send_s"` // first event sent to last ack
	EventsPerS float64 `json:"events_per_s"`
	// ProjectorLagS is how long after the last ack the projector had
	// committed the invocation's last event.
	ProjectorLagS float64 `json:"projector_lag_s"`

	PeakRSSKiB      map[string]int64   `json:"peak_rss_kib"`        // edge, projector, natsd
	CPUSPer1kEvents map[string]float64 `json:"cpu_s_per_1k_events"` // edge, projector, natsd
	ReadsMs         map[string]float64 `json:"reads_ms"`            // worst of the runs
	ReadsFirstMs    map[string]float64 `json:"reads_first_ms"`      // the first run (cold)
	ShowJSONMs      float64            `json:"show_json_ms"`        // builds show --json, streamed to nowhere
	ShowJSONBytes   int64              `json:"show_json_bytes"`
	// PagesMs are the console's pages of the build (millionPages).
	PagesMs map[string]pageFigure `json:"console_pages"`
}

func (b *bench) millionScenario(ctx context.Context, rep *scenarioReport) error {
	mc := b.cfg.million
	build := synth.Build{Events: mc.events, OutputBytes: mc.outputBytes}
	if err := build.Validate(); err != nil {
		return err
	}
	rep.Description = fmt.Sprintf("one invocation of %d events (made up, loadtest/synth) through `millrace serve bes --nats-url` (natsd apart) "+
		"and `millrace project builds`, each its own process: peak RSS of each, events/s, CPU per event, projector lag; "+
		"then each paged read of projectors/builds on the finished build, timed", mc.events)
	dir, err := mkdir(b.tmp, scMillionEvents)
	if err != nil {
		return err
	}
	natsd, natsURL, err := b.startNATSD(ctx, dir)
	if err != nil {
		return err
	}
	defer natsd.stop(stopGrace)
	e, err := b.startEdge(ctx, dir, natsURL)
	if err != nil {
		return err
	}
	defer e.p.stop(stopGrace)
	db, dbURL, err := b.pg.createDB(ctx, scMillionEvents)
	if err != nil {
		return err
	}
	defer b.pg.dropDB(db)
	if err := b.migrate(ctx, dbURL); err != nil {
		return err
	}
	proj, _, err := b.startProjector(ctx, dir, natsURL, dbURL, true)
	if err != nil {
		return err
	}
	defer proj.stop(stopGrace)
	conn, err := pgx.Connect(ctx, dbURL)
	if err != nil {
		return err
	}
	defer conn.Close(context.Background())

	procs := map[string]*proc{"edge": e.p, "projector": proj, "natsd": natsd}
	for _, p := range procs {
		if err := resetHWM(p.pid()); err != nil {
			return fmt.Errorf("reset the peak RSS of %s: %w", p.name, err)
		}
	}
	before, err := takeSnapshot(procs)
	if err != nil {
		return err
	}
	gc, err := grpc.NewClient(e.bes, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer gc.Close()
	ids := synth.IDs{Project: "bench", BuildID: "million-build", InvocationID: "million-" + time.Now().UTC().Format("150405")}
	fmt.Printf("bench: %s: sending %d events\n", scMillionEvents, mc.events)
	start := time.Now()
	if err := synth.Send(ctx, buildpb.NewPublishBuildEventClient(gc), ids, build); err != nil {
		return err
	}
	sent := time.Since(start)
	_, last, _, err := streamState(ctx, natsURL)
	if err != nil {
		return err
	}
	if err := waitPosition(ctx, conn, proj, last, b.cfg.drainTimeout); err != nil {
		return err
	}
	lag := time.Since(start) - sent
	after, err := takeSnapshot(procs)
	if err != nil {
		return err
	}
	m := &millionReport{Events: mc.events, Targets: build.Targets(), Tests: build.Tests(),
		SendS: round(sent.Seconds(), 2), EventsPerS: math.Round(float64(mc.events) / sent.Seconds()),
		ProjectorLagS: round(lag.Seconds(), 2),
		PeakRSSKiB:    map[string]int64{}, CPUSPer1kEvents: map[string]float64{},
		ReadsMs: map[string]float64{}, ReadsFirstMs: map[string]float64{}}
	for name, p := range procs {
		st, err := readMemStatus(p.pid())
		if err != nil {
			return fmt.Errorf("peak RSS of %s: %w", name, err)
		}
		m.PeakRSSKiB[name] = st.hwm
		m.CPUSPer1kEvents[name] = roundFigure((after.procs[name]-before.procs[name]).Seconds()*1000/float64(mc.events), 3)
	}
	fmt.Printf("bench: %s: %d events in %.1f s (%.0f/s), projected %.1f s after the last ack; peak RSS edge %d MiB, projector %d MiB, natsd %d MiB\n",
		scMillionEvents, mc.events, sent.Seconds(), m.EventsPerS, lag.Seconds(),
		m.PeakRSSKiB["edge"]>>10, m.PeakRSSKiB["projector"]>>10, m.PeakRSSKiB["natsd"]>>10)

	if err := b.millionReads(ctx, conn, dbURL, ids, build, m, rep); err != nil {
		return err
	}
	rep.Million = m
	return nil
}

// millionReads checks the projection of the finished build and times each
// paged read on it.
func (b *bench) millionReads(ctx context.Context, conn *pgx.Conn, dbURL string, ids synth.IDs, build synth.Build, m *millionReport, rep *scenarioReport) error {
	var status string
	var events, targets, tests int64
	if err := conn.QueryRow(ctx, `select status, event_count,
		(select count(*) from all_targets t where t.build_key = i.build_key),
		(select count(*) from all_tests t where t.build_key = i.build_key)
		from invocations i where id = $1 and project = $2`, ids.InvocationID, ids.Project).Scan(&status, &events, &targets, &tests); err != nil {
		return fmt.Errorf("the projected build: %w", err)
	}
	rep.Checks = append(rep.Checks, check{Name: scMillionEvents + ": the build is projected whole (events, targets, tests)",
		Value: float64(events), Unit: "events", Target: fmt.Sprintf("%d events, %d targets, %d tests", build.Events, build.Targets(), build.Tests()),
		Pass: events == int64(build.Events) && targets == int64(build.Targets()) && tests == int64(build.Tests()) && status == "failed",
		Note: fmt.Sprintf("status %s, %d targets, %d tests", status, targets, tests)})
	size, err := builds.OutputSizes(ctx, conn, ids.Project, ids.InvocationID)
	if err != nil {
		return err
	}
	m.OutputBytes, m.OutputPages = size.StdoutBytes+size.StderrBytes, size.StdoutPages+size.StderrPages
	mid := synth.Label(build.Targets() / 2)
	p, id := ids.Project, ids.InvocationID
	reads := []struct {
		name string
		read func() error
	}{
		{"targets: first page", func() error { _, err := builds.Targets(ctx, conn, p, id, builds.PageQuery{}); return err }},
		{"targets: a page in the middle", func() error {
			_, err := builds.Targets(ctx, conn, p, id, builds.PageQuery{After: mid})
			return err
		}},
		{"targets: failed, first page", func() error {
			_, err := builds.Targets(ctx, conn, p, id, builds.PageQuery{Failed: true})
			return err
		}},
		{"tests: first page", func() error { _, err := builds.Tests(ctx, conn, p, id, builds.PageQuery{}); return err }},
		{"tests: failed, a page in the middle", func() error {
			_, err := builds.Tests(ctx, conn, p, id, builds.PageQuery{Status: "FAILED", After: mid})
			return err
		}},
		{"output: sizes", func() error { _, err := builds.OutputSizes(ctx, conn, p, id); return err }},
		{"output: a stderr page in the middle", func() error {
			_, err := builds.OutputPage(ctx, conn, p, id, builds.StreamStderr, size.StderrPages/2)
			return err
		}},
		{"output: the last stderr page", func() error {
			_, err := builds.OutputPage(ctx, conn, p, id, builds.StreamStderr, size.StderrPages-1)
			return err
		}},
	}
	for _, r := range reads {
		var times []float64
		for range max(b.cfg.million.readRuns, 1) {
			t0 := time.Now()
			if err := r.read(); err != nil {
				return fmt.Errorf("%s: %w", r.name, err)
			}
			times = append(times, float64(time.Since(t0).Microseconds())/1000)
		}
		m.ReadsFirstMs[r.name] = round(times[0], 2)
		worst := slices.Max(times)
		m.ReadsMs[r.name] = round(worst, 2)
		rep.Checks = append(rep.Checks, below(fmt.Sprintf("%s: %s, worst of %d", scMillionEvents, r.name, len(times)),
			worst, float64(readLimit.Milliseconds()), "ms", ""))
	}
	t0 := time.Now()
	cw := &countWriter{}
	if err := builds.WriteJSON(ctx, conn, cw, p, id); err != nil {
		return fmt.Errorf("builds show --json: %w", err)
	}
	m.ShowJSONMs, m.ShowJSONBytes = round(float64(time.Since(t0).Microseconds())/1000, 1), cw.n
	return b.millionPages(ctx, dbURL, ids, size, m, rep)
}

// millionPages times the console's pages of the build over HTTP
// (console-pages, timePages): its page as a browser opens it, with each
// of its parts' choices, and the JSON twins of its rows.
func (b *bench) millionPages(ctx context.Context, dbURL string, ids synth.IDs, size builds.OutputSize, m *millionReport, rep *scenarioReport) error {
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	page := console.BuildPath(ids.Project, ids.InvocationID)
	mid := url.QueryEscape(synth.Label(m.Targets / 2))
	pages := []struct{ name, path string }{
		{"the build's page", page},
		{"its failed targets", page + "?targets=failed"},
		{"its targets, a page in the middle", page + "?targets_after=" + mid},
		{"its tests that did not pass", page + "?tests_status=not-passed"},
		{"its FAILED tests, a page in the middle", page + "?tests_status=FAILED&tests_after=" + mid},
		{"a stderr page in the middle", page + fmt.Sprintf("?out=stderr&page=%d", size.StderrPages/2)},
		{"JSON: a page of targets", "/api/v1" + page + "/targets"},
		{"JSON: a page of tests", "/api/v1" + page + "/tests"},
	}
	figures, err := b.timePages(ctx, console.Sources{DB: func() *pgxpool.Pool { return pool }}, pages)
	if err != nil {
		return err
	}
	m.PagesMs = map[string]pageFigure{}
	for _, p := range pages {
		f := figures[p.name]
		m.PagesMs[p.name] = f
		rep.Checks = append(rep.Checks, below(fmt.Sprintf("%s: console page: %s, worst of %d", scMillionEvents, p.name, b.pageRuns()),
			f.WorstMs, float64(buildPageLimit.Milliseconds()), "ms", fmt.Sprintf("first %.1f ms, median %.1f ms, %d bytes", f.FirstMs, f.MedianMs, f.Bytes)))
	}
	return nil
}

type countWriter struct{ n int64 }

func (w *countWriter) Write(p []byte) (int, error) {
	w.n += int64(len(p))
	return len(p), nil
}

var _ io.Writer = (*countWriter)(nil)
