package builds

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// The reads of tests across builds (testhistory.go): a test's runs
// newest first a page at a time (its rows of tests, build by build), its
// counts over a window of days and its last failure (test_daily); a
// project's flaky tests (test_daily_flaky_idx). None reads more than a
// page's builds and the days of the window, whatever the number of runs.

// Bounds of the reads.
const (
	DefaultHistoryRows = 100
	MaxHistoryRows     = 1000
	DefaultWindowDays  = 30
	MaxWindowDays      = 366
	DefaultFlakyRows   = 50
	MaxFlakyRows       = 500
)

// TestRun is one run of a test: the build it ran in and how it ended.
type TestRun struct {
	Build      string     `json:"build"` // invocation id, in the test's project
	Started    *time.Time `json:"started"`
	Status     string     `json:"status"`
	Attempts   int32      `json:"attempts"`
	DurationMs int64      `json:"duration_ms"`
	// Flaked: it failed, and another build of the same commit passed it.
	Flaked bool `json:"flaked"`
}

// TestDay is what a test's runs of one UTC day came to.
type TestDay struct {
	Day          string `json:"day"` // YYYY-MM-DD
	Runs         int64  `json:"runs"`
	Passed       int64  `json:"passed"`
	Failed       int64  `json:"failed"`
	Flaky        int64  `json:"flaky"`
	CommitFlakes int64  `json:"commit_flakes"`
	MeanMs       int64  `json:"mean_ms"`
}

// TestStats are a test's counts over a window of days.
type TestStats struct {
	Days         int     `json:"days"`
	Runs         int64   `json:"runs"`
	Passed       int64   `json:"passed"`
	Failed       int64   `json:"failed"`
	Flaky        int64   `json:"flaky"`
	CommitFlakes int64   `json:"commit_flakes"`
	FlakeRate    float64 `json:"flake_rate"` // (flaky + commit flakes) / runs
	FailureRate  float64 `json:"failure_rate"`
}

func (s *TestStats) rates() {
	if s.Runs > 0 {
		s.FlakeRate = float64(s.Flaky+s.CommitFlakes) / float64(s.Runs)
		s.FailureRate = float64(s.Failed) / float64(s.Runs)
	}
}

// HistoryQuery selects a page of a test's history.
type HistoryQuery struct {
	Project, Label string
	// Before is the Next of the previous page; "" the newest runs.
	Before string
	// Limit is the most runs: 0 DefaultHistoryRows, at most MaxHistoryRows.
	Limit int
	// Days is the window of Stats and Daily: 0 DefaultWindowDays.
	Days int
	// Now is the end of the window (the zero time: now).
	Now time.Time
}

// TestHistory is a page of a test's runs, newest first, with its counts
// over the window, its days in it, and its last failure.
type TestHistory struct {
	Project     string    `json:"project"`
	Label       string    `json:"label"`
	Runs        []TestRun `json:"runs"`
	Next        string    `json:"next"`
	Stats       TestStats `json:"stats"`
	Daily       []TestDay `json:"daily"`
	LastFailure *TestRun  `json:"last_failure"`
}

// Validate reports a query ReadTestHistory would refuse, naming the field.
func (q HistoryQuery) Validate() error { return q.check() }

func (q *HistoryQuery) check() error {
	switch {
	case q.Project == "" || q.Label == "":
		return errors.New("a test is named by project and label")
	case q.Limit < 0 || q.Limit > MaxHistoryRows:
		return fmt.Errorf("limit %d is not from 0 to %d", q.Limit, MaxHistoryRows)
	case q.Days < 0 || q.Days > MaxWindowDays:
		return fmt.Errorf("days %d is not from 1 to %d", q.Days, MaxWindowDays)
	}
	if q.Limit == 0 {
		q.Limit = DefaultHistoryRows
	}
	if q.Days == 0 {
		q.Days = DefaultWindowDays
	}
	if q.Now.IsZero() {
		q.Now = time.Now()
	}
	_, err := parseCursor(q.Before)
	return err
}

// sqlRuns reads a test's runs in a project's finished builds, newest
// first, below a build key ($3; 0: from the newest) and not below $6: the
// project's test builds backwards on invocations_project_key_idx, each
// probed for the test by the primary key of tests ($5: failed runs only).
// $6 is the first day test_daily has for the test, so that a walk never
// reads builds from before it ran.
var sqlRuns = `select i.build_key, i.id, i.started_at, t.status, t.attempts, t.duration_ms, t.flaked
from invocations i cross join lateral (
    select t.status, t.attempts, t.duration_ms, t.flaked from tests t
    where t.build_key = i.build_key and t.label_id = build_label_id($2)) t
where i.project collate "C" = $1 and i.command in ('test', 'coverage')
  and ($3::int8 = 0 or i.build_key < $3::int8) and i.build_key >= $6::int8
  and ($5 = false or t.status ` + fmt.Sprintf(failedStatus, "t") + `)
order by i.build_key desc limit $4`

// sqlDays reads a test's days in a window, from test_daily's primary key.
const sqlDays = `select day, runs, passed, failed, flaky, commit_flakes, duration_sum_ms
from test_daily where project = $1 and label_id = build_label_id($2) and day >= $3::date and day <= $4::date order by day`

// ReadTestHistory returns a page of the test's history, or ErrNotFound
// when the project has never run a test of that label.
func ReadTestHistory(ctx context.Context, db Querier, q HistoryQuery) (TestHistory, error) {
	h := TestHistory{Project: q.Project, Label: q.Label, Runs: []TestRun{}, Daily: []TestDay{}}
	if err := q.check(); err != nil {
		return h, err
	}
	var known bool
	if err := db.QueryRow(ctx, `select exists (select 1 from build_labels where project = $1 and id = build_label_id($2) and label = $2)`,
		q.Project, q.Label).Scan(&known); err != nil {
		return h, fmt.Errorf("builds: history of %s: %w", q.Label, err)
	}
	if !known {
		return h, ErrNotFound
	}
	var first *time.Time
	if err := db.QueryRow(ctx, `select min(day) from test_daily where project = $1 and label_id = build_label_id($2)`,
		q.Project, q.Label).Scan(&first); err != nil {
		return h, fmt.Errorf("builds: history of %s: %w", q.Label, err)
	}
	if first == nil { // the project's builds have never run it to the end
		h.Stats.Days = q.Days
		return h, nil
	}
	floor := dayKey(*first)
	before, _ := parseCursor(q.Before)
	runs, keys, err := readRuns(ctx, db, q.Project, q.Label, before, q.Limit+1, false, floor)
	if err != nil {
		return h, fmt.Errorf("builds: history of %s: %w", q.Label, err)
	}
	if len(runs) > q.Limit {
		runs, h.Next = runs[:q.Limit], strconv.FormatInt(keys[q.Limit-1], 10)
	}
	h.Runs = append(h.Runs, runs...)

	from := q.Now.UTC().AddDate(0, 0, -(q.Days - 1))
	rows, err := db.Query(ctx, sqlDays, q.Project, q.Label, from.Format(time.DateOnly), q.Now.UTC().Format(time.DateOnly))
	if err != nil {
		return h, fmt.Errorf("builds: days of %s: %w", q.Label, err)
	}
	var (
		day time.Time
		d   TestDay
		sum int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&day, &d.Runs, &d.Passed, &d.Failed, &d.Flaky, &d.CommitFlakes, &sum}, func() error {
		d.Day = day.Format(time.DateOnly)
		if d.Runs > 0 {
			d.MeanMs = sum / d.Runs
		}
		h.Daily = append(h.Daily, d)
		h.Stats.Runs += d.Runs
		h.Stats.Passed += d.Passed
		h.Stats.Failed += d.Failed
		h.Stats.Flaky += d.Flaky
		h.Stats.CommitFlakes += d.CommitFlakes
		return nil
	}); err != nil {
		return h, fmt.Errorf("builds: days of %s: %w", q.Label, err)
	}
	h.Stats.Days = q.Days
	h.Stats.rates()

	// The last failure: the last day with one (test_daily, every day the
	// rollups keep), then that day's runs and later ones, newest first.
	var last *time.Time
	if err := db.QueryRow(ctx, `select max(day) from test_daily where project = $1 and label_id = build_label_id($2) and failed > 0`,
		q.Project, q.Label).Scan(&last); err != nil {
		return h, fmt.Errorf("builds: last failure of %s: %w", q.Label, err)
	}
	if last != nil {
		// test_daily's day is the build key's.
		failed, _, err := readRuns(ctx, db, q.Project, q.Label, 0, 1, true, dayKey(*last))
		if err != nil {
			return h, fmt.Errorf("builds: last failure of %s: %w", q.Label, err)
		}
		if len(failed) > 0 {
			h.LastFailure = &failed[0]
		}
	}
	return h, nil
}

// readRuns reads up to limit runs below the build key before (0: from
// the newest) and not below floor, only failed ones if failedOnly.
func readRuns(ctx context.Context, db Querier, project, label string, before int64, limit int, failedOnly bool, floor int64) ([]TestRun, []int64, error) {
	rows, err := db.Query(ctx, sqlRuns, project, label, before, limit, failedOnly, floor)
	if err != nil {
		return nil, nil, err
	}
	var (
		out  []TestRun
		keys []int64
		r    TestRun
		key  int64
	)
	_, err = pgx.ForEachRow(rows, []any{&key, &r.Build, &r.Started, &r.Status, &r.Attempts, &r.DurationMs, &r.Flaked}, func() error {
		if r.Started != nil {
			t := r.Started.UTC()
			r.Started = &t
		}
		out, keys = append(out, r), append(keys, key)
		return nil
	})
	return out, keys, err
}

// FlakyQuery selects a project's flaky tests.
type FlakyQuery struct {
	Project string
	Days    int // the window: 0 DefaultWindowDays
	Limit   int // 0 DefaultFlakyRows, at most MaxFlakyRows
	Now     time.Time
}

// FlakyTest is a test that flaked in the window: its counts there and the
// last day it flaked.
type FlakyTest struct {
	Label     string    `json:"label"`
	Stats     TestStats `json:"stats"`
	LastFlake string    `json:"last_flake"` // YYYY-MM-DD
}

// sqlFlaky ranks the tests of a project that flaked in a window: those
// test_daily_flaky_idx has (a FLAKY run, or a commit that passed and
// failed), their counts over the window, by flake rate, then the latest
// flake.
const sqlFlaky = `
with f as (
    select distinct label_id from test_daily
    where project = $1 and day >= $2::date and day <= $3::date and (flaky > 0 or commit_flakes > 0)
)
select l.label, sum(d.runs), sum(d.passed), sum(d.failed), sum(d.flaky), sum(d.commit_flakes),
       max(d.day) filter (where d.flaky > 0 or d.commit_flakes > 0)
from f join test_daily d on d.project = $1 and d.label_id = f.label_id and d.day >= $2::date and d.day <= $3::date
join build_labels l on l.project = $1 and l.id = f.label_id
group by l.label
order by (sum(d.flaky) + sum(d.commit_flakes))::float8 / greatest(sum(d.runs), 1) desc,
         max(d.day) filter (where d.flaky > 0 or d.commit_flakes > 0) desc, l.label collate "C"
limit $4`

// FlakyTests returns the project's tests that flaked in the window, most
// flaky first.
func FlakyTests(ctx context.Context, db Querier, q FlakyQuery) ([]FlakyTest, error) {
	switch {
	case q.Project == "":
		return nil, errors.New("flaky tests are a project's: name one")
	case q.Days < 0 || q.Days > MaxWindowDays:
		return nil, fmt.Errorf("days %d is not from 1 to %d", q.Days, MaxWindowDays)
	case q.Limit < 0 || q.Limit > MaxFlakyRows:
		return nil, fmt.Errorf("limit %d is not from 0 to %d", q.Limit, MaxFlakyRows)
	}
	if q.Days == 0 {
		q.Days = DefaultWindowDays
	}
	if q.Limit == 0 {
		q.Limit = DefaultFlakyRows
	}
	if q.Now.IsZero() {
		q.Now = time.Now()
	}
	from := q.Now.UTC().AddDate(0, 0, -(q.Days - 1))
	rows, err := db.Query(ctx, sqlFlaky, q.Project, from.Format(time.DateOnly), q.Now.UTC().Format(time.DateOnly), q.Limit)
	if err != nil {
		return nil, fmt.Errorf("builds: flaky tests of %s: %w", q.Project, err)
	}
	out := []FlakyTest{}
	var (
		f    FlakyTest
		last time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&f.Label, &f.Stats.Runs, &f.Stats.Passed, &f.Stats.Failed, &f.Stats.Flaky, &f.Stats.CommitFlakes, &last}, func() error {
		f.Stats.Days = q.Days
		f.Stats.rates()
		f.LastFlake = last.Format(time.DateOnly)
		out = append(out, f)
		return nil
	}); err != nil {
		return nil, fmt.Errorf("builds: flaky tests of %s: %w", q.Project, err)
	}
	return out, nil
}

// ProjectNames returns the projects that have counted builds, sorted: a
// walk of hourly_rollups' primary key, one probe per project.
func ProjectNames(ctx context.Context, db Querier) ([]string, error) {
	rows, err := db.Query(ctx, `with recursive p(project) as (
    (select project from hourly_rollups order by project limit 1)
    union all
    select (select r.project from hourly_rollups r where r.project > p.project order by r.project limit 1)
    from p where p.project is not null)
select project from p where project is not null`)
	if err != nil {
		return nil, fmt.Errorf("builds: projects: %w", err)
	}
	names, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("builds: projects: %w", err)
	}
	return names, nil
}
