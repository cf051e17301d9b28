package bazelws

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/loadtest/besrecord"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
)

var recordFixtures = flag.Bool("record", false, "run Bazel to re-record loadtest/fixtures and testdata (see loadtest/fixtures/README.md)")

const bazelEventType = "type.googleapis.com/build_event_stream.BuildEvent"

// needBazel skips the test, loudly, when there is no bazel to run: the end-to-end tests are worth
// nothing if they pass by not running.
func needBazel(t *testing.T) {
	t.Helper()
	if _, err := exec.LookPath("bazel"); err != nil {
		t.Skip("SKIPPED: NO BAZEL ON PATH -- the end-to-end Bazel tests did not run. " +
			"Install Bazel 4.2.3 (Debian: apt-get install bazel-bootstrap) to run them.")
	}
	if testing.Short() {
		t.Skip("SKIPPED in -short mode: runs the real Bazel (about 15 s)")
	}
}

// run is one Bazel invocation against an in-process recorder.
type run struct {
	Name     string
	Options  Options
	Command  string
	BES      bool   // record BES; otherwise only the JSON file
	Dir      string // workspace parent; a fixed path makes the paths inside fixtures stable
	RecPath  string
	JSONPath string
	Project  string
}

type runResult struct {
	exp      *Expected
	exitCode int
	output   []byte
	args     []string
	elapsed  time.Duration
}

func (r run) do(t *testing.T) runResult {
	t.Helper()
	exp, err := Generate(r.Dir, r.Options)
	if err != nil {
		t.Fatal(err)
	}
	opt := RunOptions{Dir: r.Dir, Command: r.Command, JSONFile: r.JSONPath, ProjectID: r.Project}
	var rec *besrecord.Recorder
	if r.BES {
		rec, err = besrecord.Start("127.0.0.1:0", r.RecPath)
		if err != nil {
			t.Fatal(err)
		}
		defer rec.Close()
		opt.BESBackend = rec.Addr()
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd, err := Command(ctx, opt)
	if err != nil {
		t.Fatal(err)
	}
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	start := time.Now()
	err = cmd.Run()
	res := runResult{exp: exp, output: out.Bytes(), args: Args(opt), elapsed: time.Since(start)}
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("bazel did not run: %v\n%s", err, out.Bytes())
	}
	res.exitCode = cmd.ProcessState.ExitCode()
	if rec != nil {
		if err := rec.Close(); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%s: bazel %s exited %d in %v", r.Name, r.Command, res.exitCode, res.elapsed.Round(time.Millisecond))
	return res
}

// makeWritable lets t.TempDir's cleanup remove an output base in which Bazel made outputs read-only
// (root ignores the bits, other users do not).
func makeWritable(dir string) {
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && d.IsDir() {
			os.Chmod(p, 0o755)
		}
		return nil
	})
}

// checkSummary compares Bazel's JSON account of a run with what Generate promised.
func checkSummary(t *testing.T, exp *Expected, command string, exitCode int, s *JSONSummary) {
	t.Helper()
	wantCode, wantName := exp.ExitCode(command)
	if exitCode >= 0 && exitCode != wantCode {
		t.Errorf("bazel exited %d, want %d (%s)", exitCode, wantCode, wantName)
	}
	if !s.Finished || s.ExitCode != wantCode || s.ExitCodeName != wantName {
		t.Errorf("JSON finished=%v exit %d %s, want %d %s", s.Finished, s.ExitCode, s.ExitCodeName, wantCode, wantName)
	}
	if !s.LastMessage {
		t.Error("the JSON file does not end with lastMessage")
	}
	if s.Command != command {
		t.Errorf("JSON command %q, want %q", s.Command, command)
	}
	if !reflect.DeepEqual(s.Targets, exp.Targets) {
		t.Errorf("target outcomes differ:\n%s", diffMaps(exp.Targets, s.Targets))
	}
	wantTests := exp.Tests
	if command != "test" {
		wantTests = map[string]string{} // bazel build runs no tests and summarises none
	}
	if !reflect.DeepEqual(s.Tests, withoutStatus(wantTests, StatusFailedToBuild)) {
		t.Errorf("test summaries differ:\n%s", diffMaps(withoutStatus(wantTests, StatusFailedToBuild), s.Tests))
	}
	if command == "test" && !reflect.DeepEqual(s.TestStatuses(), wantTests) {
		t.Errorf("test statuses differ:\n%s", diffMaps(wantTests, s.TestStatuses()))
	}
}

func withoutStatus(m map[string]string, drop string) map[string]string {
	out := map[string]string{}
	for k, v := range m {
		if v != drop {
			out[k] = v
		}
	}
	return out
}

func diffMaps[V comparable](want, got map[string]V) string {
	var b strings.Builder
	for k, w := range want {
		if g, ok := got[k]; !ok {
			b.WriteString("  missing " + k + "\n")
		} else if g != w {
			b.WriteString("  " + k + ": got " + toString(g) + ", want " + toString(w) + "\n")
		}
	}
	for k, g := range got {
		if _, ok := want[k]; !ok {
			b.WriteString("  unexpected " + k + " = " + toString(g) + "\n")
		}
	}
	return b.String()
}

func toString(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case bool:
		if v {
			return "true"
		}
		return "false"
	}
	return "?"
}

// checkRecording checks a BES recording against the JSON file Bazel wrote in the same run: one stream
// of consecutive sequence numbers carrying as many bazel_events as the file has lines, then
// ComponentStreamFinished; the lifecycle events around it; project_id on every request.
func checkRecording(t *testing.T, recs []besrecord.Record, s *JSONSummary, project string) {
	t.Helper()
	var lifecycle []string
	invocations := map[string]bool{}
	var bazelEvents int
	var last int64
	finished := false
	for i, r := range recs {
		obe := r.OrderedBuildEvent()
		if r.Lifecycle != nil {
			if r.Lifecycle.GetProjectId() != project {
				t.Errorf("record %d: project_id %q, want %q", i, r.Lifecycle.GetProjectId(), project)
			}
			lifecycle = append(lifecycle, lifecycleKind(obe.GetEvent()))
			continue
		}
		if r.Stream.GetProjectId() != project {
			t.Errorf("record %d: project_id %q, want %q", i, r.Stream.GetProjectId(), project)
		}
		invocations[obe.GetStreamId().GetInvocationId()] = true
		if seq := obe.GetSequenceNumber(); seq != last+1 {
			t.Fatalf("record %d: sequence %d after %d", i, seq, last)
		}
		last = obe.GetSequenceNumber()
		if finished {
			t.Errorf("record %d: event after ComponentStreamFinished", i)
		}
		switch ev := obe.GetEvent(); {
		case ev.GetBazelEvent() != nil:
			if u := ev.GetBazelEvent().GetTypeUrl(); u != bazelEventType {
				t.Errorf("record %d: bazel_event type %q", i, u)
			}
			bazelEvents++
		case ev.GetComponentStreamFinished() != nil:
			finished = true
		default:
			t.Errorf("record %d: unexpected stream event %v", i, ev)
		}
	}
	if len(invocations) != 1 || !invocations[s.InvocationID] {
		t.Errorf("stream invocation ids %v, want only %q", invocations, s.InvocationID)
	}
	if bazelEvents != s.Events {
		t.Errorf("%d bazel_events on the stream, %d events in the JSON file", bazelEvents, s.Events)
	}
	if !finished {
		t.Error("no ComponentStreamFinished")
	}
	want := []string{"BuildEnqueued", "InvocationAttemptStarted", "InvocationAttemptFinished", "BuildFinished"}
	if !reflect.DeepEqual(lifecycle, want) {
		t.Errorf("lifecycle events %v, want %v", lifecycle, want)
	}
}

func lifecycleKind(ev *buildpb.BuildEvent) string {
	switch {
	case ev.GetBuildEnqueued() != nil:
		return "BuildEnqueued"
	case ev.GetInvocationAttemptStarted() != nil:
		return "InvocationAttemptStarted"
	case ev.GetInvocationAttemptFinished() != nil:
		return "InvocationAttemptFinished"
	case ev.GetBuildFinished() != nil:
		return "BuildFinished"
	}
	return "other"
}

// TestBazelEndToEnd runs the real Bazel on a 60-target workspace against an in-process recorder and
// checks that Bazel, its JSON file, the recording and Expected all agree.
func TestBazelEndToEnd(t *testing.T) {
	needBazel(t)
	dir := t.TempDir()
	t.Cleanup(func() { makeWritable(dir) })
	r := run{
		Name:     "e2e",
		Options:  Options{Targets: 60, Seed: 7},
		Command:  "test",
		BES:      true,
		Dir:      dir,
		RecPath:  filepath.Join(dir, "bazel.besrec"),
		JSONPath: filepath.Join(dir, "bazel.json"),
		Project:  "millrace-e2e",
	}
	res := r.do(t)
	s, err := ParseJSONFile(r.JSONPath)
	if err != nil {
		t.Fatalf("%v\nbazel output:\n%s", err, res.output)
	}
	checkSummary(t, res.exp, r.Command, res.exitCode, s)
	recs, err := besrecord.Read(r.RecPath)
	if err != nil {
		t.Fatal(err)
	}
	checkRecording(t, recs, s, r.Project)
	t.Logf("%d records, %d JSON events: %v", len(recs), s.Events, s.EventCounts)
	if t.Failed() {
		t.Logf("bazel %s\n%s", strings.Join(res.args, " "), res.output)
	}
}
