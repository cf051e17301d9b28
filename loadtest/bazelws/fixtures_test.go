package bazelws

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/millrace/millrace/loadtest/besrecord"
)

// fixtureProject is the --project_id of every recorded fixture.
const fixtureProject = "millrace-fixtures"

// fixtures are the committed recordings: how each was made, and where it lives. Re-record them all with
//
//	go test ./loadtest/bazelws -run TestRecordFixtures -record
//
// (see loadtest/fixtures/README.md). Each workspace is generated under a fixed directory so that the
// paths Bazel puts in its events are the same on every recording.
var fixtures = []run{
	{
		Name:     "bazel-test-60",
		Options:  Options{Targets: 60, Seed: 1},
		Command:  "test",
		BES:      true,
		RecPath:  "../fixtures/bazel-test-60.besrec",
		JSONPath: "../fixtures/bazel-test-60.json",
	},
	{
		Name:     "bazel-build-10",
		Options:  Options{Targets: 10, Seed: 1, Mix: &Mix{}},
		Command:  "build",
		BES:      true,
		RecPath:  "../fixtures/bazel-build-10.besrec",
		JSONPath: "../fixtures/bazel-build-10.json",
	},
	{
		// The parser's own fixture: every outcome once, in as few events as possible.
		Name: "bazel-test-8",
		Options: Options{Targets: 8, Seed: 2, Mix: &Mix{
			FailingGenrules: 1, PassingTests: 1, FailingTests: 1, FlakyTests: 1, BrokenTests: 1,
		}},
		Command:  "test",
		JSONPath: "testdata/bazel-test-8.json",
	},
}

// fixtureDir is where a fixture's workspace is generated when it is recorded.
func fixtureDir(name string) string {
	return filepath.Join(os.TempDir(), "millrace-bazelws-fixtures", name)
}

// maxFixtureSize keeps the repository small; a fixture that outgrows it should use fewer targets.
const maxFixtureSize = 1 << 20

// TestRecordFixtures re-records every fixture with the real Bazel. It runs only with -record.
func TestRecordFixtures(t *testing.T) {
	if !*recordFixtures {
		t.Skip("re-records the committed fixtures; run with -record")
	}
	needBazel(t)
	for _, f := range fixtures {
		t.Run(f.Name, func(t *testing.T) {
			f.Dir = fixtureDir(f.Name)
			f.Project = fixtureProject
			makeWritable(f.Dir)
			if err := os.RemoveAll(f.Dir); err != nil {
				t.Fatal(err)
			}
			// Bazel writes into the fixture directory and the files are copied into the repository only
			// once checked: the JSON file's path is part of the command line that Bazel reports.
			dest := f
			f.RecPath = localPath(f.Dir, f.RecPath)
			f.JSONPath = localPath(f.Dir, f.JSONPath)
			res := f.do(t)
			t.Logf("%s: cd %s && bazel %s", f.Name, filepath.Join(f.Dir, wsSubdir), strings.Join(res.args, " "))
			s, err := ParseJSONFile(f.JSONPath)
			if err != nil {
				t.Fatal(err)
			}
			checkSummary(t, res.exp, f.Command, res.exitCode, s)
			if f.BES {
				recs, err := besrecord.Read(f.RecPath)
				if err != nil {
					t.Fatal(err)
				}
				checkRecording(t, recs, s, f.Project)
				t.Logf("%s: %d records, %d bazel events, invocation %s", f.Name, len(recs), s.Events, s.InvocationID)
			}
			checkSizes(t, f)
			if !t.Failed() {
				copyFile(t, f.RecPath, dest.RecPath)
				copyFile(t, f.JSONPath, dest.JSONPath)
			}
			if t.Failed() {
				t.Logf("bazel output:\n%s", res.output)
			}
		})
	}
}

// localPath is where a fixture destined for repoPath is written while it is recorded.
func localPath(dir, repoPath string) string {
	if repoPath == "" {
		return ""
	}
	return filepath.Join(dir, filepath.Base(repoPath))
}

func copyFile(t *testing.T, from, to string) {
	t.Helper()
	if from == "" {
		return
	}
	b, err := os.ReadFile(from)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(to), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(to, b, 0o644); err != nil {
		t.Fatal(err)
	}
}

func checkSizes(t *testing.T, f run) {
	t.Helper()
	for _, p := range []string{f.RecPath, f.JSONPath} {
		if p == "" {
			continue
		}
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		if fi.Size() > maxFixtureSize {
			t.Errorf("%s is %d bytes, over %d", p, fi.Size(), maxFixtureSize)
		}
	}
}

// TestFixtures checks the committed fixtures without Bazel: each JSON file says what its workspace
// promised, and each recording carries the same events as the JSON file of its run.
func TestFixtures(t *testing.T) {
	for _, f := range fixtures {
		t.Run(f.Name, func(t *testing.T) {
			if _, err := os.Stat(f.JSONPath); err != nil {
				t.Fatalf("fixture missing (re-record with -record): %v", err)
			}
			// Generate is deterministic, so regenerating gives the Expected of the recorded workspace.
			exp, err := Generate(t.TempDir(), f.Options)
			if err != nil {
				t.Fatal(err)
			}
			s, err := ParseJSONFile(f.JSONPath)
			if err != nil {
				t.Fatal(err)
			}
			checkSummary(t, exp, f.Command, -1, s)
			if f.BES {
				recs, err := besrecord.Read(f.RecPath)
				if err != nil {
					t.Fatal(err)
				}
				checkRecording(t, recs, s, fixtureProject)
			}
			checkSizes(t, f)
		})
	}
}
