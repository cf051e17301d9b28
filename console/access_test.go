package console

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/testenv"
)

const (
	operatorKey = "operator-key-0123456789"
	acmeKey     = "acme-read-key-0123456789"
	betaBESKey  = "beta-bes-key-0123456789"
)

// The console shows a key what it grants: an operator's key every
// project, a read key (project=KEY) or a BES API key its own project, on
// every page and its JSON twin; another project's builds are not there,
// whatever the address; no key, no console.
func TestConsoleAccess(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	seedFailedBuild(t, pool) // acme's inv-1, with tests
	for _, sql := range []string{
		`insert into test_daily (project, label_id, day, runs, passed, failed, flaky, commit_flakes, duration_sum_ms)
		 select 'acme', label_id, date '1970-01-01' + (build_key >> 47)::int, 1, 1, 0, 0, 0, duration_ms from tests`,
		`insert into invocations (id, project, status, command, started_at, first_event_at, last_event_at)
		 values ('inv-1', 'beta', 'running', 'build', now(), now(), now()), ('beta-only', 'beta', 'succeeded', 'build', now(), now(), now())`,
		`select build_partitions_for(((build_key >> 47) / 7)::int4) from invocations`,
		`insert into hourly_rollups (project, hour, builds, duration_hist) values ('beta', date_trunc('hour', now()), 5, '{0,5,0,0,0,0,0,0,0,0,0,0}')`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	console, err := apikey.Parse(operatorKey+"\nacme="+acmeKey+"\n", KeySyntax)
	if err != nil {
		t.Fatal(err)
	}
	bes, err := apikey.Parse("beta="+betaBESKey, apikey.Syntax[string]{Principal: func(p string) (string, error) { return p, nil }})
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }, Live: newFakeStream()})
	srv := httptest.NewServer(&Guard{Console: Keys{console}, Projects: bes, Next: mux})
	defer srv.Close()
	noRedirect := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	get := func(key, path string, html bool) (int, http.Header, string) {
		t.Helper()
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		if key != "" {
			req.SetBasicAuth("me", key)
		}
		if html {
			req.Header.Set("Accept", "text/html")
		}
		resp, err := noRedirect.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 1<<20)) // an event stream ends at the limit
		return resp.StatusCode, resp.Header, string(b)
	}

	if code, h, _ := get("", "/", true); code != http.StatusUnauthorized || !strings.Contains(h.Get("WWW-Authenticate"), "Basic") {
		t.Errorf("no key: %d %v", code, h)
	}
	if code, _, _ := get("wrong-key-0123456789", "/api/v1/builds", false); code != http.StatusUnauthorized {
		t.Errorf("a wrong key: %d", code)
	}

	projectsOf := func(key, query string) string {
		t.Helper()
		code, _, body := get(key, "/api/v1/builds"+query, false)
		var page struct {
			Builds []struct{ Project, ID string }
		}
		if err := json.Unmarshal([]byte(body), &page); code != http.StatusOK || err != nil {
			t.Fatalf("search %s: %d %v", query, code, err)
		}
		var out []string
		for _, b := range page.Builds {
			out = append(out, b.Project+"/"+b.ID)
		}
		return strings.Join(out, " ")
	}
	for _, c := range []struct{ key, query, want string }{
		{operatorKey, "?limit=10", "beta/beta-only beta/inv-1 acme/inv-1"},
		{acmeKey, "", "acme/inv-1"},
		{acmeKey, "?project=beta", ""},
		{acmeKey, "?q=inv-1", "acme/inv-1"},
		{betaBESKey, "", "beta/beta-only beta/inv-1"},
		{betaBESKey, "?project=acme", ""},
	} {
		if got := projectsOf(c.key, c.query); !sameSet(got, c.want) {
			t.Errorf("%s searching %q: %q, want %q", c.key[:4], c.query, got, c.want)
		}
	}
	if _, _, page := get(acmeKey, "/", true); strings.Contains(page, "/builds/beta/") || !strings.Contains(page, "/builds/acme/inv-1") {
		t.Error("the front page shows a read key another project's builds")
	}

	// Every page of one build of another project is not there.
	for _, path := range []string{"/builds/beta/inv-1", "/api/v1/builds/beta/inv-1", "/api/v1/builds/beta/inv-1/targets",
		"/api/v1/builds/beta/inv-1/tests", "/builds/beta/inv-1/targets", "/builds/beta/inv-1/output/stderr/0",
		"/builds/beta/inv-1/events", "/builds/beta/beta-only"} {
		for _, html := range []bool{true, false} {
			if code, _, body := get(acmeKey, path, html); code != http.StatusNotFound || strings.Contains(body, "running") {
				t.Errorf("acme's key, %s (html %v): %d", path, html, code)
			}
		}
	}
	if code, _, _ := get(acmeKey, "/builds/acme/inv-1", true); code != http.StatusOK {
		t.Errorf("acme's key, its own build: %d", code)
	}
	if code, _, _ := get(betaBESKey, "/api/v1/builds/beta/beta-only", false); code != http.StatusOK {
		t.Errorf("beta's BES key, its own build: %d", code)
	}
	// The id alone leads to the key's project's build only.
	if code, h, _ := get(acmeKey, "/builds/inv-1", true); code != http.StatusFound || h.Get("Location") != "/builds/acme/inv-1" {
		t.Errorf("acme's key, the id shared with beta: %d %s", code, h.Get("Location"))
	}
	if code, _, _ := get(acmeKey, "/builds/beta-only", true); code != http.StatusNotFound {
		t.Errorf("acme's key, beta's id: %d", code)
	}
	if code, _, _ := get(operatorKey, "/builds/inv-1", true); code != http.StatusMultipleChoices {
		t.Errorf("the operator, the shared id: %d", code)
	}

	// Tests: another project's history and flaky tests are not there.
	if code, _, _ := get(operatorKey, TestPath("acme", "//p:t11"), true); code != http.StatusOK {
		t.Fatalf("the operator, acme's test: %d", code)
	}
	if code, _, body := get(betaBESKey, "/api/v1/tests?project=acme&label=%2F%2Fp%3At11", false); code != http.StatusNotFound || strings.Contains(body, "runs") {
		t.Errorf("beta's key, acme's test: %d %s", code, body)
	}
	if _, _, body := get(betaBESKey, "/api/v1/flaky?project=acme&days=30", false); strings.Contains(body, "//p:") {
		t.Errorf("beta's key, acme's flaky tests: %s", body)
	}
	// Trends: a read key's are its project's.
	for _, c := range []struct {
		key, query string
		builds     int
	}{{operatorKey, "", 5}, {betaBESKey, "", 5}, {acmeKey, "", 0}, {acmeKey, "?project=beta", 0}} {
		_, _, body := get(c.key, "/api/v1/trends"+c.query, false)
		var tr struct {
			Total    struct{ Builds int }
			Projects []struct{ Project string }
		}
		if err := json.Unmarshal([]byte(body), &tr); err != nil || tr.Total.Builds != c.builds || (c.key != operatorKey && len(tr.Projects) > 0) {
			t.Errorf("%s's trends%s: %v %s", c.key[:4], c.query, err, body)
		}
	}
	// The live list of a read key is its project's.
	req, _ := http.NewRequest("GET", srv.URL+"/events/builds", nil)
	req.SetBasicAuth("me", acmeKey)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	es := &sse{resp: resp, r: bufio.NewReader(resp.Body)}
	if ev := es.next(t); ev.Name != "build" || ev.Data["key"] != "acme/inv-1" {
		t.Errorf("acme's live list: %+v", ev)
	}
}

func sameSet(a, b string) bool {
	as, bs := strings.Fields(a), strings.Fields(b)
	if len(as) != len(bs) {
		return false
	}
	seen := map[string]bool{}
	for _, s := range as {
		seen[s] = true
	}
	for _, s := range bs {
		if !seen[s] {
			return false
		}
	}
	return true
}
