package builds_test

import (
	"context"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/builds"
)

// A day's percentiles come from its histogram: linear within the bucket
// the rank falls in, the lower bound of the open last bucket.
func TestTrendPercentiles(t *testing.T) {
	var d builds.TrendDay
	if r := builds.RatesOf(d); r.P50Ms != -1 || r.CacheHitRate != -1 || r.FailureRate != 0 {
		t.Fatalf("an empty day: %+v", r)
	}
	d.Hist[1], d.Hist[3] = 5, 5 // 1-5 s, 10-30 s
	for p, want := range map[float64]int64{0.5: 5000, 0.9: 26000, 0.1: 1800, 1: 30000} {
		if got := d.Percentile(p); got != want {
			t.Errorf("p%v = %d, want %d", p*100, got, want)
		}
	}
	d.Hist[11] = 90 // two hours and more
	if got := d.Percentile(0.99); got != 7200000 {
		t.Errorf("p99 in the open bucket = %d", got)
	}
}

// ReadTrends sums hourly_rollups by UTC day over the window, every day
// present, per project when none is named, and only the projects asked.
func TestReadTrends(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	now := time.Date(2026, 3, 10, 15, 0, 0, 0, time.UTC)
	if _, err := pool.Exec(ctx, `insert into hourly_rollups (project, hour, builds, succeeded, failed, abandoned, duration_hist,
		duration_sum_ms, tests_passed, tests_failed, tests_flaky, cache_hits, cache_misses) values
		('acme', '2026-03-10 14:00Z', 4, 3, 1, 0, '{0,4,0,0,0,0,0,0,0,0,0,0}', 8000, 10, 1, 1, 30, 10),
		('acme', '2026-03-10 02:00Z', 2, 1, 1, 0, '{0,0,0,2,0,0,0,0,0,0,0,0}', 40000, 5, 0, 0, 10, 10),
		('acme', '2026-03-08 23:00Z', 1, 0, 0, 1, '{1,0,0,0,0,0,0,0,0,0,0,0}', 500, 0, 0, 0, 0, 0),
		('acme', '2026-03-03 23:00Z', 9, 9, 0, 0, '{9,0,0,0,0,0,0,0,0,0,0,0}', 900, 0, 0, 0, 0, 0),
		('beta', '2026-03-09 10:00Z', 7, 7, 0, 0, '{0,0,7,0,0,0,0,0,0,0,0,0}', 49000, 0, 0, 0, 0, 7)`); err != nil {
		t.Fatal(err)
	}
	tr, err := builds.ReadTrends(ctx, pool, builds.TrendQuery{Project: "acme", Days: 3, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.Days) != 3 || tr.Days[0].Day != "2026-03-08" || tr.Days[2].Day != "2026-03-10" || tr.Total.Day != "2026-03-08" {
		t.Fatalf("days %+v", tr.Days)
	}
	today := tr.Days[2]
	if today.Builds != 6 || today.Failed != 2 || today.CacheHits != 40 || today.CacheMisses != 20 || today.TestsFlaky != 1 ||
		today.Hist[1] != 4 || today.Hist[3] != 2 || today.P50Ms != 4000 || today.CacheHitRate != 40.0/60 {
		t.Errorf("today %+v", today)
	}
	if tr.Days[1].Builds != 0 || tr.Days[1].P50Ms != -1 || tr.Days[0].Abandoned != 1 {
		t.Errorf("the other days %+v %+v", tr.Days[0], tr.Days[1])
	}
	if tr.Total.Builds != 7 || tr.Total.Failed != 2 || len(tr.Projects) != 0 {
		t.Errorf("total %+v, projects %+v", tr.Total, tr.Projects)
	}
	all, err := builds.ReadTrends(ctx, pool, builds.TrendQuery{Days: 10, Now: now})
	if err != nil {
		t.Fatal(err)
	}
	if all.Total.Builds != 23 || len(all.Projects) != 2 || all.Projects[0].Project != "acme" || all.Projects[0].Builds != 16 ||
		all.Projects[1].Builds != 7 || all.Projects[1].CacheHitRate != 0 {
		t.Errorf("every project: %+v %+v", all.Total, all.Projects)
	}
	only, err := builds.ReadTrends(ctx, pool, builds.TrendQuery{Projects: []string{"beta"}, Days: 10, Now: now})
	if err != nil || only.Total.Builds != 7 || len(only.Projects) != 1 {
		t.Errorf("beta alone: %v %+v", err, only.Total)
	}
	if _, err := builds.ReadTrends(ctx, pool, builds.TrendQuery{Days: 400}); err == nil {
		t.Error("a window of 400 days")
	}
}
