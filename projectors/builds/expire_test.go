package builds

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
)

// rowsOf counts the rows project's build id has in every per-build table.
func rowsOf(t *testing.T, pool *pgxpool.Pool, k Key) int {
	t.Helper()
	total := 0
	for table := range rowTables {
		var n int
		if err := pool.QueryRow(context.Background(), "select count(*) from "+table+" where "+ofBuild(table), k.Project, k.ID).Scan(&n); err != nil {
			t.Fatal(err)
		}
		total += n
	}
	return total
}

func rollupBuilds(t *testing.T, pool *pgxpool.Pool, project string) (rows, builds int) {
	t.Helper()
	err := pool.QueryRow(context.Background(), "select count(*), coalesce(sum(builds), 0) from hourly_rollups where project = $1", project).Scan(&rows, &builds)
	if err != nil {
		t.Fatal(err)
	}
	return rows, builds
}

// The retention deletes, batch by batch, every row of the finished builds
// whose last event is past their project's rows retention, and nothing
// else: newer builds, running ones, and a project whose override keeps
// rows longer. The rollups keep what the deleted builds counted, until
// their own retention deletes them.
func TestExpireDeletesRowsPastRetentionAndKeepsRollups(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	for _, id := range []string{"old-1", "old-2", "old-3"} {
		synthBuild(s, "acme", id, 20, true)
		s.advance(2 * time.Hour)
	}
	synthBuild(s, "acme", "running", 5, false)
	synthBuild(s, "beta", "old-b", 20, true)
	s.advance(8 * 24 * time.Hour)
	synthBuild(s, "acme", "new", 20, true)
	applyAll(t, pool, p, s.msgs, 40)
	now := t0.Add(10 * 24 * time.Hour)
	def := Retention{RawDays: 1, RowsDays: 5}
	if _, err := SetRetention(ctx, pool, def, "beta", RetentionSet{RowsDays: nDays(20), RollupDays: nDays(30)}); err != nil {
		t.Fatal(err)
	}
	_, before := rollupBuilds(t, pool, "acme")

	reg := prometheus.NewRegistry()
	e, err := NewExpirer(ExpireConfig{Batch: 2}, def, pool, nil, NewExpireMetrics(reg))
	if err != nil {
		t.Fatal(err)
	}
	e.now = func() time.Time { return now }
	st, _, err := e.Pass(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if st.RowsBuilds != 3 || st.RollupRows != 0 {
		t.Fatalf("pass: %+v, want the 3 old acme builds' rows and no rollup", st)
	}
	for _, k := range []Key{{"acme", "old-1"}, {"acme", "old-2"}, {"acme", "old-3"}} {
		if n := rowsOf(t, pool, k); n != 0 {
			t.Errorf("%v past retention keeps %d rows", k, n)
		}
	}
	for _, k := range []Key{{"acme", "running"}, {"acme", "new"}, {"beta", "old-b"}} {
		if n := rowsOf(t, pool, k); n == 0 {
			t.Errorf("%v deleted: running, within retention or kept by its project's override", k)
		}
	}
	if _, after := rollupBuilds(t, pool, "acme"); after != before {
		t.Fatalf("acme's rollups count %d builds after the rows went, %d before", after, before)
	}
	if got := testenv.Metric(t, reg, "millrace_retention_builds_deleted_total", `what="rows"`); got != 3 {
		t.Fatalf("builds deleted (rows): %v", got)
	}
	if got := testenv.Metric(t, reg, "millrace_retention_lag_seconds"); got != 0 {
		t.Fatalf("lag after a pass that deleted everything due: %v", got)
	}

	// The rollups' own retention: acme's hours before now-9d go, the new
	// build's hour stays, beta's override keeps its rollups.
	e.def = Retention{RawDays: 1, RowsDays: 5, RollupDays: 9}
	if st, _, err = e.Pass(ctx); err != nil {
		t.Fatal(err)
	}
	if rows, builds := rollupBuilds(t, pool, "acme"); rows != 1 || builds != 1 || st.RollupRows == 0 {
		t.Fatalf("acme's rollups past 9 days: %d rows of %d builds left (deleted %d), want the new build's", rows, builds, st.RollupRows)
	}
	if rows, _ := rollupBuilds(t, pool, "beta"); rows == 0 {
		t.Fatal("beta's rollups deleted despite its 30 days")
	}
	if got := testenv.Metric(t, reg, "millrace_retention_rollup_rows_deleted_total"); got != float64(st.RollupRows) {
		t.Fatalf("rollup rows deleted metric %v, pass %d", got, st.RollupRows)
	}
}

// The lag is how long ago the oldest build still present passed its
// retention; a failing pass pauses the retention (metric) and Run refuses
// a retention that breaks the order of raw, rows and rollups.
func TestExpireLagPauseAndRule(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	synthBuild(s, "acme", "old", 20, true)
	applyAll(t, pool, p, s.msgs, 40)
	reg := prometheus.NewRegistry()
	m := NewExpireMetrics(reg)
	now := t0.Add(7 * 24 * time.Hour)
	e, err := NewExpirer(ExpireConfig{Interval: time.Hour, MaxPause: time.Hour}, Retention{RawDays: 1, RowsDays: 5}, pool, failingRaw{}, m)
	if err != nil {
		t.Fatal(err)
	}
	e.now = func() time.Time { return now }
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- e.Run(runCtx) }()
	waitMetric(t, reg, "millrace_retention_paused", 1)
	if lag := testenv.Metric(t, reg, "millrace_retention_lag_seconds"); lag < 47*3600 || lag > 49*3600 {
		t.Fatalf("lag %v s, want about two days (a build 7 days old, kept 5)", lag)
	}
	if n := testenv.Metric(t, reg, "millrace_retention_failures_total", `reason="raw"`); n < 1 {
		t.Fatalf("failures (raw): %v", n)
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}

	if _, err := SetRetention(ctx, pool, Retention{RawDays: 1, RowsDays: 5}, "acme", RetentionSet{RowsDays: nDays(10)}); err != nil {
		t.Fatal(err)
	}
	e2, err := NewExpirer(ExpireConfig{}, Retention{RawDays: 1, RowsDays: 5, RollupDays: 7}, pool, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	err = e2.Run(ctx)
	if !errors.As(err, new(RuleError)) || !strings.Contains(err.Error(), `project "acme"'s retention: rows kept 10 days outlive the rollups kept 7 days`) {
		t.Fatalf("Run with acme's rows outliving its rollups: %v", err)
	}
}

// failingRaw is a bucket that fails.
type failingRaw struct{}

func (failingRaw) ExpireRaw(context.Context, string, time.Time, int) (int, error) {
	return 0, errors.New("bucket: unavailable")
}

func waitMetric(t *testing.T, g prometheus.Gatherer, name string, want float64) {
	t.Helper()
	poll.Until(t, name+" at "+fmt.Sprint(want), func() bool { return testenv.Metric(t, g, name) == want })
}

// BenchmarkExpireRows: how long the retention's transaction of a batch of
// builds lasts (the longest the projector may wait for it, on a late
// event) and what deleting a build's rows costs, for builds of the
// recorded Bazel build (targets, tests, output, metrics). Reports ms per
// batch and µs per build.
func BenchmarkExpireRows(b *testing.B) {
	pool, _ := testenv.Pool(b)
	ctx := context.Background()
	p := newProjector(b, Config{})
	const builds = 1000
	msgs := fleet(b, "exp", builds, 50, false)
	applyAll(b, pool, p, msgs, 5000)
	sweep(b, pool, p, time.Now().Add(24*time.Hour))
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		if i > 0 { // the builds again, for the next round
			truncate(b, pool)
			p.Aborted()
			applyAll(b, pool, p, msgs, 5000)
			sweep(b, pool, p, time.Now().Add(24*time.Hour))
		}
		e, err := NewExpirer(ExpireConfig{Batch: 100}, Retention{RawDays: 1, RowsDays: 1}, pool, nil, nil)
		if err != nil {
			b.Fatal(err)
		}
		e.now = func() time.Time { return time.Now().Add(100 * 365 * 24 * time.Hour) }
		b.StartTimer()
		st, _, err := e.Pass(ctx)
		if err != nil || st.RowsBuilds != builds {
			b.Fatalf("pass: %+v, %v; want %d builds", st, err, builds)
		}
	}
	per := float64(b.Elapsed().Microseconds()) / float64(b.N*builds)
	b.ReportMetric(per, "µs/build")
	b.ReportMetric(per*100/1000, "ms/batch")
}

// A week of the partitioned tables goes whole once every build keyed in it
// is past the longest rows retention of all projects; a week that still
// holds a build within it (or a running one) stays, and nothing goes while
// a project keeps its rows for ever. The partitions of the coming week are
// made ahead.
func TestExpireDropsWeeksPastTheLongestRetention(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	synthBuild(s, "acme", "old", 20, true)
	s.advance(14 * 24 * time.Hour)
	synthBuild(s, "acme", "mid", 20, true)
	synthBuild(s, "beta", "mid-running", 5, false)
	s.advance(14 * 24 * time.Hour)
	synthBuild(s, "acme", "new", 20, true)
	applyAll(t, pool, p, s.msgs, 40)
	weeks := func() []int32 {
		t.Helper()
		ps, err := Partitions(ctx, pool)
		if err != nil {
			t.Fatal(err)
		}
		var ws []int32
		for _, p := range ps {
			ws = append(ws, p.Week)
		}
		return ws
	}
	all := weeks()
	if len(all) != 3 {
		t.Fatalf("partitions of weeks %v, want 3", all)
	}
	now := t0.Add(30 * 24 * time.Hour)
	pass := func(def Retention) ExpireStats {
		t.Helper()
		e, err := NewExpirer(ExpireConfig{Batch: 10}, def, pool, nil, NewExpireMetrics(prometheus.NewRegistry()))
		if err != nil {
			t.Fatal(err)
		}
		e.now = func() time.Time { return now }
		st, _, err := e.Pass(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return st
	}
	// beta keeps its rows for ever: no week goes, though acme's old build does.
	if _, err := SetRetention(ctx, pool, Retention{RawDays: 1}, "acme", RetentionSet{RowsDays: nDays(20)}); err != nil {
		t.Fatal(err)
	}
	if st := pass(Retention{RawDays: 1}); st.Partitions != 0 || st.RowsBuilds != 1 {
		t.Fatalf("pass with a project keeping rows for ever: %+v, want acme/old's rows and no week", st)
	}
	// The default at 10 days, acme's 20 the longest: the first week goes
	// whole; the second holds a running build and acme/mid; the third is
	// within retention.
	if st := pass(Retention{RawDays: 1, RowsDays: 10}); st.Partitions != 1 {
		t.Fatalf("pass: %+v, want one week dropped", st)
	}
	got := weeks()
	next := timeWeek(now.Add(partitionDays * 24 * time.Hour))
	want := []int32{all[1], all[2], timeWeek(now), next}
	slices.Sort(want)
	if want = slices.Compact(want); !slices.Equal(got, want) {
		t.Fatalf("weeks %v after the pass, want %v (the last two and this and next week's, made ahead)", got, want)
	}
	for _, k := range []Key{{"beta", "mid-running"}, {"acme", "mid"}, {"acme", "new"}} {
		if n := rowsOf(t, pool, k); n == 0 {
			t.Errorf("%v lost its rows", k)
		}
	}
	var left int
	if err := pool.QueryRow(ctx, `select count(*) from pg_class where relname ~ $1`, fmt.Sprintf("_w%d$", all[0])).Scan(&left); err != nil || left != 0 {
		t.Fatalf("%d tables of the dropped week left (%v)", left, err)
	}
}

// passes counts the Expirer's passes (and its check at start): the
// statements on a pool that list the projects' retention.
type passes struct{ n atomic.Int64 }

func (p *passes) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if d.SQL == sqlRetentionProjects {
		p.n.Add(1)
	}
	return ctx
}

func (*passes) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// While its passes delete nothing the retention backs off, the pause
// doubling from Interval up to IdleInterval, instead of asking an idle
// database every Interval; it still runs, and deletes a build that comes
// past its retention meanwhile within IdleInterval.
func TestExpireBacksOffWhileIdle(t *testing.T) {
	_, url := testenv.Pool(t)
	ctx := context.Background()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	var n passes
	cfg.ConnConfig.Tracer = &n
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	const interval, idle = 2 * time.Millisecond, 300 * time.Millisecond
	e, err := NewExpirer(ExpireConfig{Interval: interval, IdleInterval: idle}, Retention{RawDays: 1, RowsDays: 5}, pool, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	e.now = func() time.Time { return t0.Add(10 * 24 * time.Hour) }
	runCtx, cancel := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- e.Run(runCtx) }()
	defer func() { cancel(); <-done }()

	// The check at start and ten passes: at least the pauses 2, 4, ...,
	// 256 ms and 300 ms apart, where passes every Interval take some 30 ms.
	start := time.Now()
	poll.Until(t, "ten passes", func() bool { return n.n.Load() >= 11 })
	if took, least := time.Since(start), 810*time.Millisecond; took < least {
		t.Fatalf("ten passes that deleted nothing in %v; backing off they take at least %v", took, least)
	}

	p := newProjector(t, Config{})
	s := newStream(t0)
	synthBuild(s, "acme", "old", 20, true)
	applyAll(t, pool, p, s.msgs, 40)
	poll.Until(t, "the build past retention deleted by a later pass", func() bool {
		return rowsOf(t, pool, Key{"acme", "old"}) == 0
	})
}

// The pause after a pass: Interval after one that deleted something, else
// the last doubled up to IdleInterval; an IdleInterval under Interval is
// Interval, a negative one refused.
func TestExpireNextPause(t *testing.T) {
	c, err := ExpireConfig{Interval: time.Minute, IdleInterval: 10 * time.Minute}.withDefaults()
	if err != nil {
		t.Fatal(err)
	}
	var got []time.Duration
	var d time.Duration
	for _, st := range []ExpireStats{{}, {}, {}, {}, {}, {}, {RawBuilds: 1}, {}} {
		d = c.nextPause(d, st)
		got = append(got, d)
	}
	want := []time.Duration{time.Minute, 2 * time.Minute, 4 * time.Minute, 8 * time.Minute, 10 * time.Minute, 10 * time.Minute, time.Minute, 2 * time.Minute}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("pauses %v, want %v", got, want)
	}
	if c, _ := (ExpireConfig{Interval: time.Hour}).withDefaults(); c.IdleInterval != time.Hour {
		t.Fatalf("IdleInterval under Interval: %v, want Interval", c.IdleInterval)
	}
	if c, _ := (ExpireConfig{}).withDefaults(); c.IdleInterval != DefaultExpireIdleInterval || c.Interval != DefaultExpireInterval {
		t.Fatalf("defaults: %+v", c)
	}
	if _, err := NewExpirer(ExpireConfig{IdleInterval: -time.Second}, Retention{RawDays: 1}, nil, nil, nil); err == nil || !strings.Contains(err.Error(), "IdleInterval") {
		t.Fatalf("negative IdleInterval: %v", err)
	}
}
