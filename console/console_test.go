package console

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/builds"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.DropTemplate()
	os.Exit(code)
}

// TestConsoleBuildPages: a build's page is addressed by project and
// invocation id; two projects' builds with the same id are two pages, and
// the id alone lists them rather than picking one.
func TestConsoleBuildPages(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `insert into invocations (id, project, status, command, first_event_at, last_event_at) values
		('same-id', 'alpha', 'succeeded', 'build', now(), now()),
		('same-id', 'beta', 'failed', 'test', now(), now()),
		('only-id', 'a/b c', 'running', 'build', now(), now())`); err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }})
	srv := httptest.NewServer(mux)
	defer srv.Close()
	client := &http.Client{CheckRedirect: func(*http.Request, []*http.Request) error { return http.ErrUseLastResponse }}
	get := func(path string) (int, http.Header, string) {
		t.Helper()
		resp, err := client.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header, string(body)
	}

	for project, status := range map[string]string{"alpha": "succeeded", "beta": "failed"} {
		code, _, body := get("/builds/" + project + "/same-id")
		var b struct{ ID, Project, Status string }
		if err := json.Unmarshal([]byte(body), &b); code != http.StatusOK || err != nil {
			t.Fatalf("/builds/%s/same-id: %d %v\n%s", project, code, err, body)
		}
		if b.ID != "same-id" || b.Project != project || b.Status != status {
			t.Errorf("/builds/%s/same-id shows %+v", project, b)
		}
	}
	if code, _, _ := get("/builds/gamma/same-id"); code != http.StatusNotFound {
		t.Errorf("another project's address of the id: %d, want 404", code)
	}

	code, _, body := get("/builds/same-id")
	var many struct {
		Projects, Builds []string
	}
	if err := json.Unmarshal([]byte(body), &many); code != http.StatusMultipleChoices || err != nil {
		t.Fatalf("/builds/same-id: %d %v\n%s", code, err, body)
	}
	if !slices.Equal(many.Projects, []string{"alpha", "beta"}) || !slices.Equal(many.Builds, []string{"/builds/alpha/same-id", "/builds/beta/same-id"}) {
		t.Errorf("/builds/same-id lists %+v", many)
	}
	if code, hdr, _ := get("/builds/only-id"); code != http.StatusFound || hdr.Get("Location") != "/builds/a%2Fb%20c/only-id" {
		t.Errorf("/builds/only-id: %d to %q, want 302 to the one project's page", code, hdr.Get("Location"))
	}
	if code, _, _ := get("/builds/a%2Fb%20c/only-id"); code != http.StatusOK {
		t.Errorf("a project with a slash and a space in its name: %d", code)
	}
	if code, _, _ := get("/builds/nothing"); code != http.StatusNotFound {
		t.Errorf("an unknown id: %d, want 404", code)
	}

	_, _, page := get("/")
	for _, link := range []string{`href="/builds/alpha/same-id"`, `href="/builds/beta/same-id"`, `href="/builds/a%2fb%20c/only-id"`} {
		if !strings.Contains(strings.ToLower(page), strings.ToLower(link)) {
			t.Errorf("the latest builds page has no link %s:\n%s", link, page)
		}
	}
}

// serve serves h for the test and returns a GET of a path on it: the
// status code and the body.
func serve(t *testing.T, h http.Handler) func(path string) (int, string) {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return func(path string) (int, string) {
		t.Helper()
		resp, err := http.Get(srv.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
}

// The list of builds as JSON and as the front page: filters from the
// URL, a cursor to the next page, and bad filters refused with the reason.
func TestConsoleBuildList(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	// Keys as the projector gives them: the first event's day, then a
	// sequence.
	if _, err := pool.Exec(ctx, `insert into invocations (id, project, status, command, user_name, first_event_at, last_event_at, build_key)
		select 'inv-' || n, case when n % 2 = 0 then 'alpha' else 'beta' end, case when n % 3 = 0 then 'failed' else 'succeeded' end,
		       'test', 'ci', at, at, (floor(extract(epoch from at) / 86400)::bigint << 47) | n
		from generate_series(1, 9) n, lateral (select '2026-11-30 10:00Z'::timestamptz + n * interval '2 hours' as at) t`); err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }})
	get := serve(t, mux)
	list := func(path string) ([]string, string) {
		t.Helper()
		code, body := get(path)
		var page struct {
			Builds []struct{ ID, Project string }
			Next   string
		}
		if err := json.Unmarshal([]byte(body), &page); code != http.StatusOK || err != nil {
			t.Fatalf("%s: %d %v\n%s", path, code, err, body)
		}
		var ids []string
		for _, b := range page.Builds {
			ids = append(ids, b.ID)
		}
		return ids, page.Next
	}
	ids, next := list("/api/v1/builds?project=alpha&limit=3")
	if !slices.Equal(ids, []string{"inv-8", "inv-6", "inv-4"}) || next == "" {
		t.Fatalf("alpha's first 3: %v next %q", ids, next)
	}
	if ids, next = list("/api/v1/builds?project=alpha&limit=3&before=" + next); !slices.Equal(ids, []string{"inv-2"}) || next != "" {
		t.Errorf("alpha's next page: %v next %q", ids, next)
	}
	if ids, _ = list("/api/v1/builds?status=failed&from=2026-11-30T14:00:00Z&to=2026-12-01"); !slices.Equal(ids, []string{"inv-6", "inv-3"}) {
		t.Errorf("failed builds in a window: %v", ids)
	}
	for _, bad := range []string{"status=won", "limit=-1", "before=x", "from=yesterday", "from=2026-12-01&to=2026-11-30"} {
		if code, body := get("/api/v1/builds?" + bad); code != http.StatusBadRequest || !strings.Contains(body, "error") {
			t.Errorf("%s: %d %s, want 400 with the reason", bad, code, body)
		}
	}

	code, page := get("/?project=beta&limit=2")
	if code != http.StatusOK || !strings.Contains(page, `href="/builds/beta/inv-9"`) || strings.Contains(page, "/builds/alpha/") ||
		!strings.Contains(page, `value="beta"`) || !strings.Contains(page, "older builds") {
		t.Errorf("the front page of beta's builds, 2 a page:\n%s", page)
	}
	if code, page := get("/?status=won"); code != http.StatusBadRequest || !strings.Contains(page, "none of running") {
		t.Errorf("a bad filter on the front page: %d\n%s", code, page)
	}
}

// A build's targets, tests and output a page at a time.
func TestConsolePagedRoutes(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	for _, sql := range []string{
		`insert into invocations (id, project, status, first_event_at, last_event_at) values ('big', 'acme', 'failed', now(), now())`,
		`select build_partitions_for(((build_key >> 47) / 7)::int4) from invocations`,
		`insert into build_labels (project, id, label) select 'acme', build_label_id(format('//p:t%s', i)), format('//p:t%s', i) from generate_series(10, 99) i`,
		`insert into targets (build_key, label_id, success, failed) select (select build_key from invocations), build_label_id(format('//p:t%s', i)), i % 3 <> 0, case when i % 3 = 0 then true end from generate_series(10, 99) i`,
		`insert into tests (build_key, label_id, status, has_summary) select (select build_key from invocations), build_label_id(format('//p:t%s', i)), case when i % 2 = 0 then 'PASSED' else 'FAILED' end, true from generate_series(10, 99) i`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }})
	get := serve(t, mux)
	var tg struct{ Targets []builds.Target }
	code, body := get("/builds/acme/big/targets?failed=true&limit=5&after=//p:t20")
	if err := json.Unmarshal([]byte(body), &tg); code != http.StatusOK || err != nil {
		t.Fatalf("targets page: %d %v\n%s", code, err, body)
	}
	var labels []string
	for _, x := range tg.Targets {
		labels = append(labels, x.Label)
	}
	if want := []string{"//p:t21", "//p:t24", "//p:t27", "//p:t30", "//p:t33"}; !slices.Equal(labels, want) {
		t.Errorf("failed targets after //p:t20, 5 of them: %v, want %v", labels, want)
	}
	var ts struct{ Tests []builds.Test }
	code, body = get("/builds/acme/big/tests?status=FAILED&limit=2")
	if err := json.Unmarshal([]byte(body), &ts); code != http.StatusOK || err != nil || len(ts.Tests) != 2 ||
		ts.Tests[0].Label != "//p:t11" || ts.Tests[1].Label != "//p:t13" {
		t.Errorf("failed tests, first 2: %d %v %+v", code, err, ts.Tests)
	}
	if code, _ := get("/builds/acme/big/targets?limit=x"); code != http.StatusBadRequest {
		t.Errorf("a bad limit: %d, want 400", code)
	}
	if code, _ := get("/builds/acme/big/output/stdout/0"); code != http.StatusNotFound {
		t.Errorf("a build without output: %d, want 404", code)
	}
	if code, _ := get("/builds/acme/big/output/stdin/0"); code != http.StatusBadRequest {
		t.Errorf("no such stream: %d, want 400", code)
	}
}

// Before the database is connected every page says so (503), and none
// panics.
func TestNotConnectedYet(t *testing.T) {
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return nil }})
	for _, path := range []string{"/", "/builds/p/i", "/builds/i"} {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		if rec.Code != http.StatusServiceUnavailable {
			t.Errorf("GET %s: %d, want 503", path, rec.Code)
		}
	}
}

func TestWriteBuild(t *testing.T) {
	cmd, reason, user, host := "test", "compile error", "ci", "ci-7"
	mnemonic, exit, uri := "Genrule", int32(2), "file:///tmp/stderr-1"
	gen := builds.Cause{Kind: "action", Label: "//lib:gen", Mnemonic: &mnemonic, ExitCode: &exit, StderrURI: &uri}
	b := &builds.Build{ID: "i1", Project: "alpha", Status: "failed", Command: &cmd, User: &user, Host: &host,
		Targets: []builds.Target{{Label: "//a:ok", Success: true}, {Label: "//a:bad", FailureReason: &reason},
			{Label: "//a:dep", RootCauses: []builds.Cause{gen}}},
		Tests:           []builds.Test{{Label: "//a:t", Status: "PASSED"}},
		BuildMetadata:   map[string]string{"COMMIT_SHA": "c0ffee"},
		WorkspaceStatus: []builds.StatusItem{{Key: "BUILD_SCM_REVISION", Value: "c0ffee"}},
		CommandLine:     []string{"bazel", "test", "//..."}}
	var out bytes.Buffer
	if err := WriteBuild(&out, b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"invocation  i1", "project     alpha", "command     test", "targets     3 (2 failed)",
		"FAILED    //a:bad  compile error", "PASSED    //a:t", "by          ci@ci-7", "metadata    COMMIT_SHA=c0ffee",
		"workspace   BUILD_SCM_REVISION=c0ffee (volatile)", "cmdline     bazel test //...",
		"cause   //lib:gen Genrule exit 2, stderr at file:///tmp/stderr-1"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("no %q in\n%s", want, out.String())
		}
	}
}

// Beyond loopback the console and /metrics need their keys, unless told
// otherwise; the refusal names what is missing.
// WriteBuildPaged prints the lines WriteBuild prints of the whole build,
// read a page at a time (a build of more than one page of targets).
func TestWriteBuildPaged(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	for _, sql := range []string{
		`insert into invocations (id, project, status, command, exit_code, exit_code_name, first_event_at, last_event_at)
			values ('i1', 'alpha', 'failed', 'test', 3, 'TESTS_FAILED', now(), now())`,
		`select build_partitions_for(((build_key >> 47) / 7)::int4) from invocations`,
		`insert into build_labels (project, id, label) select 'alpha', build_label_id(l), l
			from (select format('//a:t%s', i) from generate_series(1000, 3999) i union all select '//a:never') x(l)`,
		`insert into targets (build_key, label_id, success, failure_reason)
			select (select build_key from invocations), build_label_id(format('//a:t%s', i)), i % 500 <> 7, case when i % 500 = 7 then 'broke' end from generate_series(1000, 3999) i`,
		`insert into targets (build_key, label_id) select build_key, build_label_id('//a:never') from invocations`,
		`insert into tests (build_key, label_id, status, has_summary)
			select (select build_key from invocations), build_label_id(format('//a:t%s', i)), 'PASSED', true from generate_series(1000, 1500) i`,
		// The failed targets' root cause, and what the build says of itself.
		`insert into build_failures (build_key, id, reported, kind, label, primary_output, configuration, mnemonic, exit_code, stderr_uri)
			select build_key, build_failure_id('action', '//lib:gen', 'bazel-out/gen.txt', 'cfg'), true,
			       'action', '//lib:gen', 'bazel-out/gen.txt', 'cfg', 'Genrule', 2, 'file:///tmp/stderr-1' from invocations`,
		`insert into target_causes (build_key, label_id, cause_id)
			select (select build_key from invocations), build_label_id(format('//a:t%s', i)),
			       build_failure_id('action', '//lib:gen', 'bazel-out/gen.txt', 'cfg')
			from generate_series(1000, 3999) i where i % 500 = 7`,
		`insert into build_metadata (build_key, project, source, key, value) select build_key, 'alpha', 'build_metadata', 'COMMIT_SHA', 'c0ffee' from invocations`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}
	b, err := builds.Show(ctx, pool, "alpha", "i1")
	if err != nil {
		t.Fatal(err)
	}
	var whole, paged bytes.Buffer
	if err := WriteBuild(&whole, b); err != nil {
		t.Fatal(err)
	}
	if err := WriteBuildPaged(ctx, &paged, pool, "alpha", "i1"); err != nil {
		t.Fatal(err)
	}
	// The same lines; columns are aligned within each page of rows.
	fields := func(s string) []string {
		var out []string
		for _, line := range strings.Split(s, "\n") {
			out = append(out, strings.Join(strings.Fields(line), " "))
		}
		return out
	}
	if !slices.Equal(fields(paged.String()), fields(whole.String())) {
		t.Fatalf("paged:\n%s\nwhole:\n%s", paged.String(), whole.String())
	}
	for _, want := range []string{"metadata COMMIT_SHA=c0ffee", "cause //lib:gen Genrule exit 2, stderr at file:///tmp/stderr-1"} {
		if n := strings.Count(strings.Join(fields(paged.String()), "\n"), want); n == 0 {
			t.Errorf("no %q in the paged text", want)
		}
	}
	if err := WriteBuildPaged(ctx, &paged, pool, "alpha", "nope"); !errors.Is(err, builds.ErrNotFound) {
		t.Fatalf("an unknown build: %v", err)
	}
}

// WriteBuilds prints every project's build with the id, one after the
// other, or the one project's; a build it does not find names the projects
// that have the id.
func TestWriteBuilds(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `insert into invocations (id, project, status, command, first_event_at, last_event_at) values
		('same-id', 'alpha', 'succeeded', 'build', now(), now()),
		('same-id', 'beta', 'failed', 'test', now(), now())`); err != nil {
		t.Fatal(err)
	}
	var alpha, beta, both, one bytes.Buffer
	if err := WriteBuildPaged(ctx, &alpha, pool, "alpha", "same-id"); err != nil {
		t.Fatal(err)
	}
	if err := WriteBuildPaged(ctx, &beta, pool, "beta", "same-id"); err != nil {
		t.Fatal(err)
	}
	if err := WriteBuilds(ctx, &both, pool, "", "same-id"); err != nil || both.String() != alpha.String()+"\n"+beta.String() {
		t.Fatalf("both projects' builds: %v\n%s", err, both.String())
	}
	if err := WriteBuilds(ctx, &one, pool, "beta", "same-id"); err != nil || one.String() != beta.String() {
		t.Fatalf("beta's build: %v\n%s", err, one.String())
	}
	for project, want := range map[string]string{
		"":      `no build "nothing" in the database`,
		"gamma": `project "gamma" has no build "nothing"`,
	} {
		if err := WriteBuilds(ctx, io.Discard, pool, project, "nothing"); err == nil || err.Error() != want {
			t.Errorf("no build of project %q: %v, want %s", project, err, want)
		}
	}
	want := `project "gamma" has no build "same-id" (projects that have one: alpha, beta)`
	if err := WriteBuilds(ctx, io.Discard, pool, "gamma", "same-id"); err == nil || err.Error() != want {
		t.Errorf("another project's id: %v, want %s", err, want)
	}
}

func TestCheckExposure(t *testing.T) {
	t1, _ := apikey.Parse("0123456789abcdef0123", TokenSyntax("key"))
	keys := Tokens{t1}
	c1, _ := apikey.Parse("0123456789abcdef0123", KeySyntax)
	console := Keys{c1}
	none := &Guard{}
	both := &Guard{Console: console, Metrics: keys}
	if err := none.CheckExposure("127.0.0.1:8080", false); err != nil {
		t.Fatalf("loopback: %v", err)
	}
	if err := none.CheckExposure("0.0.0.0:8080", true); err != nil {
		t.Fatalf("insecure open: %v", err)
	}
	if err := both.CheckExposure("0.0.0.0:8080", false); err != nil {
		t.Fatalf("with keys: %v", err)
	}
	bes, _ := apikey.Parse("acme=0123456789abcdef0123", apikey.Syntax[string]{Principal: func(p string) (string, error) { return p, nil }})
	if err := (&Guard{Projects: bes, Metrics: keys}).CheckExposure("0.0.0.0:8080", false); err != nil {
		t.Fatalf("with BES keys: %v", err)
	}
	err := (&Guard{Console: console}).CheckExposure("0.0.0.0:8080", false)
	if err == nil || !strings.Contains(err.Error(), "--http-metrics-token-file") || strings.Contains(err.Error(), "--http-console-keys-file") {
		t.Fatalf("no metrics token: %v", err)
	}
}
