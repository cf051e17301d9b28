package builds

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/services/bes/redact"
)

const scrubToken = "ghp_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78"

// secretBuild is a build projected before the edge redacted events: its
// secrets sit in the workspace status, the patterns, a failure message and
// the console output (finished build) or its scratch chunks (running).
func secretBuild(s *stream, project, inv string, finish bool) *builder {
	b := s.invocation(project, inv)
	b.attemptStarted()
	b.tool(startedEv(inv, s.advance(time.Second)))
	b.tool(workspaceStatusEv("ci", "https://bot:SECRET4@host.example"))
	b.tool(patternEv("//...", "--action_env=TOKEN=SECRET2"))
	b.tool(progressEv(1, "", "INFO: --remote_header=Authorization=Bearer SECRET1\nexport GH="+scrubToken+"\n"))
	b.tool(configuredEv("//a:b", "genrule rule", "tag-"+scrubToken))
	b.tool(completedEv("//a:b", false, "curl https://u:SECRET4@x.example failed"))
	if finish {
		b.tool(finishedEv(1, "BUILD_FAILURE", s.advance(time.Minute)))
		b.finishStream()
		b.attemptFinished(buildpb.BuildStatus_COMMAND_FAILED)
	}
	return b
}

var scrubSecrets = []string{"SECRET1", "SECRET2", "SECRET4", scrubToken}

func TestScrub(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	secretBuild(s, "acme", "inv-done", true)
	running := secretBuild(s, "acme", "inv-running", false)
	secretBuild(s, "beta", "inv-beta", true)
	applyAll(t, pool, p, s.msgs, 1000)

	rows := func() string {
		var b strings.Builder
		for _, q := range []string{
			`select string_agg(i::text, E'\n' order by id) from invocations i`,
			`select string_agg(l.label || ' ' || t::text, E'\n' order by build_key, label_id) from targets t join build_labels l on l.id = t.label_id`,
		} {
			var v string
			if err := pool.QueryRow(ctx, q).Scan(&v); err != nil {
				t.Fatal(err)
			}
			b.WriteString(v + "\n")
		}
		for _, k := range [][2]string{{"acme", "inv-done"}, {"acme", "inv-running"}, {"beta", "inv-beta"}} {
			o, e, err := Output(ctx, pool, k[0], k[1])
			if err != nil {
				t.Fatal(err)
			}
			b.WriteString(k[1] + " out " + string(o) + string(e) + "\n")
		}
		return b.String()
	}
	before := rows()
	for _, sec := range scrubSecrets {
		if !strings.Contains(before, sec) {
			t.Fatalf("the projection holds no %q before scrubbing; the test does not test:\n%s", sec, before)
		}
	}
	r := redact.MustNew(redact.Config{})

	// A dry run counts and changes nothing.
	st, err := Scrub(ctx, pool, r, ScrubOptions{DryRun: true, Batch: 2})
	if err != nil {
		t.Fatal(err)
	}
	if st.Invocations != 3 || st.InvocationsChanged != 3 || st.TargetsChanged != 3 || st.OutputsChanged < 3 {
		t.Fatalf("dry run: %+v", st)
	}
	if rows() != before {
		t.Fatal("a dry run changed rows")
	}

	// One project.
	var progress []ScrubStats
	st, err = Scrub(ctx, pool, r, ScrubOptions{Project: "beta", Progress: func(s ScrubStats) { progress = append(progress, s) }})
	if err != nil {
		t.Fatal(err)
	}
	if st.Invocations != 1 || st.InvocationsChanged != 1 || len(progress) == 0 {
		t.Fatalf("project beta: %+v, progress %v", st, progress)
	}
	after := rows()
	for _, line := range strings.Split(after, "\n") {
		isBeta := strings.Contains(line, "inv-beta")
		for _, sec := range scrubSecrets {
			if isBeta && strings.Contains(line, sec) {
				t.Errorf("beta still holds %q: %s", sec, line)
			}
		}
	}
	if !strings.Contains(after, "inv-done out INFO: --remote_header=Authorization=Bearer SECRET1") {
		t.Error("scrubbing beta changed acme's output")
	}

	// Everything, in small batches, then again: nothing left to change.
	if _, err := Scrub(ctx, pool, r, ScrubOptions{Batch: 1}); err != nil {
		t.Fatal(err)
	}
	after = rows()
	for _, sec := range scrubSecrets {
		if strings.Contains(after, sec) {
			t.Errorf("%q survived the scrub:\n%s", sec, after)
		}
	}
	for _, keep := range []string{"--remote_header=Authorization=" + redact.Marker, "--action_env=TOKEN=" + redact.Marker, "https://" + redact.Marker + "@host.example", "//a:b", "//..."} {
		if !strings.Contains(after, keep) {
			t.Errorf("%q is gone after the scrub:\n%s", keep, after)
		}
	}
	st, err = Scrub(ctx, pool, r, ScrubOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if st.InvocationsChanged+st.TargetsChanged+st.OutputsChanged != 0 {
		t.Fatalf("a second scrub changed rows: %+v", st)
	}

	// The running build goes on and finishes; its output is still whole.
	b := running
	mark := len(s.msgs)
	b.tool(progressEv(2, "", "INFO: done\n"))
	b.tool(finishedEv(0, "SUCCESS", s.advance(time.Minute)))
	b.finishStream()
	applyAll(t, pool, p, s.msgs[mark:], 1000)
	_, e, err := Output(ctx, pool, "acme", "inv-running")
	if err != nil {
		t.Fatal(err)
	}
	if want := "INFO: --remote_header=Authorization=" + redact.Marker + "\nexport GH=" + redact.Marker + "\nINFO: done\n"; string(e) != want {
		t.Fatalf("output of the running build after scrub and finish = %q, want %q", e, want)
	}
}

// A scrub reaches what a build says about itself: metadata values, the
// messages of its failures and its command lines (kept once per project:
// the redacted arguments under their own hash, the old array gone once no
// build names it), in the project scrubbed only.
func TestScrubMetadata(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	for _, k := range [][2]string{{"acme", "inv-1"}, {"acme", "inv-2"}, {"beta", "inv-3"}} {
		b := s.invocation(k[0], k[1])
		b.tool(startedEv(k[1], s.advance(time.Second)))
		b.tool(buildMetadataEv(map[string]string{"CI_RUN_URL": "https://bot:SECRET4@ci.example/run/1", "BRANCH": "main"}))
		b.tool(structuredEv("canonical", nil, []string{"--remote_header=Authorization=Bearer SECRET1"}, "build", "//..."))
		b.tool(actionEv("//a:b", "bazel-out/a/b.txt", false, 1, "curl https://u:SECRET4@x.example failed"))
		b.tool(finishedEv(1, "BUILD_FAILURE", s.advance(time.Minute)))
		b.finishStream()
	}
	applyAll(t, pool, p, s.msgs, 1000)
	held := func(project string) string {
		t.Helper()
		var v string
		err := pool.QueryRow(ctx, `select concat_ws(E'\n',
			(select string_agg(value, ' ' order by value) from build_metadata where project = $1),
			(select string_agg(coalesce(f.message, ''), ' ') from build_failures f join invocations i on i.build_key = f.build_key where i.project = $1),
			(select string_agg(array_to_string(argv, ' '), ' ') from build_argv where project = $1))`, project).Scan(&v)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	for _, pr := range []string{"acme", "beta"} {
		if h := held(pr); !strings.Contains(h, "SECRET1") || !strings.Contains(h, "SECRET4") {
			t.Fatalf("%s holds no secrets before the scrub; the test does not test:\n%s", pr, h)
		}
	}
	st, err := Scrub(ctx, pool, redact.MustNew(redact.Config{}), ScrubOptions{Project: "acme", Batch: 1})
	if err != nil {
		t.Fatal(err)
	}
	// Per build: a metadata value, a failure, a command line.
	if st.MetadataChanged != 6 {
		t.Errorf("metadata rows changed: %d, want 6 (%+v)", st.MetadataChanged, st)
	}
	acme := held("acme")
	for _, sec := range []string{"SECRET1", "SECRET4"} {
		if strings.Contains(acme, sec) {
			t.Errorf("acme still holds %q:\n%s", sec, acme)
		}
	}
	if !strings.Contains(acme, "--remote_header=Authorization="+redact.Marker) || !strings.Contains(acme, "main") {
		t.Errorf("the scrub took more than the secrets:\n%s", acme)
	}
	if h := held("beta"); !strings.Contains(h, "SECRET1") {
		t.Errorf("scrubbing acme changed beta's rows:\n%s", h)
	}
	var arrays int
	if err := pool.QueryRow(ctx, `select count(*) from build_argv where project = 'acme'`).Scan(&arrays); err != nil || arrays != 1 {
		t.Errorf("acme keeps %d argument arrays (%v), want the redacted one only", arrays, err)
	}
	b, err := Show(ctx, pool, "acme", "inv-2")
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(b.CommandLine, "--remote_header=Authorization="+redact.Marker) {
		t.Errorf("inv-2's command line after the scrub: %q", b.CommandLine)
	}
	if st, err := Scrub(ctx, pool, redact.MustNew(redact.Config{}), ScrubOptions{}); err != nil || st.MetadataChanged != 3 {
		t.Errorf("scrubbing everything then: %+v (%v), want beta's 3 rows", st, err)
	}
}
