// Package bazelws makes Bazel a real, offline client for millrace's end-to-end tests and fixtures.
//
// It owns three things:
//   - Generate writes a Bazel workspace with a known mix of outcomes (genrules that succeed or fail; tests
//     that pass, fail, are flaky, or fail to build) and says in Expected what Bazel must report for it;
//   - Args and Command give the bazel command line that runs that workspace with no network against a BES
//     backend (the offline stand-ins and flags are those of docs/design.md, "Bazel as a client");
//   - ParseJSONFile reads what Bazel itself wrote with --build_event_json_file, so that a test can compare
//     millrace's projection with Bazel's own account of the same build.
//
// Bazel here is Debian's bazel-bootstrap 4.2.3; nothing in this package downloads anything.
package bazelws

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"github.com/millrace/millrace/schemas/bep"
)

// WorkspaceName is the name in the generated WORKSPACE file; test scripts find their runfiles under it.
const WorkspaceName = "millrace_bazelws"

// Layout of the directory given to Generate. Everything is derived from that one directory so that Args
// needs nothing from Generate's result.
const (
	wsSubdir    = "ws"    // the workspace; bazel runs here
	reposSubdir = "repos" // the offline stand-in repositories
	flakySubdir = "flaky" // default state directory of flaky tests
)

// StandInRepos are the repositories that `bazel test` would download and that Generate writes as tiny
// local stand-ins, for --override_repository.
var StandInRepos = []string{"remote_coverage_tools", "rules_cc", "rules_java"}

// FlakyEnv is the environment variable, passed with --test_env, that names the directory where flaky
// tests remember that they already failed once.
const FlakyEnv = "MILLRACE_FLAKY_DIR"

// Kind is what a generated target is and how it is meant to end.
type Kind string

// Target kinds.
const (
	GenruleOK   Kind = "genrule_ok"   // writes its output; may depend on other succeeding genrules
	GenruleFail Kind = "genrule_fail" // its action exits 1 with a message on stderr
	TestPass    Kind = "test_pass"    // passes
	TestFail    Kind = "test_fail"    // fails on every attempt
	TestFlaky   Kind = "test_flaky"   // fails on the first attempt, passes on the second
	TestBroken  Kind = "test_broken"  // depends on a failing genrule, so it fails to build and never runs
)

// Test statuses as Bazel's build_event_stream.TestStatus enum spells them
// (the generated names of schemas/bep, which are Bazel's).
var (
	StatusNoStatus      = bep.TestStatus_NO_STATUS.String()
	StatusPassed        = bep.TestStatus_PASSED.String()
	StatusFlaky         = bep.TestStatus_FLAKY.String()
	StatusFailed        = bep.TestStatus_FAILED.String()
	StatusFailedToBuild = bep.TestStatus_FAILED_TO_BUILD.String()
)

// Mix says how many targets of each kind other than GenruleOK a workspace has.
type Mix struct {
	FailingGenrules int
	PassingTests    int
	FailingTests    int
	FlakyTests      int
	BrokenTests     int // each depends on one failing genrule, so FailingGenrules must be > 0
}

func (m Mix) total() int {
	return m.FailingGenrules + m.PassingTests + m.FailingTests + m.FlakyTests + m.BrokenTests
}

// DefaultMix is the mix for n targets when Options.Mix is nil: about a third tests, and a few of every
// failure kind, so that one build exercises every status. For 60 targets: 40 succeeding genrules,
// 3 failing genrules, 10 passing, 3 failing, 3 flaky and 1 broken test.
func DefaultMix(n int) Mix {
	return Mix{
		FailingGenrules: max(1, n/20),
		PassingTests:    n / 6,
		FailingTests:    max(1, n/20),
		FlakyTests:      max(1, n/20),
		BrokenTests:     max(1, n/60),
	}
}

// Options configure Generate. The zero value is a 60-target workspace with the default mix and seed 0.
type Options struct {
	// Targets is the number of targets; 0 means 60.
	Targets int
	// Seed makes everything else deterministic: which package each target lands in, the dependencies
	// between targets, and the content of outputs and messages. The same Options give the same files.
	Seed uint64
	// Mix is the number of failing genrules and of tests of each kind; the remaining targets are
	// succeeding genrules. Nil means DefaultMix(Targets). &Mix{} means genrules only, all succeeding.
	Mix *Mix
	// PerPackage is the number of targets per BUILD package; 0 means 10.
	PerPackage int
}

func (o Options) withDefaults() (Options, Mix, error) {
	if o.Targets == 0 {
		o.Targets = 60
	}
	if o.PerPackage == 0 {
		o.PerPackage = 10
	}
	var mix Mix
	if o.Mix != nil {
		mix = *o.Mix
	} else {
		mix = DefaultMix(o.Targets)
	}
	switch {
	case o.Targets < 0 || o.PerPackage < 0:
		return o, mix, errors.New("bazelws: Targets and PerPackage must not be negative")
	case mix.FailingGenrules < 0 || mix.PassingTests < 0 || mix.FailingTests < 0 || mix.FlakyTests < 0 || mix.BrokenTests < 0:
		return o, mix, errors.New("bazelws: Mix counts must not be negative")
	case mix.total() > o.Targets:
		return o, mix, fmt.Errorf("bazelws: the mix needs %d targets, more than Targets=%d", mix.total(), o.Targets)
	case mix.BrokenTests > 0 && mix.FailingGenrules == 0:
		return o, mix, errors.New("bazelws: broken tests need at least one failing genrule to depend on")
	}
	return o, mix, nil
}

// Expected is what Bazel must report for a generated workspace.
type Expected struct {
	Dir       string            // the directory given to Generate
	Workspace string            // the workspace root, where bazel must run
	Repos     map[string]string // stand-in repository name -> directory, for --override_repository
	Mix       Mix               // the mix actually generated (the default filled in)

	// Kinds maps every label (//pkg00:gen_ok_000) to its kind.
	Kinds map[string]Kind
	// Targets maps every label to the success its target_completed event must carry, with bazel build and
	// with bazel test alike: a test that builds completes successfully even if it then fails, and its
	// failure shows only in its test summary.
	Targets map[string]bool
	// Tests maps every test label to its status under `bazel test` with --flaky_test_attempts=2 and a
	// fresh flaky state directory. Broken tests get FAILED_TO_BUILD, which Bazel shows in its terminal
	// summary but sends no test_summary event for.
	Tests map[string]string
}

// Labels returns every label, sorted.
func (e *Expected) Labels() []string {
	out := make([]string, 0, len(e.Kinds))
	for l := range e.Kinds {
		out = append(out, l)
	}
	sort.Strings(out)
	return out
}

// ExitCode is the exit code, and its name as BuildFinished.ExitCode spells it, of `bazel <command> //...
// --keep_going` on the workspace. The names are written out: Bazel's exit codes are no proto enum (the
// event carries a name and a number), so there are no generated names to take them from. Any failed build action wins over failed tests: with a failing genrule
// in the workspace `bazel test` exits 1 (BUILD_FAILURE), not 3.
func (e *Expected) ExitCode(command string) (int, string) {
	if e.Mix.FailingGenrules > 0 {
		return 1, "BUILD_FAILURE"
	}
	if command != "test" {
		return 0, "SUCCESS"
	}
	tests := e.Mix.PassingTests + e.Mix.FailingTests + e.Mix.FlakyTests + e.Mix.BrokenTests
	switch {
	case tests == 0:
		return 4, "NO_TESTS_FOUND"
	case e.Mix.FailingTests > 0:
		return 3, "TESTS_FAILED"
	}
	return 0, "SUCCESS"
}

// target is one generated rule.
type target struct {
	pkg, name string
	kind      Kind
	deps      []*target // srcs of a genrule, data of a test
	lines     int       // size of a genrule's output, in lines
}

func (t *target) label() string { return "//" + t.pkg + ":" + t.name }
func (t *target) out() string   { return t.name + ".txt" } // genrule output, relative to its package

// Generate writes, under dir, a workspace (dir/ws) and the stand-in repositories (dir/repos/NAME) that
// Args points --override_repository at. It replaces dir/ws and dir/repos if they exist and leaves
// anything else under dir alone (an output_user_root kept there stays warm).
func Generate(dir string, opt Options) (*Expected, error) {
	opt, mix, err := opt.withDefaults()
	if err != nil {
		return nil, err
	}
	dir, err = filepath.Abs(dir)
	if err != nil {
		return nil, err
	}
	exp := &Expected{
		Dir:       dir,
		Workspace: filepath.Join(dir, wsSubdir),
		Repos:     map[string]string{},
		Mix:       mix,
		Kinds:     map[string]Kind{},
		Targets:   map[string]bool{},
		Tests:     map[string]string{},
	}
	for _, sub := range []string{wsSubdir, reposSubdir} {
		if err := os.RemoveAll(filepath.Join(dir, sub)); err != nil {
			return nil, err
		}
	}

	targets := plan(opt, mix)

	files := map[string]string{ // path relative to dir -> content
		wsSubdir + "/WORKSPACE": fmt.Sprintf("# Generated by millrace loadtest/bazelws (seed %d); do not edit.\nworkspace(name = %q)\n", opt.Seed, WorkspaceName),
		wsSubdir + "/BUILD":     "",
		wsSubdir + "/defs.bzl":  defsBzl,
	}
	byPkg := map[string][]*target{}
	var pkgs []string
	for _, t := range targets {
		if _, ok := byPkg[t.pkg]; !ok {
			pkgs = append(pkgs, t.pkg)
		}
		byPkg[t.pkg] = append(byPkg[t.pkg], t)

		l := t.label()
		exp.Kinds[l] = t.kind
		exp.Targets[l] = t.kind != GenruleFail && t.kind != TestBroken
		switch t.kind {
		case TestPass:
			exp.Tests[l] = StatusPassed
		case TestFail:
			exp.Tests[l] = StatusFailed
		case TestFlaky:
			exp.Tests[l] = StatusFlaky
		case TestBroken:
			exp.Tests[l] = StatusFailedToBuild
		}
	}
	for _, p := range pkgs {
		files[wsSubdir+"/"+p+"/BUILD"] = buildFile(opt.Seed, byPkg[p])
	}
	for name, content := range standIns() {
		files[reposSubdir+"/"+name] = content
	}
	for _, r := range StandInRepos {
		exp.Repos[r] = filepath.Join(dir, reposSubdir, r)
	}

	paths := make([]string, 0, len(files))
	for p := range files {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	for _, p := range paths {
		full := filepath.Join(dir, filepath.FromSlash(p))
		if err := os.MkdirAll(filepath.Dir(full), 0o755); err != nil {
			return nil, err
		}
		mode := os.FileMode(0o644)
		if strings.HasSuffix(p, ".sh") {
			mode = 0o755
		}
		if err := os.WriteFile(full, []byte(files[p]), mode); err != nil {
			return nil, err
		}
	}
	return exp, nil
}

// plan decides every target from the seed alone.
func plan(opt Options, mix Mix) []*target {
	rng := rand.New(rand.NewPCG(opt.Seed, 0x6d696c6c72616365)) // "millrace"
	kinds := make([]Kind, 0, opt.Targets)
	add := func(k Kind, n int) {
		for range n {
			kinds = append(kinds, k)
		}
	}
	add(GenruleFail, mix.FailingGenrules)
	add(TestPass, mix.PassingTests)
	add(TestFail, mix.FailingTests)
	add(TestFlaky, mix.FlakyTests)
	add(TestBroken, mix.BrokenTests)
	add(GenruleOK, opt.Targets-len(kinds))
	rng.Shuffle(len(kinds), func(i, j int) { kinds[i], kinds[j] = kinds[j], kinds[i] })

	targets := make([]*target, len(kinds))
	var ok, failing []*target
	for i, k := range kinds {
		t := &target{
			pkg:   fmt.Sprintf("pkg%02d", i/opt.PerPackage),
			name:  fmt.Sprintf("%s_%03d", k, i),
			kind:  k,
			lines: 1 + rng.IntN(20),
		}
		targets[i] = t
		switch k {
		case GenruleOK:
			// Only on earlier succeeding genrules: the graph stays acyclic and every such genrule builds.
			for range rng.IntN(3) {
				if len(ok) > 0 {
					t.deps = appendUnique(t.deps, ok[rng.IntN(len(ok))])
				}
			}
			ok = append(ok, t)
		case TestPass, TestFail, TestFlaky:
			if len(ok) > 0 && rng.IntN(2) == 0 {
				t.deps = []*target{ok[rng.IntN(len(ok))]}
			}
		case GenruleFail:
			failing = append(failing, t)
		}
	}
	// Broken tests are wired last, because the failing genrule they need may come later in the order.
	for _, t := range targets {
		if t.kind == TestBroken {
			t.deps = []*target{failing[rng.IntN(len(failing))]}
		}
	}
	return targets
}

func appendUnique(ts []*target, t *target) []*target {
	for _, x := range ts {
		if x == t {
			return ts
		}
	}
	return append(ts, t)
}

// defsBzl holds the test rule. A Starlark rule with test = True that writes a shell script needs no
// toolchain (sh_test would pull in more of what the offline Bazel lacks) and lets each test carry its
// script inline in the BUILD file.
const defsBzl = `# Generated by millrace loadtest/bazelws; do not edit.

def _script_test_impl(ctx):
    out = ctx.actions.declare_file(ctx.label.name + ".sh")
    ctx.actions.write(out, ctx.attr.script, is_executable = True)
    return [DefaultInfo(executable = out, runfiles = ctx.runfiles(files = ctx.files.data))]

script_test = rule(
    implementation = _script_test_impl,
    test = True,
    attrs = {
        "script": attr.string(mandatory = True),
        "data": attr.label_list(allow_files = True),
    },
)
`

func buildFile(seed uint64, ts []*target) string {
	var b strings.Builder
	fmt.Fprintf(&b, "# Generated by millrace loadtest/bazelws (seed %d); do not edit.\n", seed)
	b.WriteString("load(\"//:defs.bzl\", \"script_test\")\n\n")
	b.WriteString("package(default_visibility = [\"//visibility:public\"])\n")
	for _, t := range ts {
		b.WriteString("\n")
		switch t.kind {
		case GenruleOK:
			writeGenruleOK(&b, seed, t)
		case GenruleFail:
			fmt.Fprintf(&b, "genrule(\n    name = %q,\n    outs = [%q],\n    cmd = %q,\n)\n", t.name, t.out(),
				fmt.Sprintf("echo '%s: failing on purpose (millrace bazelws fixture)' >&2; exit 1", t.label()))
		default:
			writeTest(&b, t)
		}
	}
	return b.String()
}

func writeGenruleOK(b *strings.Builder, seed uint64, t *target) {
	// The output is the inputs followed by a few lines of its own, so outputs differ in size and depend on
	// their inputs like real build steps.
	cmd := fmt.Sprintf("for i in $$(seq %d); do echo \"%s line $$i seed %d\"; done", t.lines, t.label(), seed)
	if len(t.deps) > 0 {
		cmd = "cat $(SRCS) > $@; " + cmd + " >> $@"
	} else {
		cmd += " > $@"
	}
	fmt.Fprintf(b, "genrule(\n    name = %q,\n", t.name)
	if len(t.deps) > 0 {
		fmt.Fprintf(b, "    srcs = [%s],\n", quotedLabels(t.deps))
	}
	fmt.Fprintf(b, "    outs = [%q],\n    cmd = %q,\n)\n", t.out(), cmd)
}

func writeTest(b *strings.Builder, t *target) {
	var script strings.Builder
	script.WriteString("#!/bin/sh\n")
	for _, d := range t.deps {
		if d.kind != GenruleOK {
			continue // a broken test never runs
		}
		// Checking the data dependency makes the test use what it depends on, as real tests do.
		fmt.Fprintf(&script, "test -s \"$TEST_SRCDIR/$TEST_WORKSPACE/%s/%s\" || { echo 'missing runfile %s' >&2; exit 1; }\n", d.pkg, d.out(), d.out())
	}
	var tags []string
	switch t.kind {
	case TestPass, TestBroken:
		fmt.Fprintf(&script, "echo '%s: passing'\n", t.label())
	case TestFail:
		fmt.Fprintf(&script, "echo '%s: failing on purpose' >&2\nexit 1\n", t.label())
	case TestFlaky:
		// The marker file outlives the first attempt because it is outside Bazel's test directories. As
		// root here, a sandboxed test could write it too, but no-sandbox keeps the test flaky wherever a
		// sandbox would make that directory read-only or hide it.
		fmt.Fprintf(&script, `marker="${%s:?pass --test_env=%s=DIR}/%s.%s"
if [ -e "$marker" ]; then echo '%s: second attempt passes'; exit 0; fi
: > "$marker"
echo '%s: first attempt fails on purpose' >&2
exit 1
`, FlakyEnv, FlakyEnv, t.pkg, t.name, t.label(), t.label())
		tags = append(tags, "no-sandbox")
	}
	fmt.Fprintf(b, "script_test(\n    name = %q,\n    size = \"small\",\n", t.name)
	if len(t.deps) > 0 {
		fmt.Fprintf(b, "    data = [%s],\n", quotedLabels(t.deps))
	}
	if len(tags) > 0 {
		fmt.Fprintf(b, "    tags = [%s],\n", quoted(tags))
	}
	fmt.Fprintf(b, "    script = %q,\n)\n", script.String())
}

func quotedLabels(ts []*target) string {
	ls := make([]string, len(ts))
	for i, t := range ts {
		ls[i] = t.label()
	}
	return quoted(ls)
}

func quoted(ss []string) string {
	qs := make([]string, len(ss))
	for i, s := range ss {
		qs[i] = fmt.Sprintf("%q", s)
	}
	return strings.Join(qs, ", ")
}

// standIns returns the files of the offline stand-in repositories, keyed by path relative to the repos
// directory. Each replaces a repository that `bazel test` would otherwise download; they only have to
// define the names Bazel's own tools refer to.
func standIns() map[string]string {
	const header = "# Offline stand-in written by millrace loadtest/bazelws; see docs/design.md.\n"
	fwd := func(rules ...string) string {
		var b strings.Builder
		b.WriteString(header)
		for _, r := range rules {
			fmt.Fprintf(&b, "def %s(**kw): native.%s(**kw)\n", r, r)
		}
		return b.String()
	}
	return map[string]string{
		"remote_coverage_tools/WORKSPACE": "",
		"remote_coverage_tools/noop.sh":   "#!/bin/sh\nexit 0\n",
		"remote_coverage_tools/BUILD": header + `package(default_visibility = ["//visibility:public"])

sh_binary(name = "coverage_report_generator", srcs = ["noop.sh"])

sh_binary(name = "lcov_merger", srcs = ["noop.sh"])

filegroup(name = "coverage_output_generator", srcs = ["noop.sh"])
`,
		"rules_cc/WORKSPACE": "",
		"rules_cc/cc/BUILD":  "",
		"rules_cc/cc/defs.bzl": fwd("cc_binary", "cc_library", "cc_test", "cc_import", "cc_proto_library",
			"cc_toolchain", "cc_toolchain_suite", "objc_library"),
		"rules_java/WORKSPACE":  "",
		"rules_java/java/BUILD": "",
		"rules_java/java/defs.bzl": fwd("java_binary", "java_import", "java_library", "java_lite_proto_library",
			"java_proto_library", "java_test", "java_package_configuration", "java_plugin", "java_runtime",
			"java_toolchain"),
	}
}
