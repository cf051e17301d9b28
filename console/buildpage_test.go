package console

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/testenv"
)

// pageGetter gets a path as a browser does (Accept: text/html) and
// returns the status, the headers and the body.
func pageGetter(t *testing.T, h http.Handler) func(path string) (int, http.Header, string) {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return func(path string) (int, http.Header, string) {
		t.Helper()
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		req.Header.Set("Accept", "text/html,application/xhtml+xml,*/*;q=0.8")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(body)
	}
}

// seedFailedBuild makes a finished, failed build of project acme: 30
// targets (every third failed, one with its own reason), 30 tests (odd
// ones failed, one flaky, one sharded and retried), metadata with a
// branch, a commit and a CI link, metrics, and output with colours.
func seedFailedBuild(t *testing.T, pool *pgxpool.Pool) {
	ctx := context.Background()
	for _, sql := range []string{
		`insert into invocations (id, project, status, command, patterns, exit_code, exit_code_name, bazel_version, user_name, host,
		        started_at, finished_at, first_event_at, last_event_at)
		 values ('inv-1', 'acme', 'failed', 'test', '{//...}', 3, 'TESTS_FAILED', '4.2.3', 'ci', 'runner-1',
		        now() - interval '90 seconds', now(), now(), now())`,
		`select build_partitions_for(((build_key >> 47) / 7)::int4) from invocations`,
		`insert into build_labels (project, id, label) select 'acme', build_label_id(format('//p:t%s', i)), format('//p:t%s', i) from generate_series(10, 39) i`,
		`insert into targets (build_key, label_id, success, failed, failure_reason)
		 select (select build_key from invocations), build_label_id(format('//p:t%s', i)), i % 3 <> 0, case when i % 3 = 0 then true end,
		        case when i = 12 then E'\x1b[31mcompile error\x1b[0m <here>' end from generate_series(10, 39) i`,
		`insert into tests (build_key, label_id, status, attempts, shard_count, duration_ms, has_summary)
		 select (select build_key from invocations), build_label_id(format('//p:t%s', i)),
		        case when i = 11 then 'FLAKY' when i % 2 = 0 then 'PASSED' else 'FAILED' end,
		        case when i = 11 then 2 else 1 end, case when i = 20 then 4 else 0 end, 1200, true from generate_series(10, 39) i`,
		`insert into build_metadata (project, build_key, source, key, value)
		 select 'acme', build_key, 'build_metadata', k, v from invocations,
		        (values ('BRANCH', 'main'), ('COMMIT_SHA', 'c0ffee12345'), ('CI_URL', 'https://ci.example/run/7'), ('NOTE', 'javascript:alert(1)')) m(k, v)`,
		`insert into build_metrics (build_key, actions_created, actions_executed, action_cache_hits, action_cache_misses,
		        wall_time_ms, cpu_time_ms, analysis_phase_ms, execution_phase_ms, critical_path_ms, critical_path)
		 select build_key, 120, 80, 30, 90, 90000, 150000, 20000, 60000, 45000,
		        E'36000\tCompiling <p/a.cc>\n9000\tLinking //p:a' from invocations`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
}

func TestConsoleBuildPage(t *testing.T) {
	pool, _ := testenv.Pool(t)
	seedFailedBuild(t, pool)
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }})
	get := pageGetter(t, mux)

	code, h, page := get("/builds/acme/inv-1")
	if code != http.StatusOK || !strings.HasPrefix(h.Get("Content-Type"), "text/html") {
		t.Fatalf("the page: %d %s\n%s", code, h.Get("Content-Type"), page)
	}
	if csp := h.Get("Content-Security-Policy"); !strings.Contains(csp, "script-src 'self'") || strings.Contains(csp, "unsafe-inline") {
		t.Errorf("content policy %q", csp)
	}
	for _, want := range []string{
		"TESTS_FAILED (exit code 3)", "ci@runner-1", "4.2.3",
		`href="/?project=acme&amp;branch=main"`, "c0ffee12345", `href="https://ci.example/run/7"`,
		// the reason's colours drawn, its markup escaped
		`<span class="a-f1">compile error</span> &lt;here&gt;`,
		"10 failed", "14 failed", "1 flaky", // from the build's counts
		"2 attempts", "30 hits, 90 misses", "25.0% hit", `class="ph-e"`, "45.0 s (50% of the wall time)",
		// the critical path's steps, each with its share, escaped
		`<td>36.0 s</td><td>80%</td><td><code>Compiling &lt;p/a.cc&gt;</code></td>`, `<td>9.0 s</td><td>20%</td>`,
		`href="/api/v1/builds/acme/inv-1"`,
	} {
		if !strings.Contains(page, want) {
			t.Errorf("no %q in the page", want)
		}
	}
	// A metadata value that is not an http(s) URL is text, not a link.
	if strings.Contains(page, `href="javascript`) {
		t.Error("a javascript: value became a link")
	}
	// Failures come first, before the tables; in them, the failed ones.
	f, tg := strings.Index(page, `id="failures"`), strings.Index(page, `id="targets"`)
	if f < 0 || tg < f || !strings.Contains(page[f:tg], "//p:t12") || strings.Contains(page[f:tg], "//p:t10<") ||
		!strings.Contains(page[f:tg], "//p:t11") {
		t.Errorf("the failures section (at %d, targets at %d) lacks the failed target and tests", f, tg)
	}
	// The tables page and filter.
	_, _, page = get("/builds/acme/inv-1?targets=failed")
	tt := page[strings.Index(page, `id="targets-table"`):strings.Index(page, `id="tests"`)]
	if strings.Contains(tt, "//p:t10<") || !strings.Contains(tt, "//p:t39<") {
		t.Errorf("failed targets only:\n%s", tt)
	}
	_, _, page = get("/builds/acme/inv-1?tests_status=FLAKY")
	tt = page[strings.Index(page, `id="tests-table"`):strings.Index(page, `id="output"`)]
	if strings.Count(tt, "<tr data-label") != 1 || !strings.Contains(tt, "//p:t11<") {
		t.Errorf("flaky tests only:\n%s", tt)
	}
	if code, _, page := get("/builds/acme/inv-1?tests_status=WON"); code != http.StatusBadRequest || !strings.Contains(page, "none of not-passed") {
		t.Errorf("a bad status: %d\n%s", code, page)
	}
	if code, _, page := get("/builds/acme/nope"); code != http.StatusNotFound || !strings.Contains(page, "project acme has no build nope") {
		t.Errorf("a missing build: %d\n%s", code, page)
	}
	// Another project's address of the same id is not this build.
	if code, _, _ := get("/builds/other/inv-1"); code != http.StatusNotFound {
		t.Errorf("another project's address: %d", code)
	}

	// The JSON twin, and the address read by a script.
	for _, path := range []string{"/api/v1/builds/acme/inv-1", "/builds/acme/inv-1"} {
		resp, err := http.Get(serveURL(t, mux) + path)
		if err != nil {
			t.Fatal(err)
		}
		var b struct {
			ID           string `json:"id"`
			BazelVersion string `json:"bazel_version"`
			Tests        []struct {
				Shards int `json:"shards"`
			}
		}
		err = json.NewDecoder(resp.Body).Decode(&b)
		resp.Body.Close()
		if err != nil || b.ID != "inv-1" || b.BazelVersion != "4.2.3" || len(b.Tests) != 30 || b.Tests[10].Shards != 4 {
			t.Errorf("%s: %v %+v", path, err, b)
		}
	}
	// The stylesheet comes from the binary.
	if code, h, css := get("/static/console.css"); code != http.StatusOK || !strings.Contains(h.Get("Content-Type"), "text/css") || !strings.Contains(css, ".a-f1") {
		t.Errorf("the stylesheet: %d %s", code, h.Get("Content-Type"))
	}
}

func serveURL(t *testing.T, h http.Handler) string {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}
