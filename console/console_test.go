package console

import (
	"bytes"
	"context"
	"encoding/json"
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
	Register(mux, func() *pgxpool.Pool { return pool })
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

// Before the database is connected every page says so (503), and none
// panics.
func TestNotConnectedYet(t *testing.T) {
	mux := http.NewServeMux()
	Register(mux, func() *pgxpool.Pool { return nil })
	for _, path := range []string{"/", "/builds/p/i", "/builds/i"} {
		rec := httptest.NewRecorder()
		mux.ServeHTTP(rec, httptest.NewRequest("GET", path, nil))
		if rec.Code != http.StatusServiceUnavailable {
			t.Errorf("GET %s: %d, want 503", path, rec.Code)
		}
	}
}

func TestWriteBuild(t *testing.T) {
	cmd, reason := "test", "compile error"
	b := &builds.Build{ID: "i1", Project: "alpha", Status: "failed", Command: &cmd,
		Targets: []builds.Target{{Label: "//a:ok", Success: true}, {Label: "//a:bad", FailureReason: &reason}},
		Tests:   []builds.Test{{Label: "//a:t", Status: "PASSED"}}}
	var out bytes.Buffer
	if err := WriteBuild(&out, b); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"invocation  i1", "project     alpha", "command     test", "targets     2 (1 failed)", "FAILED    //a:bad  compile error", "PASSED    //a:t"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("no %q in\n%s", want, out.String())
		}
	}
}

// Beyond loopback the console and /metrics need their keys, unless told
// otherwise; the refusal names what is missing.
func TestCheckExposure(t *testing.T) {
	t1, _ := apikey.Parse("0123456789abcdef0123", TokenSyntax("key"))
	keys := Tokens{t1}
	none := &Guard{}
	both := &Guard{Console: keys, Metrics: keys}
	if err := none.CheckExposure("127.0.0.1:8080", false); err != nil {
		t.Fatalf("loopback: %v", err)
	}
	if err := none.CheckExposure("0.0.0.0:8080", true); err != nil {
		t.Fatalf("insecure open: %v", err)
	}
	if err := both.CheckExposure("0.0.0.0:8080", false); err != nil {
		t.Fatalf("with keys: %v", err)
	}
	err := (&Guard{Console: keys}).CheckExposure("0.0.0.0:8080", false)
	if err == nil || !strings.Contains(err.Error(), "--http-metrics-token-file") || strings.Contains(err.Error(), "--http-console-keys-file") {
		t.Fatalf("no metrics token: %v", err)
	}
}
