package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/loadtest/besrecord"
	"github.com/millrace/millrace/loadtest/replay"
)

// TestServeConsole: the console as a process of its own beside the BES
// edge and the builds projector, as a production install runs them. A
// project's BES key reads its builds and no other project's; the fleet
// and commit-log pages (the backbone and the bucket read) need an
// operator's key; and SIGTERM with a live page open stops at once, the
// page's connection ended rather than held to the shutdown's deadline.
func TestServeConsole(t *testing.T) {
	db := testenv.Database(t)
	edge := newDev(t, db)
	edge.args = []string{"serve", "bes"}
	edge.start()
	backbone := []string{"MILLRACE_NATS_URL=" + edge.natsURL, "MILLRACE_NATS_NKEY=" + edge.natsNKey}
	proj := newDev(t, db)
	proj.besAddr, proj.args = "", []string{"project", "builds"}
	proj.env = append(proj.env, backbone...)
	proj.start()

	ids := map[string]string{} // project → its build
	for _, project := range []string{"alpha", "beta"} {
		ids[project] = replayBuild(t, edge.besAddr, project)
	}
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	for project, id := range ids {
		waitUntil(t, "build "+id+" of "+project+" projected to its end", func() bool {
			var status string
			pool.QueryRow(context.Background(), "select status from invocations where project = $1 and id = $2", project, id).Scan(&status)
			return status != "" && status != "running"
		})
	}

	keys := filepath.Join(t.TempDir(), "console-keys")
	if err := os.WriteFile(keys, []byte("operator-key-0123456789\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	cons := newDev(t, db)
	cons.besAddr, cons.args = "", []string{"serve", "console"}
	cons.env = append(cons.env, backbone...)
	cons.env = append(cons.env, "MILLRACE_BES_API_KEYS=alpha=alpha-key-0123456789,beta=beta-key-0123456789", "MILLRACE_HTTP_CONSOLE_KEYS_FILE="+keys,
		"MILLRACE_SHUTDOWN_TIMEOUT=15s")
	cons.start()
	var base string
	poll.Until(t, "the console to serve", func() bool {
		if strings.Contains(cons.output(), "level=ERROR") {
			t.Fatalf("serve console:\n%s", cons.output())
		}
		m := regexp.MustCompile(`msg="HTTP serving".*addr=(\S+)`).FindStringSubmatch(cons.output())
		if m != nil {
			base = "http://" + m[1]
		}
		return m != nil
	}, poll.Within(30*time.Second))
	get := func(path, key string) (int, string) {
		t.Helper()
		req, _ := http.NewRequest("GET", base+path, nil)
		if key != "" {
			req.SetBasicAuth("", key)
		}
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	poll.Until(t, "the console to be ready", func() bool { code, _ := get("/readyz", ""); return code == http.StatusOK }, poll.Within(30*time.Second))

	if code, _ := get("/", ""); code != http.StatusUnauthorized {
		t.Errorf("the list without a key: %d, want 401", code)
	}
	code, page := get("/", "alpha-key-0123456789")
	if code != http.StatusOK || !strings.Contains(page, ids["alpha"]) || strings.Contains(page, ids["beta"]) {
		t.Errorf("the list to alpha's BES key (%d) shows alpha's build %v and not beta's %v:\n%s", code, strings.Contains(page, ids["alpha"]), !strings.Contains(page, ids["beta"]), page)
	}
	if code, page := get("/builds/alpha/"+ids["alpha"], "alpha-key-0123456789"); code != http.StatusOK || !strings.Contains(page, "//") {
		t.Errorf("alpha's build to alpha's key: %d\n%s", code, page)
	}
	if code, _ := get("/builds/beta/"+ids["beta"], "alpha-key-0123456789"); code != http.StatusNotFound {
		t.Errorf("beta's build to alpha's key: %d, want 404", code)
	}
	if code, body := get("/api/v1/builds?project=beta", "alpha-key-0123456789"); code != http.StatusOK || strings.Contains(body, ids["beta"]) {
		t.Errorf("beta's builds in JSON to alpha's key: %d\n%s", code, body)
	}
	for _, path := range []string{"/fleet", "/commits"} {
		if code, _ := get(path, "alpha-key-0123456789"); code != http.StatusForbidden {
			t.Errorf("%s to a project's key: %d, want 403", path, code)
		}
		if code, page := get(path, "operator-key-0123456789"); code != http.StatusOK {
			t.Errorf("%s to an operator's key: %d\n%s", path, code, page)
		}
	}
	if code, page := get("/", "operator-key-0123456789"); code != http.StatusOK || !strings.Contains(page, ids["alpha"]) || !strings.Contains(page, ids["beta"]) {
		t.Errorf("the list to an operator's key: %d, want both builds", code)
	}

	// A live page open through the stop.
	req, _ := http.NewRequest("GET", base+"/events/builds?project=alpha", nil)
	req.SetBasicAuth("", "alpha-key-0123456789")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if line, err := bufio.NewReader(resp.Body).ReadString('\n'); err != nil || !strings.HasPrefix(line, "event: build") && !strings.HasPrefix(line, "id: ") {
		t.Fatalf("the live list's first line %q: %v", line, err)
	}
	begin := time.Now()
	cons.stop() // a clean exit: no request cut at the deadline
	if took := time.Since(begin); took > 10*time.Second {
		t.Errorf("the console took %v to stop with a live page open", took)
	}
}

// replayBuild sends the recorded 10-target build through the BES edge at
// addr as a new invocation of project and returns its id.
func replayBuild(t *testing.T, addr, project string) string {
	t.Helper()
	recs, err := besrecord.Read(filepath.Join("..", "..", "loadtest", "fixtures", "bazel-build-10.besrec"))
	if err != nil {
		t.Fatal(err)
	}
	scripts, skipped := replay.Scripts(recs)
	if len(scripts) == 0 {
		t.Fatalf("no script in the recording: %v", skipped)
	}
	var mu sync.Mutex
	var id string
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	res, err := replay.Run(ctx, replay.Config{Target: addr, Scripts: scripts[:1], Projects: []string{project}, Events: int64(scripts[0].Events()),
		OnStreamDone: func(d replay.StreamDone) { mu.Lock(); id = d.InvocationID; mu.Unlock() }})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Errors) > 0 {
		t.Fatalf("replaying to %s: %v %v", addr, res.Errors, res.ErrorSamples)
	}
	mu.Lock()
	defer mu.Unlock()
	if id == "" {
		t.Fatal("the replayed stream did not end")
	}
	return id
}
