package builds

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"io"
	"io/fs"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/loadtest/bazelws"
	"github.com/millrace/millrace/loadtest/besrecord"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/subjects"
)

// The fixture testdata/bazel_test.besrec.zst is a real Bazel 4.2.3 build
// (`bazel test //... --keep_going` on a 50-target workspace from
// loadtest/bazelws with its default mix of outcomes), recorded at the BES
// level by loadtest/besrecord and zstd-compressed. What bazelws promised
// Bazel would report is beside it in bazel_test.expected.json.
//
// Regenerate with: go test ./projectors/builds -run TestRecordBazelFixture -record-bazel
var recordBazel = flag.Bool("record-bazel", false, "run Bazel to re-record testdata/bazel_test.besrec.zst")

const (
	fixturePath     = "testdata/bazel_test.besrec.zst"
	fixtureExpected = "testdata/bazel_test.expected.json"
	fixtureProject  = "fixture"
)

type fixtureExpectation struct {
	ExitCode     int               `json:"exit_code"`
	ExitCodeName string            `json:"exit_code_name"`
	Targets      map[string]bool   `json:"targets"`
	Tests        map[string]string `json:"tests"`
}

func TestRecordBazelFixture(t *testing.T) {
	if !*recordBazel {
		t.Skip("run with -record-bazel to re-record the Bazel fixture")
	}
	if _, err := exec.LookPath("bazel"); err != nil {
		t.Fatal("no bazel on PATH (apt-get install bazel-bootstrap)")
	}
	// A fixed directory keeps the paths inside the events stable.
	dir := filepath.Join(os.TempDir(), "millrace-builds-fixture")
	defer func() {
		filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
			if err == nil && d.IsDir() {
				os.Chmod(p, 0o755)
			}
			return nil
		})
		os.RemoveAll(dir)
	}()
	exp, err := bazelws.Generate(dir, bazelws.Options{Targets: 50, Seed: 7})
	if err != nil {
		t.Fatal(err)
	}
	recPath := filepath.Join(dir, "events.besrec")
	rec, err := besrecord.Start("127.0.0.1:0", recPath)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd, err := bazelws.Command(ctx, bazelws.RunOptions{
		Dir: dir, BESBackend: rec.Addr(), ProjectID: fixtureProject,
		InvocationID: "3f1c6a52-5b7e-4c1e-9d7a-2a5f0e8b9c41",
	})
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	if err != nil && !errors.As(err, &ee) {
		t.Fatalf("bazel: %v\n%s", err, out)
	}
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(recPath)
	if err != nil {
		t.Fatal(err)
	}
	enc, _ := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedBestCompression), zstd.WithEncoderConcurrency(1))
	if err := os.WriteFile(fixturePath, enc.EncodeAll(raw, nil), 0o644); err != nil {
		t.Fatal(err)
	}
	code, name := exp.ExitCode("test")
	js, _ := json.MarshalIndent(fixtureExpectation{code, name, exp.Targets, exp.Tests}, "", "  ")
	if err := os.WriteFile(fixtureExpected, append(js, '\n'), 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("bazel exited %d; recorded %d bytes", cmd.ProcessState.ExitCode(), len(raw))
}

// fixtureMessages turns this package's recording into stream messages as
// the BES edge publishes them.
func fixtureMessages(t testing.TB) []*msg {
	t.Helper()
	f, err := os.Open(fixturePath)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	zr, err := zstd.NewReader(f, zstd.WithDecoderConcurrency(1))
	if err != nil {
		t.Fatal(err)
	}
	defer zr.Close()
	return recordingMessages(t, zr)
}

// recordingMessages turns a besrecord recording into stream messages.
func recordingMessages(t testing.TB, rd io.Reader) []*msg {
	t.Helper()
	r := besrecord.NewReader(rd)
	s := newStream(t0)
	for {
		rec, err := r.Next()
		if err != nil {
			if err == io.EOF {
				break
			}
			t.Fatal(err)
		}
		obe := rec.OrderedBuildEvent()
		kind, project := envelope.KindTool, ""
		if rec.Lifecycle != nil {
			kind, project = envelope.KindLifecycle, rec.Lifecycle.GetProjectId()
		} else {
			project = rec.Stream.GetProjectId()
		}
		data, err := proto.MarshalOptions{Deterministic: true}.Marshal(obe)
		if err != nil {
			t.Fatal(err)
		}
		sid := obe.GetStreamId()
		s.add(&msg{
			subject: subjects.BES(project, sid.GetInvocationId()),
			data:    data,
			hdr: map[string]string{
				envelope.Schema:       envelope.SchemaBESv1,
				envelope.Kind:         kind,
				envelope.Project:      project,
				envelope.BuildID:      sid.GetBuildId(),
				envelope.InvocationID: sid.GetInvocationId(),
				envelope.Sequence:     strconv.FormatInt(obe.GetSequenceNumber(), 10),
			},
		})
	}
	if len(s.msgs) == 0 {
		t.Fatal("empty fixture")
	}
	return s.msgs
}

// TestBazelFixture projects the real Bazel build and checks it against what
// Bazel reported (as bazelws expected it) and against the golden file.
func TestBazelFixture(t *testing.T) {
	msgs := fixtureMessages(t)
	var want fixtureExpectation
	js, err := os.ReadFile(fixtureExpected)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(js, &want); err != nil {
		t.Fatal(err)
	}
	inv := msgs[len(msgs)-1].hdr[envelope.InvocationID]
	for _, m := range msgs {
		if id := m.hdr[envelope.InvocationID]; id != "" {
			inv = id
		}
	}

	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	var first map[string]string
	for _, n := range []int{1000, 1, 7} {
		truncate(t, pool)
		applyAll(t, pool, p, msgs, n)
		d := digest(t, pool)
		if first == nil {
			first = d
			golden(t, "bazel_test.golden", dump(t, pool, invKey{fixtureProject, inv}))
		} else if !maps.Equal(first, d) {
			t.Errorf("batches of %d: digest differs from batches of 1000", n)
		}
		applyAll(t, pool, p, msgs, n)
		if again := digest(t, pool); !maps.Equal(d, again) {
			t.Errorf("batches of %d applied twice: digest changed", n)
		}
	}

	b, err := Show(ctx, pool, fixtureProject, inv)
	if err != nil {
		t.Fatal(err)
	}
	if b.ExitCode == nil || int(*b.ExitCode) != want.ExitCode || *b.ExitCodeName != want.ExitCodeName {
		t.Errorf("exit code %v %v, want %d %s", b.ExitCode, b.ExitCodeName, want.ExitCode, want.ExitCodeName)
	}
	wantStatus := "succeeded"
	if want.ExitCode != 0 {
		wantStatus = "failed"
	}
	if b.Status != wantStatus {
		t.Errorf("status %s, want %s", b.Status, wantStatus)
	}
	gotTargets := map[string]bool{}
	dependents := 0
	for _, tg := range b.Targets {
		gotTargets[tg.Label] = tg.Success
		if tg.Success {
			continue
		}
		// A failed target either failed itself (its reason, and itself
		// among its root causes) or because of a dependency (no copy of
		// the dependency's message: the root cause carries it).
		own := len(tg.RootCauses) == 0 || slices.ContainsFunc(tg.RootCauses, func(c Cause) bool { return c.Label == tg.Label })
		if !own {
			dependents++
		}
		if own != (tg.FailureReason != nil) {
			t.Errorf("failed target %s: failure reason %q with root causes %+v", tg.Label, deref(tg.FailureReason), tg.RootCauses)
		}
		for _, c := range tg.RootCauses {
			if c.Kind != "action" || c.ExitCode == nil || *c.ExitCode == 0 || c.Message == nil ||
				!strings.HasPrefix(deref(c.StderrURI), "file://") || deref(c.Mnemonic) != "Genrule" {
				t.Errorf("failed target %s: root cause %+v, want the failed genrule's action", tg.Label, c)
			}
		}
	}
	if dependents == 0 {
		t.Error("no target failed because of a dependency (the fixture has tests of failing genrules)")
	}
	if !maps.Equal(gotTargets, want.Targets) {
		t.Errorf("targets differ from Bazel's:\n got %v\nwant %v", gotTargets, want.Targets)
	}
	gotTests := map[string]string{}
	for _, ts := range b.Tests {
		gotTests[ts.Label] = ts.Status
	}
	for label, status := range want.Tests {
		if status == "FAILED_TO_BUILD" {
			continue // Bazel sends no test event for these (docs/design.md, "Bazel as a client")
		}
		if gotTests[label] != status {
			t.Errorf("test %s: %q, want %q", label, gotTests[label], status)
		}
	}
	stdout, stderr, err := Output(ctx, pool, fixtureProject, inv)
	if err != nil || len(stdout)+len(stderr) == 0 {
		t.Errorf("output: %d+%d bytes, %v", len(stdout), len(stderr), err)
	}
}

// TestRecordedFixtures projects the shared recordings in loadtest/fixtures
// (another package's; skipped until they exist) and compares the result
// with what Bazel wrote in its own JSON file of the same run.
func TestRecordedFixtures(t *testing.T) {
	recs, _ := filepath.Glob("../../loadtest/fixtures/*.besrec")
	if len(recs) == 0 {
		t.Skip("no recordings in loadtest/fixtures yet")
	}
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	for _, path := range recs {
		t.Run(filepath.Base(path), func(t *testing.T) {
			want, err := bazelws.ParseJSONFile(strings.TrimSuffix(path, ".besrec") + ".json")
			if err != nil {
				t.Skipf("no Bazel JSON beside the recording: %v", err)
			}
			f, err := os.Open(path)
			if err != nil {
				t.Fatal(err)
			}
			msgs := recordingMessages(t, f)
			f.Close()

			var first map[string]string
			for _, n := range []int{1000, 1, 7} {
				truncate(t, pool)
				applyAll(t, pool, p, msgs, n)
				applyAll(t, pool, p, msgs[len(msgs)/2:], n) // a redelivered second half
				d := digest(t, pool)
				if first == nil {
					first = d
				} else if !maps.Equal(first, d) {
					t.Errorf("batches of %d: digest differs from batches of 1000", n)
				}
			}

			projects, err := Projects(ctx, pool, want.InvocationID)
			if err != nil || len(projects) != 1 {
				t.Fatalf("projects holding %s: %v %v, want one", want.InvocationID, projects, err)
			}
			b, err := Show(ctx, pool, projects[0], want.InvocationID)
			if err != nil {
				t.Fatal(err)
			}
			if b.ExitCode == nil || int(*b.ExitCode) != want.ExitCode || *b.ExitCodeName != want.ExitCodeName {
				t.Errorf("exit code %v %v, want %d %s", b.ExitCode, b.ExitCodeName, want.ExitCode, want.ExitCodeName)
			}
			if b.Command == nil || *b.Command != want.Command {
				t.Errorf("command %v, want %s", b.Command, want.Command)
			}
			gotTargets, gotKinds := map[string]bool{}, map[string]string{}
			for _, tg := range b.Targets {
				gotKinds[tg.Label] = tg.Kind
				if _, ok := want.Targets[tg.Label]; ok {
					gotTargets[tg.Label] = tg.Success
				}
			}
			if !maps.Equal(gotTargets, want.Targets) {
				t.Errorf("target outcomes differ from Bazel's JSON:\n got %v\nwant %v", gotTargets, want.Targets)
			}
			if !maps.Equal(gotKinds, want.TargetKinds) {
				t.Errorf("target kinds differ from Bazel's JSON:\n got %v\nwant %v", gotKinds, want.TargetKinds)
			}
			gotTests := map[string]string{}
			for _, ts := range b.Tests {
				gotTests[ts.Label] = ts.Status
			}
			if !maps.Equal(gotTests, want.Tests) {
				t.Errorf("test statuses differ from Bazel's JSON:\n got %v\nwant %v", gotTests, want.Tests)
			}
			checkAgainstJSON(t, b, want)
			var events int64
			pool.QueryRow(ctx, `select event_count from invocations where id = $1 and project = $2`,
				want.InvocationID, projects[0]).Scan(&events)
			if events != int64(want.Events)+1 { // + ComponentStreamFinished
				t.Errorf("event_count %d, want %d bazel events + 1", events, want.Events)
			}
		})
	}
}

// checkAgainstJSON compares what the projection says of a build's
// metadata and failures with Bazel's own JSON file of the same run.
func checkAgainstJSON(t *testing.T, b *Build, want *bazelws.JSONSummary) {
	t.Helper()
	status := map[string]string{}
	for _, it := range b.WorkspaceStatus {
		status[it.Key] = it.Value
	}
	if !maps.Equal(status, want.WorkspaceStatus) {
		t.Errorf("workspace status differs from Bazel's JSON:\n got %v\nwant %v", status, want.WorkspaceStatus)
	}
	if !maps.Equal(b.BuildMetadata, want.BuildMetadata) {
		t.Errorf("build metadata differs from Bazel's JSON:\n got %v\nwant %v", b.BuildMetadata, want.BuildMetadata)
	}
	if len(b.CommandLine) == 0 || b.CommandLine[0] != "bazel" {
		t.Errorf("canonical command line %q", b.CommandLine)
	}
	causes := map[string][]string{}
	for _, tg := range b.Targets {
		if tg.Success {
			if len(tg.RootCauses) > 0 {
				t.Errorf("target %s succeeded but has root causes %+v", tg.Label, tg.RootCauses)
			}
			continue
		}
		labels := []string{}
		for _, c := range tg.RootCauses {
			if !slices.Contains(labels, c.Label) {
				labels = append(labels, c.Label)
			}
			if c.Kind == "action" {
				if code, ok := want.FailedActions[c.Label]; !ok || c.ExitCode == nil || int(*c.ExitCode) != code {
					t.Errorf("target %s: root cause %s exit code %v, Bazel's %d", tg.Label, c.Label, c.ExitCode, code)
				}
			}
		}
		slices.Sort(labels)
		causes[tg.Label] = labels
	}
	if !maps.EqualFunc(causes, want.RootCauses, slices.Equal) {
		t.Errorf("root causes differ from Bazel's JSON:\n got %v\nwant %v", causes, want.RootCauses)
	}
}
