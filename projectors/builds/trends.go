package builds

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"
)

// Trends are a window of days of hourly_rollups summed by UTC day, for
// the console's charts: builds and how they ended, durations (from the
// histogram), tests, the action cache. Reading them costs the rollup rows
// of the window (24 a day per project), whatever the number of builds.

// DurationBounds are the upper bounds (exclusive, in milliseconds) of the
// duration histogram's buckets but the last, which holds what is longer
// (build_duration_bucket in migrations/002_builds.sql).
var DurationBounds = [durationBuckets - 1]int64{1000, 5000, 10000, 30000, 60000, 120000, 300000, 600000, 1800000, 3600000, 7200000}

// TrendQuery names a window: Project's ("" every project, or those of
// Projects when not empty), the Days UTC days up to Now's.
type TrendQuery struct {
	Project  string
	Projects []string
	Days     int       // 0: DefaultWindowDays; at most MaxWindowDays
	Now      time.Time // zero: the clock
}

// TrendDay is one UTC day of builds. Every field counts finished builds
// (running ones are not yet counted).
type TrendDay struct {
	Day           string                 `json:"day"` // YYYY-MM-DD
	Builds        int64                  `json:"builds"`
	Succeeded     int64                  `json:"succeeded"`
	Failed        int64                  `json:"failed"`
	Abandoned     int64                  `json:"abandoned"`
	DurationSumMs int64                  `json:"duration_sum_ms"`
	Hist          [durationBuckets]int64 `json:"duration_hist"`
	TestsPassed   int64                  `json:"tests_passed"`
	TestsFailed   int64                  `json:"tests_failed"`
	TestsFlaky    int64                  `json:"tests_flaky"`
	CacheHits     int64                  `json:"cache_hits"`
	CacheMisses   int64                  `json:"cache_misses"`
	// Rates are those of the counts above (ReadTrends fills them in).
	Rates
}

// ProjectTrend is one project's total over a window.
type ProjectTrend struct {
	Project string `json:"project"`
	TrendDay
}

// Trends is a window's days, oldest first, every day of the window
// present (zero when it built nothing), and the window as a whole.
type Trends struct {
	Project string     `json:"project,omitempty"`
	Days    []TrendDay `json:"days"`
	Total   TrendDay   `json:"total"` // Day is the first day of the window
	// Projects are the window's projects, most builds first, each with
	// its total, when the query named no project.
	Projects []ProjectTrend `json:"projects,omitempty"`
}

// Validate says what is wrong with a query.
func (q TrendQuery) Validate() error {
	if q.Days < 0 || q.Days > MaxWindowDays {
		return fmt.Errorf("days %d is not between 1 and %d", q.Days, MaxWindowDays)
	}
	return nil
}

// ReadTrends sums the window's rollups by day (and by project, when the
// query names none).
func ReadTrends(ctx context.Context, db Querier, q TrendQuery) (Trends, error) {
	if err := q.Validate(); err != nil {
		return Trends{}, err
	}
	days := q.Days
	if days == 0 {
		days = DefaultWindowDays
	}
	now := q.Now
	if now.IsZero() {
		now = time.Now()
	}
	last := now.UTC().Truncate(24 * time.Hour)
	first := last.AddDate(0, 0, 1-days)
	out := Trends{Project: q.Project}
	index := map[string]int{}
	for d := first; !d.After(last); d = d.AddDate(0, 0, 1) {
		index[d.Format(time.DateOnly)] = len(out.Days)
		out.Days = append(out.Days, TrendDay{Day: d.Format(time.DateOnly)})
	}
	out.Total.Day = first.Format(time.DateOnly)
	// Per project and hour: the primary key's range for one project, a
	// scan of the window's rows for all.
	rows, err := db.Query(ctx, `select project, to_char(hour at time zone 'UTC', 'YYYY-MM-DD'), builds, succeeded, failed, abandoned,
		duration_hist, duration_sum_ms, tests_passed, tests_failed, tests_flaky, cache_hits, cache_misses
		from hourly_rollups
		where hour >= $1 and hour < $2 and ($3 = '' or project = $3) and (coalesce(cardinality($4::text[]), 0) = 0 or project = any($4))`,
		first, last.AddDate(0, 0, 1), q.Project, q.Projects)
	if err != nil {
		return Trends{}, fmt.Errorf("builds: trends: %w", err)
	}
	defer rows.Close()
	byProject := map[string]*ProjectTrend{}
	for rows.Next() {
		var (
			project, day string
			r            TrendDay
			hist         []int64
		)
		if err := rows.Scan(&project, &day, &r.Builds, &r.Succeeded, &r.Failed, &r.Abandoned, &hist, &r.DurationSumMs,
			&r.TestsPassed, &r.TestsFailed, &r.TestsFlaky, &r.CacheHits, &r.CacheMisses); err != nil {
			return Trends{}, fmt.Errorf("builds: trends: %w", err)
		}
		copy(r.Hist[:], hist)
		i, ok := index[day]
		if !ok {
			continue
		}
		out.Days[i].add(r)
		out.Total.add(r)
		if q.Project == "" {
			p := byProject[project]
			if p == nil {
				p = &ProjectTrend{Project: project, TrendDay: TrendDay{Day: out.Total.Day}}
				byProject[project] = p
			}
			p.add(r)
		}
	}
	if err := rows.Err(); err != nil {
		return Trends{}, fmt.Errorf("builds: trends: %w", err)
	}
	for _, p := range byProject {
		p.Rates = RatesOf(p.TrendDay)
		out.Projects = append(out.Projects, *p)
	}
	slices.SortFunc(out.Projects, func(a, b ProjectTrend) int {
		return cmp.Or(cmp.Compare(b.Builds, a.Builds), cmp.Compare(a.Project, b.Project))
	})
	for i := range out.Days {
		out.Days[i].Rates = RatesOf(out.Days[i])
	}
	out.Total.Rates = RatesOf(out.Total)
	return out, nil
}

func (d *TrendDay) add(r TrendDay) {
	d.Builds += r.Builds
	d.Succeeded += r.Succeeded
	d.Failed += r.Failed
	d.Abandoned += r.Abandoned
	d.DurationSumMs += r.DurationSumMs
	for i := range d.Hist {
		d.Hist[i] += r.Hist[i]
	}
	d.TestsPassed += r.TestsPassed
	d.TestsFailed += r.TestsFailed
	d.TestsFlaky += r.TestsFlaky
	d.CacheHits += r.CacheHits
	d.CacheMisses += r.CacheMisses
}

// failureRate is the share of the day's builds that failed (0 without
// builds); abandoned builds count as not failed.
func (d TrendDay) failureRate() float64 {
	if d.Builds == 0 {
		return 0
	}
	return float64(d.Failed) / float64(d.Builds)
}

// cacheHitRate is the share of the action cache lookups that hit (-1
// when Bazel reported none).
func (d TrendDay) cacheHitRate() float64 {
	if d.CacheHits+d.CacheMisses == 0 {
		return -1
	}
	return float64(d.CacheHits) / float64(d.CacheHits+d.CacheMisses)
}

// Percentile is the duration in milliseconds below which the fraction p
// of the day's builds ended, read from the histogram: linear within the
// bucket it falls in (from 0 in the first); in the last, open bucket, its
// lower bound. -1 without builds.
func (d TrendDay) Percentile(p float64) int64 {
	var n int64
	for _, c := range d.Hist {
		n += c
	}
	if n == 0 {
		return -1
	}
	rank := p * float64(n)
	var below int64
	for i, c := range d.Hist {
		if c == 0 || float64(below+c) < rank {
			below += c
			continue
		}
		lo := int64(0)
		if i > 0 {
			lo = DurationBounds[i-1]
		}
		if i == len(DurationBounds) {
			return lo
		}
		hi := DurationBounds[i]
		return lo + int64(float64(hi-lo)*(rank-float64(below))/float64(c))
	}
	return DurationBounds[len(DurationBounds)-1]
}

// Rates are a day's figures as the JSON twin gives them, beside its
// counts.
type Rates struct {
	FailureRate  float64 `json:"failure_rate"`
	CacheHitRate float64 `json:"cache_hit_rate"` // -1: no lookups reported
	P50Ms        int64   `json:"p50_ms"`         // -1: no builds
	P90Ms        int64   `json:"p90_ms"`
	P99Ms        int64   `json:"p99_ms"`
}

// RatesOf is d's Rates.
func RatesOf(d TrendDay) Rates {
	return Rates{FailureRate: d.failureRate(), CacheHitRate: d.cacheHitRate(),
		P50Ms: d.Percentile(0.5), P90Ms: d.Percentile(0.9), P99Ms: d.Percentile(0.99)}
}
