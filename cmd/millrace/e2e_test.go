package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/devdb"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/loadtest/bazelws"
	"github.com/millrace/millrace/projectors/builds"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.DropTemplate()
	os.Exit(code)
}

var (
	binOnce sync.Once
	binPath string
	binErr  error
)

// binary builds the millrace command once per test run: the end-to-end
// tests run it as a separate process so that they can kill it.
func binary(t *testing.T) string {
	t.Helper()
	binOnce.Do(func() {
		dir, err := os.MkdirTemp("", "millrace-bin-")
		if err != nil {
			binErr = err
			return
		}
		binPath = filepath.Join(dir, "millrace")
		out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			binErr = fmt.Errorf("go build: %v\n%s", err, out)
		}
	})
	if binErr != nil {
		t.Fatal(binErr)
	}
	return binPath
}

func freePort(t *testing.T) string {
	t.Helper()
	portsMu.Lock()
	defer portsMu.Unlock()
	for {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		addr := l.Addr().String()
		l.Close()
		// The kernel may give a port closed a moment ago to the next
		// caller too: two of one process's listeners would then collide
		// (seen: dev's NATS and BES edge on one port).
		if !portsGiven[addr] {
			portsGiven[addr] = true
			return addr
		}
	}
}

// portsGiven are the addresses freePort handed out in this test process.
var (
	portsMu    sync.Mutex
	portsGiven = map[string]bool{}
)

// devProcess is `millrace dev` running in its own process.
type devProcess struct {
	t       *testing.T
	bin     string // the millrace binary; empty: this tree's (binary)
	args    []string
	env     []string
	natsURL string
	// natsNKey is the service identity of dev's embedded server, for
	// other processes on its backbone.
	natsNKey string
	besAddr  string
	// The fleet gateway's, the reservations API's and the commits API's
	// addresses, and the directory of the fleet CA and the development
	// secrets.
	fleetAddr, resvAddr, commitsAddr, fleetDir string
	cmd                                        *exec.Cmd
	log                                        *syncBuffer
	mu                                         sync.Mutex
}

// syncBuffer collects a process's output while tests read it.
type syncBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.String()
}

// newDev prepares a dev process with its own NATS store, ports and database.
func newDev(t *testing.T, databaseURL string) *devProcess {
	dir := t.TempDir()
	d := &devProcess{t: t, args: []string{"dev"}, besAddr: freePort(t), fleetAddr: freePort(t), resvAddr: freePort(t), commitsAddr: freePort(t), fleetDir: filepath.Join(dir, "fleet")}
	natsAddr := freePort(t)
	d.natsURL = "nats://" + natsAddr
	d.natsNKey = filepath.Join(dir, "nats", "auth", "service.nk")
	d.env = append(os.Environ(),
		"DATABASE_URL="+databaseURL,
		"MILLRACE_NATS_DIR="+filepath.Join(dir, "nats"),
		"MILLRACE_NATS_LISTEN="+natsAddr,
		"MILLRACE_BES_LISTEN="+d.besAddr,
		"MILLRACE_FLEET_LISTEN="+d.fleetAddr,
		"MILLRACE_FLEET_CA_DIR="+filepath.Join(d.fleetDir, "ca"),
		"MILLRACE_RESERVATIONS_LISTEN="+d.resvAddr,
		"MILLRACE_COMMITS_LISTEN="+d.commitsAddr,
		"MILLRACE_BUCKET_URL="+filepath.Join(dir, "bucket"),
		"MILLRACE_COMPACTOR_INTERVAL=1s",
		"MILLRACE_HTTP_LISTEN=127.0.0.1:0",
		"MILLRACE_BUILDS_MAX_WAIT=50ms",
		"MILLRACE_BUILDS_ACK_WAIT=5s",
		"MILLRACE_LOG_LEVEL=debug",
	)
	t.Cleanup(d.kill)
	return d
}

// start runs the process and waits until the BES port accepts connections.
func (d *devProcess) start() time.Duration {
	d.t.Helper()
	d.mu.Lock()
	bin := d.bin
	if bin == "" {
		bin = binary(d.t)
	}
	d.cmd = exec.Command(bin, d.args...)
	d.cmd.Env = d.env
	d.log = &syncBuffer{}
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	d.mu.Unlock()
	begin := time.Now()
	if err := d.cmd.Start(); err != nil {
		d.t.Fatal(err)
	}
	if d.besAddr == "" {
		return 0 // not an edge
	}
	for {
		c, err := net.DialTimeout("tcp", d.besAddr, 100*time.Millisecond)
		if err == nil {
			c.Close()
			return time.Since(begin)
		}
		if time.Since(begin) > 30*time.Second {
			d.t.Fatalf("millrace dev did not listen on %s:\n%s", d.besAddr, d.output())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (d *devProcess) output() string {
	d.mu.Lock()
	log := d.log
	d.mu.Unlock()
	if log == nil {
		return ""
	}
	return log.String()
}

// kill ends the process with SIGKILL, as a crash would.
func (d *devProcess) kill() {
	d.mu.Lock()
	cmd := d.cmd
	d.cmd = nil
	d.mu.Unlock()
	if cmd != nil && cmd.Process != nil {
		cmd.Process.Signal(syscall.SIGKILL)
		cmd.Wait()
	}
}

// stop ends the process with SIGTERM and expects a clean exit.
func (d *devProcess) stop() {
	d.t.Helper()
	d.mu.Lock()
	cmd := d.cmd
	d.cmd = nil
	d.mu.Unlock()
	cmd.Process.Signal(syscall.SIGTERM)
	if err := cmd.Wait(); err != nil {
		d.t.Errorf("millrace dev exited with %v after SIGTERM:\n%s", err, d.output())
	}
}

func needBazel(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("bazel"); err != nil {
		t.Skip("SKIPPED: NO BAZEL ON PATH -- the end-to-end tests with the real Bazel client did not run. " +
			"Install it with `apt-get install bazel-bootstrap` (make test does so as root).")
	}
	if testing.Short() {
		t.Skip("SKIPPED in -short mode: runs the real Bazel")
	}
}

// bazelRun is one Bazel invocation on a generated workspace.
type bazelRun struct {
	exp          *bazelws.Expected
	opt          bazelws.RunOptions
	invocationID string
	// project is the project the edge files the build under: the project
	// id Bazel sends when the edge takes any client, the key's project when
	// it has keys (and opt.ProjectID is the key).
	project string
}

func newBazelRun(t *testing.T, targets int, besAddr string) *bazelRun {
	t.Helper()
	dir := t.TempDir()
	exp, err := bazelws.Generate(dir, bazelws.Options{Targets: targets, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	inv := fmt.Sprintf("%08x-0000-4000-8000-%012x", time.Now().UnixNano()&0xffffffff, time.Now().UnixNano()&0xffffffffffff)
	r := &bazelRun{exp: exp, invocationID: inv, project: "e2e", opt: bazelws.RunOptions{
		Dir:          dir,
		BESBackend:   besAddr,
		ProjectID:    "e2e",
		InvocationID: inv,
		JSONFile:     filepath.Join(dir, "bep.json"),
	}}
	t.Cleanup(func() { makeWritable(dir) })
	return r
}

func makeWritable(dir string) {
	filepath.WalkDir(dir, func(p string, de os.DirEntry, err error) error {
		if err == nil && de.IsDir() {
			os.Chmod(p, 0o755)
		}
		return nil
	})
}

// start runs Bazel in the background; wait returns its exit code and output.
func (r *bazelRun) start(t *testing.T) (wait func() (int, string)) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	cmd, err := bazelws.Command(ctx, r.opt)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	return func() (int, string) {
		defer cancel()
		err := cmd.Wait()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatalf("bazel: %v\n%s", err, out.String())
		}
		return cmd.ProcessState.ExitCode(), out.String()
	}
}

// checkExit fails the test unless Bazel exited as the workspace demands;
// context says what the run went through, logs is millrace's output.
func (r *bazelRun) checkExit(t *testing.T, code int, out, context, logs string) {
	t.Helper()
	if want, _ := r.exp.ExitCode("test"); code != want {
		t.Fatalf("bazel exited %d%s, want %d\n%s\n--- millrace:\n%s", code, context, want, out, logs)
	}
}

// checkProjection compares the projection of the run with the JSON file
// Bazel wrote and checks that the build was counted once.
func (r *bazelRun) checkProjection(t *testing.T, db string) {
	t.Helper()
	summary, err := bazelws.ParseJSONFile(r.opt.JSONFile)
	if err != nil {
		t.Fatal(err)
	}
	got := showJSON(t, db, r.project, r.invocationID)
	if got["project"] != r.project {
		t.Errorf("projected project %v, want %s", got["project"], r.project)
	}
	compare(t, got, summary)
	checkCountedOnce(t, db, r.project, r.invocationID, summary)
}

// showJSON runs `millrace builds show <id> --project <project> --json` once
// the build is no longer running, and decodes what it prints.
func showJSON(t *testing.T, databaseURL, project, id string) map[string]any {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		cmd := exec.Command(binary(t), "builds", "show", id, "--project", project, "--json")
		cmd.Env = append(os.Environ(), "DATABASE_URL="+databaseURL)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		if err == nil {
			var b map[string]any
			if err := json.Unmarshal(stdout.Bytes(), &b); err != nil {
				t.Fatalf("builds show printed no JSON: %v\n%s", err, stdout.String())
			}
			if b["status"] != "running" {
				return b
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("build %s not projected as finished: %v\n%s%s", id, err, stdout.String(), stderr.String())
		}
		time.Sleep(200 * time.Millisecond)
	}
}

// compare checks the projection of one build against the JSON file Bazel
// wrote in the same run: exit code, every target, every test status.
func compare(t *testing.T, got map[string]any, s *bazelws.JSONSummary) {
	t.Helper()
	if id, _ := got["id"].(string); id != s.InvocationID {
		t.Errorf("projected id %q, Bazel's %q", id, s.InvocationID)
	}
	if code, _ := got["exit_code"].(float64); int(code) != s.ExitCode {
		t.Errorf("projected exit code %v, Bazel's %d", got["exit_code"], s.ExitCode)
	}
	if name, _ := got["exit_code_name"].(string); name != s.ExitCodeName {
		t.Errorf("projected exit code name %q, Bazel's %q", name, s.ExitCodeName)
	}
	wantStatus := "succeeded"
	if s.ExitCode != 0 {
		wantStatus = "failed"
	}
	if got["status"] != wantStatus {
		t.Errorf("projected status %v, want %s", got["status"], wantStatus)
	}
	targets := map[string]bool{}
	for _, x := range asList(got["targets"]) {
		m := x.(map[string]any)
		if success, ok := m["success"].(bool); ok {
			targets[m["label"].(string)] = success
		}
	}
	tests := map[string]string{}
	for _, x := range asList(got["tests"]) {
		m := x.(map[string]any)
		tests[m["label"].(string)] = m["status"].(string)
	}
	if d := diff(s.Targets, targets); d != "" {
		t.Errorf("targets differ from Bazel's JSON (-bazel +projection):\n%s", d)
	}
	if d := diff(s.Tests, tests); d != "" {
		t.Errorf("tests differ from Bazel's JSON (-bazel +projection):\n%s", d)
	}
	// Root causes: each failed target names what Bazel named, and only a
	// target that is its own cause has a failure reason.
	causes := map[string]string{}
	for _, x := range asList(got["targets"]) {
		m := x.(map[string]any)
		if m["success"] == true {
			continue
		}
		label, labels := m["label"].(string), []string{}
		for _, c := range asList(m["root_causes"]) {
			if l := c.(map[string]any)["label"].(string); !slices.Contains(labels, l) {
				labels = append(labels, l)
			}
		}
		slices.Sort(labels)
		causes[label] = strings.Join(labels, " ")
		if own := len(labels) == 0 || slices.Contains(labels, label); own != (m["failure_reason"] != nil) {
			t.Errorf("failed target %s: failure reason %v with root causes %v", label, m["failure_reason"], labels)
		}
	}
	wantCauses := map[string]string{}
	for l, c := range s.RootCauses {
		wantCauses[l] = strings.Join(c, " ")
	}
	if d := diff(wantCauses, causes); d != "" {
		t.Errorf("root causes differ from Bazel's JSON (-bazel +projection):\n%s", d)
	}
	status := map[string]string{}
	for _, x := range asList(got["workspace_status"]) {
		m := x.(map[string]any)
		status[m["key"].(string)] = m["value"].(string)
	}
	if d := diff(s.WorkspaceStatus, status); d != "" {
		t.Errorf("workspace status differs from Bazel's JSON (-bazel +projection):\n%s", d)
	}
}

func asList(v any) []any {
	l, _ := v.([]any)
	return l
}

func diff[V comparable](want, got map[string]V) string {
	var lines []string
	for k, w := range want {
		if g, ok := got[k]; !ok {
			lines = append(lines, fmt.Sprintf("- %s: %v", k, w))
		} else if g != w {
			lines = append(lines, fmt.Sprintf("- %s: %v\n+ %s: %v", k, w, k, g))
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			lines = append(lines, fmt.Sprintf("+ %s: %v", k, g))
		}
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

// TestBazelEndToEnd: the real Bazel builds and tests a generated workspace
// with --bes_backend at millrace dev; the projection must agree with the
// JSON file Bazel wrote in the same run. Dev archives the build a second
// after it finished and trims its events from the BES stream; the replay
// that follows reads it back from the archive and must yield the same rows.
func TestBazelEndToEnd(t *testing.T) {
	needBazel(t)
	db := testenv.Database(t)
	dev := newDev(t, db)
	dev.env = append(dev.env, "MILLRACE_ARCHIVE_AFTER=1s", "MILLRACE_ARCHIVE_INTERVAL=1s")
	if d := dev.start(); d > 3*time.Second {
		t.Errorf("millrace dev took %v to serve BES; Bazel's retries span about 9 s", d)
	}
	run := newBazelRun(t, 60, dev.besAddr)
	// Who and what the build is: CI metadata and a workspace status
	// command's keys, volatile and stable.
	status := filepath.Join(run.opt.Dir, "status.sh")
	if err := os.WriteFile(status, []byte("#!/bin/sh\necho BUILD_SCM_REVISION 0123abcd\necho BUILD_SCM_STATUS clean\necho STABLE_E2E_BRANCH main\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	run.opt.Extra = append(run.opt.Extra, "--build_metadata=COMMIT_SHA=0123abcd", "--build_metadata=ROLE=CI",
		"--workspace_status_command="+status)
	code, out := run.start(t)()
	run.checkExit(t, code, out, "", dev.output())
	run.checkProjection(t, db)
	checkMetadata(t, showJSON(t, db, run.project, run.invocationID))
	waitTrimmed(t, db, dev)
	dev.stop()

	// Replay rebuilds exactly the same rows (every row of every table
	// digested), the build's events from the archive.
	live := digest(t, db)
	replay := exec.Command(binary(t), "replay", "builds")
	replay.Env = dev.env
	rout, err := replay.CombinedOutput()
	if err != nil {
		t.Fatalf("millrace replay builds: %v\n%s", err, rout)
	}
	if !strings.Contains(string(rout), "1 builds from the archive") {
		t.Errorf("replay builds did not read the build from the archive:\n%s", rout)
	}
	replayed := digest(t, db)
	for table, sum := range live {
		if replayed[table] != sum {
			t.Errorf("table %s differs after replay: live %s, replayed %s", table, sum, replayed[table])
		}
	}
	if len(live) == 0 {
		t.Fatal("no tables digested")
	}
}

// waitTrimmed waits until every build is archived and its events have
// left the BES stream (archived_builds.trimmed_seq reached last_seq).
func waitTrimmed(t *testing.T, db string, dev *devProcess) {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ok := poll.True(func() bool {
		var builds, trimmed int
		pool.QueryRow(context.Background(), `select (select count(*) from invocations),
			(select count(*) from archived_builds where object_key <> '' and trimmed_seq >= last_seq)`).Scan(&builds, &trimmed)
		return builds > 0 && trimmed == builds
	}, poll.Within(time.Minute))
	if !ok {
		t.Fatalf("builds not archived and trimmed from the stream within a minute; dev said:\n%s", dev.output())
	}
}

// checkMetadata checks what TestBazelEndToEnd's build said about itself.
func checkMetadata(t *testing.T, got map[string]any) {
	t.Helper()
	md, _ := got["build_metadata"].(map[string]any)
	if md["COMMIT_SHA"] != "0123abcd" || md["ROLE"] != "CI" {
		t.Errorf("build metadata %v, want COMMIT_SHA=0123abcd and ROLE=CI", md)
	}
	stable := map[string]any{}
	for _, x := range asList(got["workspace_status"]) {
		m := x.(map[string]any)
		stable[m["key"].(string)] = m["stable"]
	}
	for key, want := range map[string]bool{"BUILD_SCM_REVISION": false, "BUILD_SCM_STATUS": false, "STABLE_E2E_BRANCH": true,
		"BUILD_USER": true, "BUILD_TIMESTAMP": false} {
		if stable[key] != want {
			t.Errorf("workspace status %s: stable %v, want %v", key, stable[key], want)
		}
	}
	var argv []string
	for _, a := range asList(got["command_line"]) {
		argv = append(argv, a.(string))
	}
	if len(argv) == 0 || argv[0] != "bazel" || !slices.Contains(argv, "--build_metadata=COMMIT_SHA=0123abcd") {
		t.Errorf("canonical command line %q", argv)
	}
}

func digest(t *testing.T, db string) map[string]string {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	d, err := builds.Digest(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// lastSeen is how many tool events of the build are projected (0 before
// its first).
func lastSeen(pool *pgxpool.Pool, project, id string) int64 {
	var n int64
	pool.QueryRow(context.Background(), "select event_count from invocations where id = $1 and project = $2", id, project).Scan(&n)
	return n
}

// TestBazelSurvivesEdgeKill: the edge is killed mid-build and restarted;
// Bazel resumes its stream, the build ends as it would have, and the
// projection is complete with nothing counted twice.
func TestBazelSurvivesEdgeKill(t *testing.T) {
	needBazel(t)
	db := testenv.Database(t)
	dev := newDev(t, db)
	dev.start()
	run := newBazelRun(t, 60, dev.besAddr)
	wait := run.start(t)

	// Kill once events are flowing for this invocation.
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if lastSeen(pool, run.project, run.invocationID) >= 20 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no events projected:\n%s", dev.output())
		}
		time.Sleep(20 * time.Millisecond)
	}
	dev.kill()
	t.Logf("killed the edge after %d events were projected", lastSeen(pool, run.project, run.invocationID))
	if d := dev.start(); d > 3*time.Second {
		t.Errorf("restarted millrace dev took %v to serve BES", d)
	}
	code, out := wait()
	run.checkExit(t, code, out, " after the edge restart (38/45 mean the BES upload failed)", dev.output())
	run.checkProjection(t, db)
	dev.stop()
}

// checkCountedOnce: the invocation's events are applied once each and the
// build is counted once in the rollups.
func checkCountedOnce(t *testing.T, db, project, id string, s *bazelws.JSONSummary) {
	t.Helper()
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	b, err := builds.Show(ctx, pool, project, id)
	if err != nil {
		t.Fatal(err)
	}
	var events, rollupBuilds int64
	if err := pool.QueryRow(ctx, "select event_count from invocations where id = $1 and project = $2", id, project).Scan(&events); err != nil {
		t.Fatal(err)
	}
	// The stream carries each BEP event once plus ComponentStreamFinished.
	if int(events) != s.Events+1 {
		t.Errorf("projected %d tool events of invocation %s; Bazel's JSON file has %d BEP events (+1 stream end)", events, id, s.Events)
	}
	if err := pool.QueryRow(ctx, "select coalesce(sum(builds), 0) from hourly_rollups where project = $1", b.Project).Scan(&rollupBuilds); err != nil {
		t.Fatal(err)
	}
	if rollupBuilds != 1 {
		t.Errorf("hourly rollups count %d builds for project %s, want 1", rollupBuilds, b.Project)
	}
}

// TestPostgresOutage: PostgreSQL is away for 10 s while Bazel builds; the
// edge keeps acknowledging, Bazel's upload succeeds, and the projector
// catches up once the database is back.
func TestPostgresOutage(t *testing.T) {
	needBazel(t)
	ctx := context.Background()
	pg, err := devdb.StartPrivate(ctx, filepath.Join(t.TempDir(), "pg"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pg.Stop(context.Background()) })
	db, err := devdb.WithDatabase(pg.URL, "millrace")
	if err != nil {
		t.Fatal(err)
	}
	conn, err := pgxpool.New(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := conn.Exec(ctx, "create database millrace"); err != nil {
		t.Fatal(err)
	}
	conn.Close()
	dev := newDev(t, db)
	dev.start()
	// Wait until the projector is connected and has migrated the database.
	waitUntil(t, "the projector applies", func() bool { return strings.Contains(dev.output(), "msg=applying") })

	if err := pg.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	down := time.Now()
	run := newBazelRun(t, 60, dev.besAddr)
	code, out := run.start(t)()
	run.checkExit(t, code, out, " with the database down (the edge must keep acknowledging)", dev.output())
	if d := 10*time.Second - time.Since(down); d > 0 {
		time.Sleep(d) // the outage lasts 10 s in all
	}
	if err := pg.Start(ctx); err != nil {
		t.Fatal(err)
	}
	run.checkProjection(t, db)
	dev.stop()
}

// TestProjectorKilledMidBatch: the projector runs as its own process with
// small batches and is killed (SIGKILL) again and again while Bazel builds;
// the projection ends complete, nothing applied twice.
func TestProjectorKilledMidBatch(t *testing.T) {
	needBazel(t)
	db := testenv.Database(t)
	edge := newDev(t, db)
	edge.args = []string{"serve", "bes"}
	edge.start()
	proj := newDev(t, db)
	proj.besAddr = ""
	proj.args = []string{"project", "builds"}
	proj.env = append(proj.env, "MILLRACE_NATS_URL="+edge.natsURL, "MILLRACE_NATS_NKEY="+edge.natsNKey, "MILLRACE_BUILDS_BATCH=7", "MILLRACE_BUILDS_MAX_WAIT=10ms")
	proj.start()

	run := newBazelRun(t, 60, edge.besAddr)
	wait := run.start(t)
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	kills := 0
	deadline := time.Now().Add(90 * time.Second)
	for last := int64(0); kills < 4 && time.Now().Before(deadline); {
		var n int64
		var status string
		pool.QueryRow(context.Background(), "select event_count, status from invocations where id = $1 and project = $2",
			run.invocationID, run.project).Scan(&n, &status)
		if status != "" && status != "running" {
			break // projected to the end
		}
		if n > last+30 {
			proj.kill()
			kills++
			last = n
			proj.start()
		}
		time.Sleep(5 * time.Millisecond)
	}
	if kills < 2 {
		t.Fatalf("the projector was killed only %d times during the build", kills)
	}
	code, out := wait()
	run.checkExit(t, code, out, " while the projector was being killed", proj.output())
	run.checkProjection(t, db)
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestBazelTwoProjectsSameInvocationID: two clients with API keys of two
// projects build different workspaces at the same time with the same
// --invocation_id (any client may choose it). Each project gets its own
// complete build, as its Bazel reported it, counted once in its rollups;
// `builds show` without --project says which projects have the id.
func TestBazelTwoProjectsSameInvocationID(t *testing.T) {
	needBazel(t)
	db := testenv.Database(t)
	dev := newDev(t, db)
	const keyA, keyB = "alpha-0123456789abcdef", "beta-0123456789abcdef"
	dev.env = append(dev.env, "MILLRACE_BES_API_KEYS=alpha="+keyA+",beta="+keyB)
	dev.start()

	// Different workspaces, so that a merged build could not pass for either.
	a := newBazelRun(t, 24, dev.besAddr)
	b := newBazelRun(t, 13, dev.besAddr)
	b.invocationID, b.opt.InvocationID = a.invocationID, a.invocationID
	a.project, a.opt.ProjectID = "alpha", keyA
	b.project, b.opt.ProjectID = "beta", keyB
	waitA, waitB := a.start(t), b.start(t)
	codeA, outA := waitA()
	codeB, outB := waitB()
	a.checkExit(t, codeA, outA, " (project alpha)", dev.output())
	b.checkExit(t, codeB, outB, " (project beta)", dev.output())
	a.checkProjection(t, db)
	b.checkProjection(t, db)

	// Without --project: JSON refuses to pick one tenant's build and names
	// both; text prints both.
	show := func(args ...string) (string, error) {
		cmd := exec.Command(binary(t), append([]string{"builds", "show", a.invocationID}, args...)...)
		cmd.Env = append(os.Environ(), "DATABASE_URL="+db)
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	out, err := show("--json")
	if err == nil || !strings.Contains(out, "alpha, beta") || !strings.Contains(out, "--project") {
		t.Errorf("builds show --json without --project for an id of two projects: %v\n%s", err, out)
	}
	out, err = show()
	if err != nil || strings.Count(out, "invocation ") != 2 || !strings.Contains(out, "alpha") || !strings.Contains(out, "beta") {
		t.Errorf("builds show without --project: %v\n%s", err, out)
	}
	dev.stop()
}
