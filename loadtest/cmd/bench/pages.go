package main

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/url"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/console"
)

// console-pages: the console's pages over HTTP, served in this process
// (console.Register on a pool of the scenario's database) and timed from
// the request to the last byte of the answer on loopback: what a browser
// waits for, less the network. The database holds 100,000 finished builds
// in five projects over 140 days (a run of a test in 10,000 of them, and
// flaky ones), their rollups and test_daily, made by SQL as the projector
// would leave them. The million-events scenario times the pages of its
// build the same way (pagesOf).
const scConsolePages = "console-pages"

// Page targets, server time of the worst of the runs.
const (
	listPageLimit  = 200 * time.Millisecond // a page of the builds list
	buildPageLimit = 300 * time.Millisecond // a build's page, of a million events
	otherPageLimit = 200 * time.Millisecond // a test's history, flaky tests, trends
)

// pagesReport is the console-pages scenario's figures, by page.
type pagesReport struct {
	Builds int                   `json:"builds"`
	Runs   int                   `json:"test_runs"` // of the one test
	Pages  map[string]pageFigure `json:"pages"`
}

// pageFigure is one page's times over the runs: the first (cold) and the
// worst, the median, its size, and the CPU this process (server and
// client) spent per request.
type pageFigure struct {
	Path        string  `json:"path"`
	FirstMs     float64 `json:"first_ms"`
	MedianMs    float64 `json:"median_ms"`
	WorstMs     float64 `json:"worst_ms"`
	Bytes       int     `json:"bytes"`
	CPUMsPerReq float64 `json:"cpu_ms_per_request"`
}

// pagesSQL makes the builds as the projector leaves them: 100,000 in
// projects p0..p4, two minutes apart; every 50th failed; a commit per
// three builds; the test //t:x in every other build of p3 (10,000 runs,
// every 331st failed), 18 tests //t:fN beside it, now and then FLAKY; the
// test_daily and hourly_rollups rows of all that.
var pagesSQL = []string{
	`insert into invocations (id, project, status, command, user_name, host, patterns, first_event_at, last_event_at, started_at,
	                          finished_at, build_key, counted_project, counted_hour, counted_status, counted_duration_ms,
	                          counted_tests_passed, counted_tests_failed, counted_tests_flaky, counted_cache_hits, counted_cache_misses)
	 select 'inv-' || n, 'p' || n % 5, case when n % 50 = 0 then 'failed' else 'succeeded' end, 'test', 'u' || n % 40, 'h' || n % 7,
	        array['//pkg' || n % 100 || '/...'], at, at + interval '3 minutes', at, at + interval '3 minutes',
	        (floor(extract(epoch from at) / 86400)::bigint << 47) | n,
	        'p' || n % 5, date_trunc('hour', at, 'UTC'), case when n % 50 = 0 then 'failed' else 'succeeded' end, 180000,
	        19, 0, 0, 400 + n % 100, 100
	 from generate_series(1, 100000) n, lateral (select now() - interval '140 days' + n * interval '2 minutes' as at) t`,
	`select build_partitions_for(w) from (select distinct ((build_key >> 47) / 7)::int4 as w from invocations) x`,
	`insert into build_metadata (build_key, project, source, key, value)
	 select build_key, project, 'build_metadata', 'COMMIT_SHA', 'sha-' || (build_key & 65535) / 3 from invocations`,
	`insert into build_labels (project, id, label)
	 select 'p3', build_label_id(l), l from (select '//t:x' union all select '//t:f' || k from generate_series(0, 17) k) v(l)`,
	`insert into tests (build_key, label_id, status, attempts, duration_ms, has_summary)
	 select i.build_key, l.id,
	        case when l.label like '//t:f%' and (i.build_key & 65535) % 97 = 0 then 'FLAKY'
	             when (i.build_key & 65535) % 331 = 0 then 'FAILED' else 'PASSED' end, 1, 1000, true
	 from invocations i cross join build_labels l
	 where i.project = 'p3' and (i.build_key & 65535) % 2 = 0`,
	`insert into test_daily (project, label_id, day, runs, passed, failed, flaky, commit_flakes, duration_sum_ms)
	 select 'p3', label_id, date '1970-01-01' + (build_key >> 47)::int, count(*), count(*) filter (where status = 'PASSED'),
	        count(*) filter (where status = 'FAILED'), count(*) filter (where status = 'FLAKY'), 0, sum(duration_ms)
	 from tests group by 1, 2, 3`,
	`insert into hourly_rollups (project, hour, builds, succeeded, failed, abandoned, duration_hist, duration_sum_ms,
	                             tests_passed, tests_failed, tests_flaky, cache_hits, cache_misses)
	 select counted_project, counted_hour, count(*), count(*) filter (where counted_status = 'succeeded'),
	        count(*) filter (where counted_status = 'failed'), 0, array[0, 0, 0, 0, 0, count(*), 0, 0, 0, 0, 0, 0]::bigint[],
	        sum(counted_duration_ms), sum(counted_tests_passed), 0, 0, sum(counted_cache_hits), sum(counted_cache_misses)
	 from invocations group by 1, 2`,
	`vacuum analyze`,
}

func (b *bench) pagesScenario(ctx context.Context, rep *scenarioReport) error {
	rep.Description = "the console's pages over HTTP (served in the bench process on the scenario's database, timed from request to last byte): " +
		"the builds list with 100,000 builds in range by filter, a test's history with 10,000 runs, flaky tests, trends"
	db, dbURL, err := b.pg.createDB(ctx, scConsolePages)
	if err != nil {
		return err
	}
	defer b.pg.dropDB(db)
	if err := b.migrate(ctx, dbURL); err != nil {
		return err
	}
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return err
	}
	defer pool.Close()
	fmt.Printf("bench: %s: making 100,000 builds\n", scConsolePages)
	for _, sql := range pagesSQL {
		if _, err := pool.Exec(ctx, sql); err != nil {
			return fmt.Errorf("%.60s...: %w", sql, err)
		}
	}
	pr := &pagesReport{Builds: 100_000, Pages: map[string]pageFigure{}}
	if err := pool.QueryRow(ctx, `select count(*) from tests t join build_labels l on l.id = t.label_id where l.label = '//t:x'`).Scan(&pr.Runs); err != nil {
		return err
	}
	// The cursor of the list's tenth page of p3, for an old page.
	var before string
	if err := pool.QueryRow(ctx, `select build_key::text from invocations where project = 'p3' order by build_key desc offset 500 limit 1`).Scan(&before); err != nil {
		return err
	}
	var oldRun string
	if err := pool.QueryRow(ctx, `select min(build_key)::text from (select build_key from tests t join build_labels l on l.id = t.label_id
		where l.label = '//t:x' order by build_key desc limit 5000) x`).Scan(&oldRun); err != nil {
		return err
	}
	label := url.QueryEscape("//t:x")
	pages := []struct{ name, path string }{
		{"list: newest", "/"},
		{"list: a project", "/?project=p3"},
		{"list: a project's failed builds", "/?project=p0&status=failed"},
		{"list: a project's builds by a user", "/?project=p3&user=u8"},
		{"list: a commit", "/?commit=sha-100"},
		{"list: an invocation id's start", "/?q=inv-9999"},
		{"list: a pattern", "/?q=%2F%2Fpkg42%2F"},
		{"list: a project, the eleventh page", "/?project=p3&before=" + before},
		{"list: a project, a user without builds", "/?project=p3&user=nobody"},
		{"list: JSON, a project", "/api/v1/builds?project=p3"},
		{"test history: 10,000 runs, first page", "/test?project=p3&label=" + label},
		{"test history: an old page", "/test?project=p3&label=" + label + "&before=" + oldRun},
		{"test history: JSON", "/api/v1/tests?project=p3&label=" + label},
		{"flaky tests: 30 days", "/flaky?project=p3"},
		{"trends: a project, 90 days", "/trends?project=p3&days=90"},
		{"trends: every project, 30 days", "/trends"},
	}
	figures, err := b.timePages(ctx, console.Sources{DB: func() *pgxpool.Pool { return pool }}, pages)
	if err != nil {
		return err
	}
	for _, p := range pages {
		f := figures[p.name]
		pr.Pages[p.name] = f
		limit := otherPageLimit
		if strings.HasPrefix(p.name, "list:") {
			limit = listPageLimit
		}
		rep.Checks = append(rep.Checks, below(fmt.Sprintf("%s: %s, worst of %d", scConsolePages, p.name, b.pageRuns()),
			f.WorstMs, float64(limit.Milliseconds()), "ms", fmt.Sprintf("first %.1f ms, median %.1f ms, %d bytes", f.FirstMs, f.MedianMs, f.Bytes)))
	}
	rep.Pages = pr
	return nil
}

func (b *bench) pageRuns() int { return max(b.cfg.million.readRuns, 5) }

// timePages serves the console on src in this process and times each
// page: the first request (cold) and then the runs.
func (b *bench) timePages(ctx context.Context, src console.Sources, pages []struct{ name, path string }) (map[string]pageFigure, error) {
	mux := http.NewServeMux()
	console.Register(mux, src)
	srv := httptest.NewServer(mux)
	defer srv.Close()
	out := map[string]pageFigure{}
	for _, p := range pages {
		f := pageFigure{Path: p.path}
		var times []float64
		cpu0 := selfCPU()
		for range b.pageRuns() + 1 {
			req, _ := http.NewRequestWithContext(ctx, "GET", srv.URL+p.path, nil)
			req.Header.Set("Accept", "text/html,*/*;q=0.8")
			t0 := time.Now()
			resp, err := srv.Client().Do(req)
			if err != nil {
				return nil, fmt.Errorf("%s: %w", p.name, err)
			}
			n, err := io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			took := float64(time.Since(t0).Microseconds()) / 1000
			if err != nil || resp.StatusCode != http.StatusOK {
				return nil, fmt.Errorf("%s: %s answered %d (%v)", p.name, p.path, resp.StatusCode, err)
			}
			times = append(times, took)
			f.Bytes = int(n)
		}
		f.CPUMsPerReq = round(float64((selfCPU()-cpu0).Microseconds())/1000/float64(len(times)), 2)
		f.FirstMs = round(times[0], 2)
		rest := slices.Clone(times[1:])
		slices.Sort(rest)
		f.MedianMs, f.WorstMs = round(rest[len(rest)/2], 2), round(rest[len(rest)-1], 2)
		out[p.name] = f
		fmt.Printf("bench: page %-45s first %7.1f ms, median %7.1f ms, worst %7.1f ms, %d bytes\n", p.name, f.FirstMs, f.MedianMs, f.WorstMs, f.Bytes)
	}
	return out, nil
}
