package builds

import (
	"context"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/bep"
)

func buildMetadataEv(md map[string]string) *bep.BuildEvent {
	return &bep.BuildEvent{Id: &bep.BuildEventId{Id: &bep.BuildEventId_BuildMetadata{}},
		Payload: &bep.BuildEvent_BuildMetadata{BuildMetadata: &bep.BuildMetadata{Metadata: md}}}
}

func statusEv(kv ...string) *bep.BuildEvent {
	var items []*bep.WorkspaceStatus_Item
	for i := 0; i < len(kv); i += 2 {
		items = append(items, &bep.WorkspaceStatus_Item{Key: kv[i], Value: kv[i+1]})
	}
	return &bep.BuildEvent{
		Id:      &bep.BuildEventId{Id: &bep.BuildEventId_WorkspaceStatus{WorkspaceStatus: &bep.BuildEventId_WorkspaceStatusId{}}},
		Payload: &bep.BuildEvent_WorkspaceStatus{WorkspaceStatus: &bep.WorkspaceStatus{Item: items}},
	}
}

// structuredEv is a command_line.CommandLine shaped like Bazel 4.2.3's:
// executable, startup options, command, command options, residue.
func structuredEv(label string, startup, options []string, command string, residue ...string) *bep.BuildEvent {
	opts := func(combined []string) *bep.CommandLineSection_OptionList {
		l := &bep.OptionList{}
		for _, c := range combined {
			name, value, _ := strings.Cut(strings.TrimPrefix(c, "--"), "=")
			l.Option = append(l.Option, &bep.Option{CombinedForm: c, OptionName: name, OptionValue: value})
		}
		return &bep.CommandLineSection_OptionList{OptionList: l}
	}
	chunks := func(c ...string) *bep.CommandLineSection_ChunkList {
		return &bep.CommandLineSection_ChunkList{ChunkList: &bep.ChunkList{Chunk: c}}
	}
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_StructuredCommandLine{
			StructuredCommandLine: &bep.BuildEventId_StructuredCommandLineId{CommandLineLabel: label}}},
		Payload: &bep.BuildEvent_StructuredCommandLine{StructuredCommandLine: &bep.StructuredCommandLine{
			CommandLineLabel: label,
			Sections: []*bep.CommandLineSection{
				{SectionLabel: "executable", SectionType: chunks("bazel")},
				{SectionLabel: "startup options", SectionType: opts(startup)},
				{SectionLabel: "command", SectionType: chunks(command)},
				{SectionLabel: "command options", SectionType: opts(options)},
				{SectionLabel: "residual", SectionType: chunks(residue...)},
			},
		}},
	}
}

func actionID(label, output string) *bep.BuildEventId {
	return &bep.BuildEventId{Id: &bep.BuildEventId_ActionCompleted{ActionCompleted: &bep.BuildEventId_ActionCompletedId{
		PrimaryOutput: output, Label: label, Configuration: &bep.BuildEventId_ConfigurationId{Id: "63d1ec2b"}}}}
}

func unconfiguredID(label string) *bep.BuildEventId {
	return &bep.BuildEventId{Id: &bep.BuildEventId_UnconfiguredLabel{UnconfiguredLabel: &bep.BuildEventId_UnconfiguredLabelId{Label: label}}}
}

func targetID(label string) *bep.BuildEventId {
	return &bep.BuildEventId{Id: &bep.BuildEventId_TargetCompleted{TargetCompleted: &bep.BuildEventId_TargetCompletedId{
		Label: label, Configuration: &bep.BuildEventId_ConfigurationId{Id: "63d1ec2b"}}}}
}

const (
	genMsg = "Executing genrule //lib:gen failed: (Exit 2): bash failed: error executing command"
	genOut = "bazel-out/k8-fastbuild/bin/lib/gen.txt"
)

// metadataBuild appends a failed build that says who and what it is:
// --build_metadata, a --workspace_status_command's keys, its command lines;
// and fails as Bazel 4.2.3 reports it: //lib:gen's action exits 2 (stderr
// inline), //app:bin depends on it and its TargetComplete carries a copy of
// the genrule's failure detail and names the action as its child;
// //app:viz does not analyse because //missing:file does not exist.
func metadataBuild(s *stream, project, inv, commit string) {
	b := s.invocation(project, inv)
	b.attemptStarted()
	b.tool(startedEv(inv, s.now))
	b.tool(buildMetadataEv(map[string]string{"COMMIT_SHA": commit, "BRANCH": "main", "ROLE": "CI",
		"LONG": strings.Repeat("é", 700)}))
	b.tool(structuredEv("original", []string{"--batch"}, []string{"--keep_going", "--remote_header=Authorization=<redacted>"}, "build", "//..."))
	b.tool(structuredEv("canonical", []string{"--batch", "--output_user_root=/tmp/o"},
		[]string{"--keep_going=1", "--remote_header=Authorization=<redacted>"}, "build", "//..."))
	b.tool(&bep.BuildEvent{Id: &bep.BuildEventId{Id: &bep.BuildEventId_UnstructuredCommandLine{}},
		Payload: &bep.BuildEvent_UnstructuredCommandLine{UnstructuredCommandLine: &bep.UnstructuredCommandLine{
			Args: []string{"build", "--keep_going", "//..."}}}})
	b.tool(&bep.BuildEvent{Id: &bep.BuildEventId{Id: &bep.BuildEventId_OptionsParsed{}},
		Payload: &bep.BuildEvent_OptionsParsed{OptionsParsed: &bep.OptionsParsed{
			StartupOptions: []string{"--batch"}, ExplicitStartupOptions: []string{"--batch"},
			CmdLine: []string{"--keep_going", "--color=no"}, ExplicitCmdLine: []string{"--keep_going"}}}})
	b.tool(statusEv("BUILD_EMBED_LABEL", "", "BUILD_HOST", "ci-7", "BUILD_SCM_REVISION", commit, "BUILD_SCM_STATUS", "clean",
		"BUILD_TIMESTAMP", "1710000000", "BUILD_USER", "ci", "STABLE_REPO", "https://git.example/r"))
	for _, l := range []string{"//lib:gen", "//app:bin", "//app:viz"} {
		b.tool(configuredEv(l, "genrule rule"))
	}
	b.tool(abortedEv(unconfiguredID("//missing:file"), bep.Aborted_ANALYSIS_FAILURE, "no such target '//missing:file'"))
	viz := abortedEv(targetID("//app:viz"), bep.Aborted_ANALYSIS_FAILURE, "Analysis of target '//app:viz' failed")
	viz.Children = []*bep.BuildEventId{unconfiguredID("//missing:file")}
	b.tool(viz)
	act := actionEv("//lib:gen", genOut, false, 2, genMsg)
	act.GetAction().Stderr = &bep.File{Name: "stderr", File: &bep.File_Contents{Contents: []byte("gen: failing on purpose\n")}}
	b.tool(act)
	gen := completedEv("//lib:gen", false, genMsg)
	gen.Children = []*bep.BuildEventId{actionID("//lib:gen", genOut)}
	b.tool(gen)
	bin := completedEv("//app:bin", false, genMsg) // Bazel's copy of the cause's detail
	bin.Children = []*bep.BuildEventId{actionID("//lib:gen", genOut)}
	b.tool(bin)
	b.tool(finishedEv(1, "BUILD_FAILURE", s.now.Add(time.Second)))
	b.finishStream()
	b.attemptFinished(buildpb.BuildStatus_COMMAND_FAILED)
}

// TestMetadataAndRootCauses: a build's metadata, workspace status and
// command lines are projected and shown; a failed target names its root
// causes, and a target that failed because of a dependency keeps no copy
// of the dependency's message; the rows do not depend on batch boundaries
// or redelivery.
func TestMetadataAndRootCauses(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	metadataBuild(s, "acme", "inv-1", "c0ffee")
	metadataBuild(s, "acme", "inv-2", "c0ffee")
	metadataBuild(s, "acme", "inv-3", "beef")
	metadataBuild(s, "beta", "inv-4", "c0ffee")
	var first map[string]string
	for _, n := range []int{1000, 1, 7, 3} {
		truncate(t, pool)
		applyAll(t, pool, p, s.msgs, n)
		d := digest(t, pool)
		if first == nil {
			first = d
		} else if !maps.Equal(first, d) {
			t.Errorf("batches of %d: digest differs from batches of 1000", n)
		}
		applyAll(t, pool, p, s.msgs, n)
		if again := digest(t, pool); !maps.Equal(d, again) {
			t.Errorf("batches of %d applied twice: digest changed", n)
		}
	}

	b, err := Show(ctx, pool, "acme", "inv-1")
	if err != nil {
		t.Fatal(err)
	}
	if got := strings.Join([]string{b.BuildMetadata["COMMIT_SHA"], b.BuildMetadata["BRANCH"], b.BuildMetadata["ROLE"]}, " "); got != "c0ffee main CI" {
		t.Errorf("build metadata %v", b.BuildMetadata)
	}
	if l := b.BuildMetadata["LONG"]; len(l) != 1024 || !strings.HasPrefix(strings.Repeat("é", 700), l) {
		t.Errorf("a 1,400-byte value is stored as %d bytes, want cut to 1,024 at a character boundary", len(l))
	}
	status := map[string]StatusItem{}
	for _, it := range b.WorkspaceStatus {
		status[it.Key] = it
	}
	for key, want := range map[string]StatusItem{
		"BUILD_SCM_REVISION": {"BUILD_SCM_REVISION", "c0ffee", false},
		"BUILD_SCM_STATUS":   {"BUILD_SCM_STATUS", "clean", false},
		"BUILD_TIMESTAMP":    {"BUILD_TIMESTAMP", "1710000000", false},
		"BUILD_USER":         {"BUILD_USER", "ci", true},
		"BUILD_HOST":         {"BUILD_HOST", "ci-7", true},
		"BUILD_EMBED_LABEL":  {"BUILD_EMBED_LABEL", "", true},
		"STABLE_REPO":        {"STABLE_REPO", "https://git.example/r", true},
	} {
		if status[key] != want {
			t.Errorf("workspace status %s: %+v, want %+v", key, status[key], want)
		}
	}
	if b.User == nil || *b.User != "ci" || b.Host == nil || *b.Host != "ci-7" {
		t.Errorf("user %v host %v", b.User, b.Host)
	}
	wantCanonical := []string{"bazel", "--batch", "--output_user_root=/tmp/o", "build", "--keep_going=1",
		"--remote_header=Authorization=<redacted>", "//..."}
	if !slices.Equal(b.CommandLine, wantCanonical) {
		t.Errorf("canonical command line %q, want %q", b.CommandLine, wantCanonical)
	}
	var lines []string
	for _, c := range b.CommandLines {
		lines = append(lines, c.Source+"/"+c.Label+":"+strings.Join(c.Args, " "))
	}
	wantLines := []string{
		"options_parsed/explicit_cmd_line:--keep_going",
		"options_parsed/explicit_startup_options:--batch",
		"structured_command_line/canonical:" + strings.Join(wantCanonical, " "),
	}
	if !slices.Equal(lines, wantLines) {
		t.Errorf("command lines:\n got %q\nwant %q", lines, wantLines)
	}

	targets := map[string]Target{}
	for _, tg := range b.Targets {
		targets[tg.Label] = tg
	}
	gen, bin, viz := targets["//lib:gen"], targets["//app:bin"], targets["//app:viz"]
	if gen.Success || gen.FailureReason == nil || *gen.FailureReason != genMsg {
		t.Errorf("//lib:gen: success %v reason %v, want its own failure", gen.Success, gen.FailureReason)
	}
	if bin.Success || bin.FailureReason != nil {
		t.Errorf("//app:bin: success %v reason %q, want failed with no copy of its dependency's message", bin.Success, deref(bin.FailureReason))
	}
	for _, tg := range []Target{gen, bin} {
		if len(tg.RootCauses) != 1 {
			t.Fatalf("%s: root causes %+v, want //lib:gen's action", tg.Label, tg.RootCauses)
		}
		c := tg.RootCauses[0]
		if c.Kind != "action" || c.Label != "//lib:gen" || c.PrimaryOutput != genOut || c.Configuration != "63d1ec2b" ||
			deref(c.Mnemonic) != "Genrule" || c.ExitCode == nil || *c.ExitCode != 2 || deref(c.Message) != genMsg ||
			deref(c.Stderr) != "gen: failing on purpose\n" || c.StderrURI != nil {
			t.Errorf("%s: root cause %+v", tg.Label, c)
		}
	}
	if viz.Success || deref(viz.FailureReason) != "Analysis of target '//app:viz' failed" || len(viz.RootCauses) != 1 {
		t.Fatalf("//app:viz: %+v", viz)
	}
	if c := viz.RootCauses[0]; c.Kind != "unconfigured_label" || c.Label != "//missing:file" ||
		deref(c.Message) != "no such target '//missing:file'" || c.ExitCode != nil {
		t.Errorf("//app:viz: root cause %+v", c)
	}

	// The builds of a commit, through the index.
	rows, err := pool.Query(ctx, `select i.id from build_metadata m join invocations i using (build_key)
		where m.project = $1 and m.key = 'COMMIT_SHA' and m.value = $2 order by 1`, "acme", "c0ffee")
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for rows.Next() {
		var id string
		rows.Scan(&id)
		ids = append(ids, id)
	}
	if rows.Err() != nil || !slices.Equal(ids, []string{"inv-1", "inv-2"}) {
		t.Errorf("builds of commit c0ffee in acme: %v %v, want [inv-1 inv-2]", ids, rows.Err())
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	tx.Exec(ctx, `set local enable_seqscan = off`)
	var plan strings.Builder
	prow, err := tx.Query(ctx, `explain select build_key from build_metadata
		where project = 'acme' and key = 'COMMIT_SHA' and value = 'c0ffee'`)
	if err != nil {
		t.Fatal(err)
	}
	for prow.Next() {
		var line string
		prow.Scan(&line)
		plan.WriteString(line + "\n")
	}
	if !strings.Contains(plan.String(), "build_metadata_lookup") {
		t.Errorf("the builds of a commit are not found through build_metadata_lookup:\n%s", plan.String())
	}
}

func deref(s *string) string {
	if s == nil {
		return "<nil>"
	}
	return *s
}

// TestRepeatedMetadataFirstWins: a client may send a key twice (two
// BuildMetadata events, a repeated action); the first value is kept
// whatever the batch boundaries, and the repeat fails no batch.
func TestRepeatedMetadataFirstWins(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	b := s.invocation("acme", "inv-r")
	b.tool(startedEv("inv-r", s.now))
	b.tool(buildMetadataEv(map[string]string{"COMMIT_SHA": "first"}))
	b.tool(buildMetadataEv(map[string]string{"COMMIT_SHA": "second", "BRANCH": "main"}))
	b.tool(configuredEv("//lib:gen", "genrule rule"))
	b.tool(actionEv("//lib:gen", genOut, false, 2, "first failure"))
	b.tool(actionEv("//lib:gen", genOut, false, 3, "second failure"))
	gen := completedEv("//lib:gen", false, "first failure")
	gen.Children = []*bep.BuildEventId{actionID("//lib:gen", genOut), actionID("//lib:gen", genOut)}
	b.tool(gen)
	b.finishStream()
	for _, n := range []int{1000, 1, 2} {
		truncate(t, pool)
		applyAll(t, pool, p, s.msgs, n)
		got, err := Show(ctx, pool, "acme", "inv-r")
		if err != nil {
			t.Fatal(err)
		}
		if got.BuildMetadata["COMMIT_SHA"] != "first" || got.BuildMetadata["BRANCH"] != "main" {
			t.Errorf("batches of %d: metadata %v, want the first COMMIT_SHA and the BRANCH", n, got.BuildMetadata)
		}
		if c := got.Targets[0].RootCauses; len(c) != 1 || c[0].ExitCode == nil || *c[0].ExitCode != 2 {
			t.Errorf("batches of %d: root causes %+v, want the first failure once", n, c)
		}
	}
}
