package builds

import (
	"bytes"
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/bep"
	"github.com/millrace/millrace/streams/projection"
)

// ciCanonical is the canonical command line of ciBuild.
var ciCanonical = []string{"bazel", "--batch", "--output_user_root=/tmp/o", "build", "--keep_going=1",
	"--remote_cache=grpcs://cache.example", "//..."}

// ciBuild appends a finished build whose command lines are those of a
// project's CI job (the same for every build), its canonical line ending
// in residue.
func ciBuild(s *stream, project, inv string, residue ...string) {
	b := s.invocation(project, inv)
	b.attemptStarted()
	b.tool(startedEv(inv, s.now))
	b.tool(structuredEv("canonical", []string{"--batch", "--output_user_root=/tmp/o"},
		[]string{"--keep_going=1", "--remote_cache=grpcs://cache.example"}, "build", residue...))
	b.tool(&bep.BuildEvent{Id: &bep.BuildEventId{Id: &bep.BuildEventId_OptionsParsed{}},
		Payload: &bep.BuildEvent_OptionsParsed{OptionsParsed: &bep.OptionsParsed{
			ExplicitStartupOptions: []string{"--batch"}, ExplicitCmdLine: []string{"--keep_going"}}}})
	b.tool(finishedEv(0, "SUCCESS", s.now.Add(time.Second)))
	b.finishStream()
	s.advance(time.Minute)
}

// storedArgv returns project's stored argument arrays, each joined by
// spaces, sorted.
func storedArgv(t *testing.T, q Querier, project string) []string {
	t.Helper()
	rows, err := q.Query(context.Background(), `select array_to_string(argv, ' ') from build_argv where project = $1 order by 1`, project)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// commandLines renders a build's command lines as Show has them.
func commandLines(t *testing.T, q Querier, project, id string) []string {
	t.Helper()
	b, err := Show(context.Background(), q, project, id)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, c := range b.CommandLines {
		out = append(out, c.Source+"/"+c.Label+":"+strings.Join(c.Args, " "))
	}
	return out
}

func wantCILines(residue ...string) []string {
	return []string{
		"options_parsed/explicit_cmd_line:--keep_going",
		"options_parsed/explicit_startup_options:--batch",
		"structured_command_line/canonical:" + strings.Join(append(slices.Clone(ciCanonical[:6]), residue...), " "),
	}
}

// TestCommandLinesStoredOncePerProject: builds of a project that send the
// same command lines store each once; each build still shows all of its
// own; another project stores its own copy; a build whose canonical line
// differs adds that line only. Whatever the batch boundaries, the rows are
// the same.
func TestCommandLinesStoredOncePerProject(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := newProjector(t, Config{})
	s := newStream(t0)
	ciBuild(s, "acme", "inv-1", "//...")
	ciBuild(s, "acme", "inv-2", "//...")
	ciBuild(s, "acme", "inv-3", "//app/...")
	ciBuild(s, "beta", "inv-4", "//...")
	var first map[string]string
	for _, n := range []int{1000, 1, 3} {
		truncate(t, pool)
		applyAll(t, pool, p, s.msgs, n)
		if d := digest(t, pool); first == nil {
			first = d
		} else if !equalDigests(first, d) {
			t.Errorf("batches of %d: digest differs from batches of 1000", n)
		}
	}

	for _, k := range []Key{{"acme", "inv-1"}, {"acme", "inv-2"}, {"beta", "inv-4"}} {
		if got, want := commandLines(t, pool, k.Project, k.ID), wantCILines("//..."); !slices.Equal(got, want) {
			t.Errorf("%v command lines:\n got %q\nwant %q", k, got, want)
		}
	}
	if got, want := commandLines(t, pool, "acme", "inv-3"), wantCILines("//app/..."); !slices.Equal(got, want) {
		t.Errorf("inv-3 command lines:\n got %q\nwant %q", got, want)
	}
	wantAcme := []string{"--batch", "--keep_going", strings.Join(ciCanonical[:6], " ") + " //...",
		strings.Join(ciCanonical[:6], " ") + " //app/..."}
	slices.Sort(wantAcme)
	if got := storedArgv(t, pool, "acme"); !slices.Equal(got, wantAcme) {
		t.Errorf("acme's stored command lines (3 builds):\n got %q\nwant %q, each once", got, wantAcme)
	}
	if got := storedArgv(t, pool, "beta"); len(got) != 3 {
		t.Errorf("beta's stored command lines: %q, want its own 3", got)
	}
}

// TestDeletingBuildsCollectsTheirCommandLines: deleting a build (on
// request or by retention) keeps the command lines that other builds of
// its project name and deletes those no build names any more; deleting a
// project deletes all of its own; a replay's reset keeps the kept builds'
// and applying the other builds again gives back the live run's rows.
func TestDeletingBuildsCollectsTheirCommandLines(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	ciBuild(s, "acme", "inv-1", "//...")
	ciBuild(s, "acme", "inv-2", "//...")
	ciBuild(s, "acme", "inv-3", "//app/...")
	ciBuild(s, "beta", "inv-4", "//...")
	applyAll(t, pool, p, s.msgs, 1000)
	live := digest(t, pool)

	// A replay's reset keeping inv-3: its lines stay, inv-1's and inv-2's
	// own go, and applying inv-1, inv-2 and inv-4 again restores them.
	resetExcept(t, pool, p, Key{"acme", "inv-3"})
	wantKept := []string{"--batch", "--keep_going", strings.Join(ciCanonical[:6], " ") + " //app/..."}
	if got := storedArgv(t, pool, "acme"); !slices.Equal(got, wantKept) {
		t.Errorf("acme's command lines after a reset keeping inv-3: %q, want %q", got, wantKept)
	}
	if got := storedArgv(t, pool, "beta"); len(got) != 0 {
		t.Errorf("beta's command lines after a reset keeping none of its builds: %q", got)
	}
	for _, k := range []Key{{"acme", "inv-1"}, {"acme", "inv-2"}, {"beta", "inv-4"}} {
		applyAll(t, pool, p, messagesOf(s, k.Project, k.ID), 1000)
	}
	if got := digest(t, pool); !equalDigests(got, live) {
		t.Fatalf("after re-applying the reset builds:\n got %v\nwant %v", got, live)
	}

	del := func(project string, ids ...string) {
		t.Helper()
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			_, err := DeleteBuilds(ctx, tx, project, ids)
			return err
		}); err != nil {
			t.Fatal(err)
		}
	}
	// inv-1's lines are all inv-2's too.
	del("acme", "inv-1")
	wantAcme := []string{"--batch", "--keep_going", strings.Join(ciCanonical[:6], " ") + " //...",
		strings.Join(ciCanonical[:6], " ") + " //app/..."}
	slices.Sort(wantAcme)
	if got := storedArgv(t, pool, "acme"); !slices.Equal(got, wantAcme) {
		t.Errorf("acme's command lines after deleting inv-1: %q, want %q", got, wantAcme)
	}
	if got, want := commandLines(t, pool, "acme", "inv-2"), wantCILines("//..."); !slices.Equal(got, want) {
		t.Errorf("inv-2 after deleting inv-1:\n got %q\nwant %q", got, want)
	}
	// inv-2 was the last to name its canonical line; the options are
	// inv-3's too.
	del("acme", "inv-2")
	if got := storedArgv(t, pool, "acme"); !slices.Equal(got, wantKept) {
		t.Errorf("acme's command lines after deleting inv-2: %q, want %q", got, wantKept)
	}

	// Retention: inv-3 is the last of acme's builds.
	e, err := NewExpirer(ExpireConfig{}, Retention{RawDays: 1, RowsDays: 5}, pool, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	e.now = func() time.Time { return t0.Add(10 * 24 * time.Hour) }
	if _, err := SetRetention(ctx, pool, Retention{RawDays: 1, RowsDays: 5}, "beta", RetentionSet{RowsDays: nDays(20)}); err != nil {
		t.Fatal(err)
	}
	if st, _, err := e.Pass(ctx); err != nil || st.RowsBuilds != 1 {
		t.Fatalf("retention pass: %+v, %v; want inv-3 deleted", st, err)
	}
	if got := storedArgv(t, pool, "acme"); len(got) != 0 {
		t.Errorf("acme's command lines once retention deleted its last build: %q", got)
	}
	if got := storedArgv(t, pool, "beta"); len(got) != 3 {
		t.Errorf("beta's command lines after acme's went: %q, want its 3", got)
	}

	// An array no build names (as one a batch held while its build was
	// deleted may be) goes with its project.
	if _, err := pool.Exec(ctx, `insert into build_argv values ('beta', '\x00', '{stray}')`); err != nil {
		t.Fatal(err)
	}
	if _, err := DeleteProject(ctx, pool, "beta", 1, nil); err != nil {
		t.Fatal(err)
	}
	if got := storedArgv(t, pool, "beta"); len(got) != 0 {
		t.Errorf("beta's command lines after deleting the project: %q", got)
	}
}

// TestDeleteSkipsCommandLinesABatchHolds: a build is deleted while the
// projector's batch, not yet committed, projects another build of the same
// command lines. The delete must not collect the arrays the batch found
// stored (its snapshot cannot see the batch's rows that name them): once
// both commit, the new build shows its command lines.
func TestDeleteSkipsCommandLinesABatchHolds(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	ciBuild(s, "acme", "inv-1", "//...")
	applyAll(t, pool, p, s.msgs, 1000)
	n := len(s.msgs)
	// Another hour: the delete takes inv-1 away from its hour's rollup
	// row, which inv-2's batch would otherwise hold too.
	s.advance(2 * time.Hour)
	ciBuild(s, "acme", "inv-2", "//...")

	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	var batch []projection.Message
	for _, m := range s.msgs[n:] {
		batch = append(batch, m)
	}
	if err := p.Apply(ctx, tx, batch); err != nil {
		t.Fatal(err)
	}
	// Another connection; the batch's transaction is open. A deadline, so
	// that a delete waiting on the batch fails instead of hanging.
	dctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if err := pgx.BeginFunc(dctx, pool, func(dtx pgx.Tx) error {
		_, err := DeleteBuilds(dctx, dtx, "acme", []string{"inv-1"})
		return err
	}); err != nil {
		t.Fatalf("delete inv-1 while a batch projects inv-2: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	p.Committed()
	if got, want := commandLines(t, pool, "acme", "inv-2"), wantCILines("//..."); !slices.Equal(got, want) {
		t.Errorf("inv-2's command lines:\n got %q\nwant %q", got, want)
	}
}

// TestArgvHashMatchesSQL: the projector's hash of an argument array is
// build_argv_hash's, with which migration 017 hashed the rows it moved, so
// that a command line projected after the migration finds the array
// moved, and a replay makes the rows the migration made.
func TestArgvHashMatchesSQL(t *testing.T) {
	pool, _ := testenv.Pool(t)
	for _, argv := range [][]string{
		{}, {""}, {"", ""}, {"a"}, {"ab"}, {"a", "b"}, {"--x=é", "日本語", "\uFFFD"},
		{strings.Repeat("long", 1000), "--remote_header=Authorization=<redacted>"},
	} {
		var sql []byte
		if err := pool.QueryRow(context.Background(), `select build_argv_hash($1::text[])`, argv).Scan(&sql); err != nil {
			t.Fatal(err)
		}
		if got := argvHash(argv); !bytes.Equal(got, sql) {
			t.Errorf("%q: argvHash %x, build_argv_hash %x", argv, got, sql)
		}
	}
	if bytes.Equal(argvHash([]string{"ab"}), argvHash([]string{"a", "b"})) ||
		bytes.Equal(argvHash([]string{}), argvHash([]string{""})) {
		t.Error("distinct arrays hash the same")
	}
}
