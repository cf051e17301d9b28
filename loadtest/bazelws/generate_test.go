package bazelws

import (
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
)

func readTree(t *testing.T, dir string) map[string]string {
	t.Helper()
	files := map[string]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		rel, _ := filepath.Rel(dir, p)
		files[rel] = string(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return files
}

func TestGenerateDeterministic(t *testing.T) {
	a, b, c := t.TempDir(), t.TempDir(), t.TempDir()
	ea, err := Generate(a, Options{Seed: 42})
	if err != nil {
		t.Fatal(err)
	}
	eb, err := Generate(b, Options{Seed: 42})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Generate(c, Options{Seed: 43}); err != nil {
		t.Fatal(err)
	}
	fa, fb, fc := readTree(t, a), readTree(t, b), readTree(t, c)
	if !reflect.DeepEqual(fa, fb) {
		t.Error("the same options gave different files")
	}
	if reflect.DeepEqual(fa, fc) {
		t.Error("different seeds gave the same files")
	}
	if !reflect.DeepEqual(ea.Targets, eb.Targets) || !reflect.DeepEqual(ea.Tests, eb.Tests) {
		t.Error("the same options gave different expectations")
	}

	// Generating again in place replaces the workspace rather than adding to it.
	if _, err := Generate(a, Options{Seed: 42, Targets: 12}); err != nil {
		t.Fatal(err)
	}
	var pkgs []string
	for p := range readTree(t, a) {
		if strings.HasPrefix(p, "ws/pkg") {
			pkgs = append(pkgs, p)
		}
	}
	if len(pkgs) != 2 { // ws/pkg00/BUILD, ws/pkg01/BUILD
		t.Errorf("after regenerating with 12 targets: %v, want two packages", pkgs)
	}
}

func TestGenerateDefaultMix(t *testing.T) {
	exp, err := Generate(t.TempDir(), Options{})
	if err != nil {
		t.Fatal(err)
	}
	count := map[Kind]int{}
	for _, k := range exp.Kinds {
		count[k]++
	}
	want := map[Kind]int{GenruleOK: 40, GenruleFail: 3, TestPass: 10, TestFail: 3, TestFlaky: 3, TestBroken: 1}
	if !reflect.DeepEqual(count, want) {
		t.Errorf("kinds %v, want %v", count, want)
	}
	if len(exp.Targets) != 60 || len(exp.Tests) != 17 {
		t.Errorf("%d targets, %d tests", len(exp.Targets), len(exp.Tests))
	}
	if code, name := exp.ExitCode("test"); code != 1 || name != "BUILD_FAILURE" {
		t.Errorf("ExitCode(test) = %d %s", code, name)
	}
	for l, k := range exp.Kinds {
		if !strings.Contains(l, ":"+string(k)+"_") {
			t.Errorf("label %s does not name its kind %s", l, k)
		}
	}
}

func TestGenerateOptionErrors(t *testing.T) {
	for name, opt := range map[string]Options{
		"mix too big":        {Targets: 4, Mix: &Mix{PassingTests: 5}},
		"broken needs a dep": {Targets: 10, Mix: &Mix{BrokenTests: 1}},
		"negative":           {Targets: 10, Mix: &Mix{FlakyTests: -1}},
		"default mix, tiny":  {Targets: 3},
	} {
		if _, err := Generate(t.TempDir(), opt); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

func TestExitCode(t *testing.T) {
	for _, tc := range []struct {
		mix     Mix
		command string
		code    int
		name    string
	}{
		{Mix{}, "build", 0, "SUCCESS"},
		{Mix{}, "test", 4, "NO_TESTS_FOUND"},
		{Mix{PassingTests: 2, FlakyTests: 1}, "test", 0, "SUCCESS"},
		{Mix{PassingTests: 2, FailingTests: 1}, "test", 3, "TESTS_FAILED"},
		{Mix{PassingTests: 2, FailingTests: 1}, "build", 0, "SUCCESS"},
		{Mix{FailingGenrules: 1, FailingTests: 1}, "test", 1, "BUILD_FAILURE"},
		{Mix{FailingGenrules: 1}, "build", 1, "BUILD_FAILURE"},
	} {
		e := &Expected{Mix: tc.mix}
		if code, name := e.ExitCode(tc.command); code != tc.code || name != tc.name {
			t.Errorf("%+v %s: %d %s, want %d %s", tc.mix, tc.command, code, name, tc.code, tc.name)
		}
	}
}

func TestStandInRepos(t *testing.T) {
	dir := t.TempDir()
	exp, err := Generate(dir, Options{Targets: 10})
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range StandInRepos {
		if _, err := os.Stat(filepath.Join(exp.Repos[r], "WORKSPACE")); err != nil {
			t.Errorf("%s: %v", r, err)
		}
	}
	cc, _ := os.ReadFile(filepath.Join(exp.Repos["rules_cc"], "cc", "defs.bzl"))
	if !strings.Contains(string(cc), "def cc_binary(**kw): native.cc_binary(**kw)\n") || strings.Count(string(cc), "def ") != 8 {
		t.Errorf("rules_cc/cc/defs.bzl:\n%s", cc)
	}
	java, _ := os.ReadFile(filepath.Join(exp.Repos["rules_java"], "java", "defs.bzl"))
	if strings.Count(string(java), "def ") != 10 {
		t.Errorf("rules_java/java/defs.bzl:\n%s", java)
	}
	fi, err := os.Stat(filepath.Join(exp.Repos["remote_coverage_tools"], "noop.sh"))
	if err != nil || fi.Mode().Perm()&0o111 == 0 {
		t.Errorf("noop.sh must be executable: %v %v", fi, err)
	}
}

func TestArgs(t *testing.T) {
	args := Args(RunOptions{Dir: "/w", BESBackend: "127.0.0.1:1985", Command: "build", Patterns: []string{"//pkg00:all"}})
	joined := strings.Join(args, " ")
	if !strings.HasPrefix(joined, "--batch --nohome_rc --output_user_root=/w/output_user_root build ") {
		t.Errorf("startup options and command: %s", joined)
	}
	if !strings.HasSuffix(joined, " -- //pkg00:all") {
		t.Errorf("patterns: %s", joined)
	}
	for _, want := range []string{"--bes_backend=grpc://127.0.0.1:1985", "--override_repository=rules_java=/w/repos/rules_java"} {
		if !strings.Contains(joined, want) {
			t.Errorf("missing %s in %s", want, joined)
		}
	}
	if strings.Contains(joined, "--flaky_test_attempts") {
		t.Errorf("test flags on a build: %s", joined)
	}
}

func ExampleArgs() {
	args := Args(RunOptions{
		Dir:        "/tmp/ws60",
		BESBackend: "127.0.0.1:1985",
		ProjectID:  "dev",
		JSONFile:   "/tmp/ws60/bep.json",
	})
	for _, a := range args {
		fmt.Println(a)
	}
	// Output:
	// --batch
	// --nohome_rc
	// --output_user_root=/tmp/ws60/output_user_root
	// test
	// --keep_going
	// --color=no
	// --curses=no
	// --nosandbox_debug
	// --experimental_repository_disable_download
	// --override_repository=remote_coverage_tools=/tmp/ws60/repos/remote_coverage_tools
	// --override_repository=rules_cc=/tmp/ws60/repos/rules_cc
	// --override_repository=rules_java=/tmp/ws60/repos/rules_java
	// --bes_backend=grpc://127.0.0.1:1985
	// --bes_timeout=60s
	// --bes_lifecycle_events
	// --project_id=dev
	// --build_event_json_file=/tmp/ws60/bep.json
	// --build_event_publish_all_actions
	// --nocache_test_results
	// --flaky_test_attempts=2
	// --test_env=MILLRACE_FLAKY_DIR=/tmp/ws60/flaky
	// --
	// //...
}
