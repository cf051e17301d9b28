package builds

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/internal/backoff"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/knob"
)

// Defaults of ExpireConfig.
const (
	DefaultExpireInterval     = time.Minute
	DefaultExpireIdleInterval = 15 * time.Minute
	DefaultExpireBatch        = 100
)

// ExpireConfig configures the Expirer. A zero field takes its default; a
// negative one is refused by NewExpirer.
type ExpireConfig struct {
	// Interval is the pause after a pass that deleted something.
	Interval time.Duration
	// IdleInterval is the longest pause while passes delete nothing:
	// after each such pass the pause doubles from Interval up to it, so
	// that an idle database is not asked every Interval, project by
	// project, for what cannot be there yet (retention is counted in
	// days). What passes its retention meanwhile is deleted at most
	// IdleInterval late. Less than Interval: Interval.
	IdleInterval time.Duration
	// Batch is how many builds (or rollup rows) one transaction deletes.
	Batch int
	// MaxPause is the longest pause after a failing pass (Interval when 0).
	MaxPause time.Duration
	Logger   *slog.Logger
}

// RegisterFlags registers the Expirer's flags on fs.
func (c *ExpireConfig) RegisterFlags(fs *flag.FlagSet) {
	envflag.Duration(fs, &c.Interval, "retention-interval", "MILLRACE_RETENTION_INTERVAL", DefaultExpireInterval, "pause after a retention pass that deleted something (passes delete what is past its project's retention)")
	envflag.Duration(fs, &c.IdleInterval, "retention-idle-interval", "MILLRACE_RETENTION_IDLE_INTERVAL", DefaultExpireIdleInterval, "longest pause between retention passes while they delete nothing: it doubles from --retention-interval after each such pass up to this; what passes its retention meanwhile is deleted at most this late")
	envflag.Int(fs, &c.Batch, "retention-batch", "MILLRACE_RETENTION_BATCH", DefaultExpireBatch, "builds (or rollup rows) the retention deletes per transaction")
}

// Validate reports a configuration that cannot work.
func (c ExpireConfig) Validate() error {
	_, err := c.withDefaults()
	return err
}

func (c ExpireConfig) withDefaults() (ExpireConfig, error) {
	if err := knob.NotNegative("builds", "ExpireConfig.Interval", c.Interval, DefaultExpireInterval); err != nil {
		return c, err
	}
	if err := knob.NotNegative("builds", "ExpireConfig.IdleInterval", c.IdleInterval, DefaultExpireIdleInterval); err != nil {
		return c, err
	}
	if err := knob.NotNegative("builds", "ExpireConfig.Batch", c.Batch, DefaultExpireBatch); err != nil {
		return c, err
	}
	if c.Interval == 0 {
		c.Interval = DefaultExpireInterval
	}
	if c.IdleInterval == 0 {
		c.IdleInterval = DefaultExpireIdleInterval
	}
	c.IdleInterval = max(c.IdleInterval, c.Interval)
	if c.Batch == 0 {
		c.Batch = DefaultExpireBatch
	}
	if c.MaxPause <= 0 {
		c.MaxPause = c.Interval
	}
	if c.Logger == nil {
		c.Logger = slog.New(slog.DiscardHandler)
	}
	return c, nil
}

// RawExpirer removes raw events past retention (the archive's objects and
// what the stream still holds of them): archive.RawExpirer.
type RawExpirer interface {
	// ExpireRaw removes the raw events of at most n of project's builds
	// whose last event is before before, and returns how many it removed.
	ExpireRaw(ctx context.Context, project string, before time.Time, n int) (int, error)
}

// Reasons a pass of the Expirer fails (ExpireMetrics' failures).
const (
	ExpireReasonDatabase = "database"
	ExpireReasonRaw      = "raw"
)

// ExpireMetrics are the Expirer's Prometheus metrics.
type ExpireMetrics struct {
	builds   *prometheus.CounterVec
	rollups  prometheus.Counter
	lag      prometheus.Gauge
	paused   prometheus.Gauge
	failures *prometheus.CounterVec
}

// NewExpireMetrics registers the Expirer's metrics with reg (nil: none).
func NewExpireMetrics(reg prometheus.Registerer) *ExpireMetrics {
	m := &ExpireMetrics{
		builds: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "millrace_retention_builds_deleted_total",
			Help: "Builds whose data retention deleted, by what: rows (every per-build table) or raw (archive object and stream messages)."}, []string{"what"}),
		rollups: prometheus.NewCounter(prometheus.CounterOpts{Name: "millrace_retention_rollup_rows_deleted_total",
			Help: "Hourly rollup rows retention deleted."}),
		lag: prometheus.NewGauge(prometheus.GaugeOpts{Name: "millrace_retention_lag_seconds",
			Help: "How long ago the oldest finished build's rows still present passed their project's retention, as of the last pass (0: none)."}),
		paused: prometheus.NewGauge(prometheus.GaugeOpts{Name: "millrace_retention_paused",
			Help: "1 while retention pauses because the database or the bucket fails."}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "millrace_retention_failures_total",
			Help: "Retention passes that failed, by reason (database, raw: the bucket or the stream)."}, []string{"reason"}),
	}
	if reg != nil {
		reg.MustRegister(m.builds, m.rollups, m.lag, m.paused, m.failures)
	}
	for _, w := range []string{"rows", "raw"} {
		m.builds.WithLabelValues(w)
	}
	for _, r := range []string{ExpireReasonDatabase, ExpireReasonRaw} {
		m.failures.WithLabelValues(r)
	}
	return m
}

// Expirer deletes what is past each project's retention, in batches of
// short transactions: finished builds' rows (RowsDays after their last
// event), hourly rollup rows (RollupDays after their hour) and, through
// RawExpirer, raw events (RawDays). Rollups keep what the deleted rows
// counted. It never locks a table, and locks only the rows of the builds
// of one batch (skipping those the projector holds), so the projector
// never waits for it longer than one batch's transaction, and only when a
// late event names a build being deleted (README.md, "Retention").
type Expirer struct {
	cfg  ExpireConfig
	def  Retention
	pool *pgxpool.Pool
	raw  RawExpirer
	m    *ExpireMetrics
	now  func() time.Time
	// due is when the oldest build past retention found by the last pass
	// that could look passed it (zero: none): the lag grows from it while
	// passes fail.
	due time.Time
}

// ExpireStats counts what a pass deleted.
type ExpireStats struct {
	RowsBuilds, RawBuilds, RollupRows int
	// Partitions: weeks of the partitioned tables dropped whole.
	Partitions int
}

// NewExpirer returns an Expirer of def's defaults (checked) on pool; raw
// may be nil (no bucket: raw events only leave the stream by its age).
func NewExpirer(cfg ExpireConfig, def Retention, pool *pgxpool.Pool, raw RawExpirer, m *ExpireMetrics) (*Expirer, error) {
	cfg, err := cfg.withDefaults()
	if err == nil {
		err = def.Check()
	}
	if err != nil {
		return nil, err
	}
	if m == nil {
		m = NewExpireMetrics(nil)
	}
	return &Expirer{cfg: cfg, def: def, pool: pool, raw: raw, m: m, now: time.Now}, nil
}

// Run checks every project's retention (CheckRetention: a broken one ends
// Run with its error, the process does not start deleting), then makes
// passes until ctx ends: Interval after one that deleted something, and
// while they delete nothing a pause doubling up to IdleInterval
// (nextPause). A failing pass pauses it (backoff up to MaxPause) with
// millrace_retention_paused at 1.
func (e *Expirer) Run(ctx context.Context) error {
	pause := backoff.Backoff{Min: min(time.Second, e.cfg.MaxPause), Max: e.cfg.MaxPause, Jitter: true}
	checked := false
	var wait time.Duration
	for ctx.Err() == nil {
		var err error
		var st ExpireStats
		reason := ExpireReasonDatabase
		if !checked {
			floor := 0
			if e.raw == nil {
				floor = e.def.RawDays
			}
			if err = CheckRetention(ctx, e.pool, e.def, floor); err == nil {
				checked = true
			} else if errors.As(err, new(RuleError)) {
				return err
			}
		}
		if checked {
			st, reason, err = e.Pass(ctx)
		}
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			e.m.paused.Set(1)
			e.m.failures.WithLabelValues(reason).Inc()
			if !e.due.IsZero() {
				e.m.lag.Set(e.now().Sub(e.due).Seconds())
			}
			d := pause.Next()
			e.cfg.Logger.Warn("retention paused; retrying", "reason", reason, "err", err, "retry_in", d)
			if !backoff.Sleep(ctx, d) {
				return nil
			}
			continue
		}
		e.m.paused.Set(0)
		pause.Reset()
		wait = e.cfg.nextPause(wait, st)
		if !backoff.Sleep(ctx, wait) {
			return nil
		}
	}
	return nil
}

// nextPause is the pause after a pass that deleted st, the one before it
// having been prev: Interval after a pass that deleted something (more
// may come due soon), else prev doubled, from Interval up to IdleInterval.
func (c ExpireConfig) nextPause(prev time.Duration, st ExpireStats) time.Duration {
	if st != (ExpireStats{}) || prev < c.Interval {
		return c.Interval
	}
	return min(2*prev, c.IdleInterval)
}

// Pass deletes everything past retention now, project by project, batch
// by batch, and returns what it deleted; on failure, the reason
// (ExpireReasonDatabase or ExpireReasonRaw).
func (e *Expirer) Pass(ctx context.Context) (ExpireStats, string, error) {
	var st ExpireStats
	now := e.now()
	ps, err := ListRetention(ctx, e.pool, e.def)
	if err != nil {
		return st, ExpireReasonDatabase, err
	}
	if err := e.measure(ctx, ps, now); err != nil {
		return st, ExpireReasonDatabase, err
	}
	// Next week's partitions before any build needs them, and past weeks
	// dropped whole before the batched deletes, which then find nothing
	// of those builds in the partitioned tables.
	if err := EnsurePartitions(ctx, e.pool, now, partitionDays*24*time.Hour); err != nil {
		return st, ExpireReasonDatabase, err
	}
	n, err := DropPartitions(ctx, e.pool, longestRows(e.def, ps), now)
	st.Partitions = n
	if err != nil {
		return st, ExpireReasonDatabase, err
	}
	for _, p := range ps {
		if p.RowsDays > 0 {
			n, err := e.drain(ctx, func() (int, error) { return e.deleteRows(ctx, p.Project, ago(now, p.RowsDays)) })
			st.RowsBuilds += n
			e.m.builds.WithLabelValues("rows").Add(float64(n))
			if err != nil {
				return st, ExpireReasonDatabase, fmt.Errorf("builds: retention of %s's rows: %w", p.Project, err)
			}
		}
		if p.RollupDays > 0 {
			n, err := e.drain(ctx, func() (int, error) { return e.deleteRollups(ctx, p.Project, ago(now, p.RollupDays)) })
			st.RollupRows += n
			e.m.rollups.Add(float64(n))
			if err != nil {
				return st, ExpireReasonDatabase, fmt.Errorf("builds: retention of %s's rollups: %w", p.Project, err)
			}
		}
		if e.raw != nil {
			n, err := e.drain(ctx, func() (int, error) { return e.raw.ExpireRaw(ctx, p.Project, ago(now, p.RawDays), e.cfg.Batch) })
			st.RawBuilds += n
			e.m.builds.WithLabelValues("raw").Add(float64(n))
			if err != nil {
				return st, ExpireReasonRaw, fmt.Errorf("builds: retention of %s's raw events: %w", p.Project, err)
			}
		}
	}
	e.due = time.Time{}
	e.m.lag.Set(0)
	return st, "", nil
}

func ago(now time.Time, days int) time.Time { return now.Add(-time.Duration(days) * 24 * time.Hour) }

// drain calls batch until it deletes less than a full batch.
func (e *Expirer) drain(ctx context.Context, batch func() (int, error)) (int, error) {
	total := 0
	for ctx.Err() == nil {
		n, err := batch()
		total += n
		if err != nil || n < e.cfg.Batch {
			return total, err
		}
	}
	return total, ctx.Err()
}

// measure sets the lag: how long ago the oldest finished build still
// present passed its rows retention.
func (e *Expirer) measure(ctx context.Context, ps []ProjectRetention, now time.Time) error {
	e.due = time.Time{}
	for _, p := range ps {
		if p.RowsDays == 0 {
			continue
		}
		cutoff := ago(now, p.RowsDays)
		var last *time.Time
		err := e.pool.QueryRow(ctx, `select min(last_event_at) from invocations
			where project = $1 and status <> 'running' and last_event_bucket < $2`, p.Project, cutoff).Scan(&last)
		if err != nil {
			return fmt.Errorf("builds: retention lag: %w", err)
		}
		if last != nil && last.Before(cutoff) {
			if due := last.Add(time.Duration(p.RowsDays) * 24 * time.Hour); e.due.IsZero() || due.Before(e.due) {
				e.due = due
			}
		}
	}
	if !e.due.IsZero() {
		e.m.lag.Set(now.Sub(e.due).Seconds())
	}
	return nil
}

// sqlExpiredBuilds picks a batch of project's finished builds whose last
// event is before the cutoff, oldest first, on invocations_retention_idx,
// skipping those a projector's transaction holds (a late event: they wait
// for the next pass).
const sqlExpiredBuilds = `
select id from invocations
where project = $1 and status <> 'running' and last_event_bucket < $2 and last_event_at < $2
order by last_event_bucket
limit $3
for update skip locked`

// deleteRows deletes, in one transaction, the rows of at most Batch of
// project's finished builds whose last event is before cutoff, from every
// per-build table and archived_builds (the builds' raw events went first:
// rows outlive them), and returns how many builds. The rollups keep what
// they counted.
func (e *Expirer) deleteRows(ctx context.Context, project string, cutoff time.Time) (n int, err error) {
	err = pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, sqlExpiredBuilds, project, cutoff, e.cfg.Batch)
		if err != nil {
			return err
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil || len(ids) == 0 {
			return err
		}
		n = len(ids)
		return deleteBuilds(ctx, tx, project, ids, "archived_builds")
	})
	return n, err
}

// deleteBuilds deletes the rows of project's builds ids from every
// per-build table and the extra tables named (keyed by invocation_id and
// project too), the invocations row last, and then the argument arrays
// their command lines named that no other build's name (collectArgv).
func deleteBuilds(ctx context.Context, tx pgx.Tx, project string, ids []string, extra ...string) error {
	b := &pgx.Batch{}
	// First, so that its rows are the batch's first results.
	b.Queue(sqlDeleteCommandLines, project, ids)
	for t, col := range rowTables {
		switch {
		case t == "invocations" || t == "build_command_lines":
			// Last, and first (sqlDeleteCommandLines).
		case byBuildKey(t):
			b.Queue(fmt.Sprintf("delete from %s where build_key in (select build_key from invocations where id = any($2) and project = $1)", t), project, ids)
		default:
			b.Queue(fmt.Sprintf("delete from %s where %s = any($2) and project = $1", t, col), project, ids)
		}
	}
	for _, t := range extra {
		b.Queue(fmt.Sprintf("delete from %s where invocation_id = any($2) and project = $1", t), project, ids)
	}
	b.Queue("delete from invocations where id = any($2) and project = $1", project, ids)
	br := tx.SendBatch(ctx, b)
	rows, err := br.Query()
	var locked [][]byte
	if err == nil {
		locked, err = pgx.CollectRows(rows, pgx.RowTo[[]byte])
	}
	if err := br.Close(); err != nil {
		return err
	}
	if err != nil {
		return err
	}
	return collectArgv(ctx, tx, project, locked)
}

// deleteRollups deletes at most Batch of project's rollup rows of hours
// before cutoff.
func (e *Expirer) deleteRollups(ctx context.Context, project string, cutoff time.Time) (int, error) {
	tag, err := e.pool.Exec(ctx, `delete from hourly_rollups where project = $1 and hour in (
		select hour from hourly_rollups where project = $1 and hour < $2 order by hour limit $3)`,
		project, cutoff.Truncate(time.Hour), e.cfg.Batch)
	if err != nil {
		return 0, err
	}
	// test_daily is a rollup too, by day: a day goes once all its hours
	// have, Batch of its rows at a time.
	days, err := e.pool.Exec(ctx, `delete from test_daily where (project, label_id, day) in (
		select project, label_id, day from test_daily where project = $1 and day < $2::date limit $3)`,
		project, cutoff.UTC().Truncate(24*time.Hour), e.cfg.Batch)
	return int(tag.RowsAffected() + days.RowsAffected()), err
}
