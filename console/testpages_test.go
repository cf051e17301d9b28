package console

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/testenv"
)

// The test history and flaky tests pages read tests and test_daily
// (kept by the projector, builds.TestTestHistory); here, rows as it
// leaves them, and the pages over HTTP.
func TestConsoleTestPages(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	for _, sql := range []string{
		`insert into invocations (id, project, status, command, first_event_at, last_event_at, started_at, build_key)
		 select 'b' || n, 'acme', 'failed', 'test', at, at, at, (floor(extract(epoch from at) / 86400)::bigint << 47) | n
		 from generate_series(1, 9) n, lateral (select now() - (10 - n) * interval '1 hour' as at) a`,
		`select build_partitions_for(w) from (select distinct ((build_key >> 47) / 7)::int4 as w from invocations) x`,
		`insert into build_labels (project, id, label) values ('acme', build_label_id('//t:x'), '//t:x')`,
		`insert into tests (build_key, label_id, status, attempts, duration_ms, has_summary, flaked)
		 select build_key, build_label_id('//t:x'), case when id = 'b3' then 'FLAKY' when id = 'b5' then 'FAILED' else 'PASSED' end,
		        1, 1000, true, id = 'b5'
		 from invocations`,
		`insert into test_daily (project, label_id, day, runs, passed, failed, flaky, commit_flakes, duration_sum_ms)
		 select 'acme', label_id, date '1970-01-01' + (build_key >> 47)::int, count(*), count(*) filter (where status = 'PASSED'),
		        count(*) filter (where status = 'FAILED'), count(*) filter (where status = 'FLAKY'), count(*) filter (where flaked),
		        sum(duration_ms) from tests group by 1, 2, 3`,
		`insert into hourly_rollups (project, hour, builds, duration_hist) values ('acme', now(), 9, '{0,0,0,0,0,0,0,0,0,0,0,0}')`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }})
	get := pageGetter(t, mux)

	code, _, page := get(TestPath("acme", "//t:x"))
	if code != http.StatusOK {
		t.Fatalf("history: %d\n%s", code, page)
	}
	for _, want := range []string{"9<small>runs in 30 days", "22.2%", `href="/builds/acme/b5"`, "Last failure", `<svg class="chart"`, "flaked: its commit passed elsewhere"} {
		if !strings.Contains(page, want) {
			t.Errorf("no %q in the history page", want)
		}
	}
	if i, j := strings.Index(page, "/builds/acme/b9"), strings.Index(page, "/builds/acme/b1"); i < 0 || j < i {
		t.Error("runs are not newest first")
	}
	code, _, page = get(TestPath("acme", "//t:x") + "&limit=4")
	if !strings.Contains(page, "older runs") || strings.Count(page, `<tr><td><a href="/builds/acme/`) != 4 {
		t.Errorf("a page of 4 runs: %d", code)
	}
	if code, _, _ := get(TestPath("beta", "//t:x")); code != http.StatusNotFound {
		t.Errorf("another project's test: %d, want 404", code)
	}
	if code, _, _ := get("/test?project=acme"); code != http.StatusBadRequest {
		t.Errorf("no label: %d, want 400", code)
	}

	code, _, page = get("/flaky?project=acme")
	if code != http.StatusOK || !strings.Contains(page, `href="/test?label=%2F%2Ft%3Ax&amp;project=acme"`) {
		t.Errorf("flaky tests: %d\n%s", code, page)
	}
	if _, _, page = get("/flaky"); !strings.Contains(page, `href="/flaky?project=acme"`) {
		t.Error("the flaky page without a project lists none")
	}

	resp, err := http.Get(serveURL(t, mux) + "/api/v1/flaky?project=acme&days=7")
	if err != nil {
		t.Fatal(err)
	}
	var f struct {
		Tests []struct {
			Label string
			Stats struct {
				Runs      int     `json:"runs"`
				FlakeRate float64 `json:"flake_rate"`
			}
		}
	}
	json.NewDecoder(resp.Body).Decode(&f)
	resp.Body.Close()
	if len(f.Tests) != 1 || f.Tests[0].Label != "//t:x" || f.Tests[0].Stats.Runs != 9 {
		t.Errorf("/api/v1/flaky: %+v", f)
	}
	resp, _ = http.Get(serveURL(t, mux) + "/api/v1/tests?project=acme&label=//t:x&limit=x")
	if resp.StatusCode != http.StatusBadRequest {
		t.Errorf("/api/v1/tests with a bad limit: %d", resp.StatusCode)
	}
	resp.Body.Close()
}
