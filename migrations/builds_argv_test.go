package migrations_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/projectors/builds"
)

// TestBuildsArgvMigration: build_command_lines rows in 013's shape (each
// with its argument array) are moved in batches, each its own transaction:
// every distinct array once per project in build_argv, each row naming it
// by its hash, the old column gone and the new one NOT NULL, nothing of the
// move left behind; builds show the command lines they showed before. Down
// puts every array back in its row, and up moves them again.
func TestBuildsArgvMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_argv")
	// 2,500 builds of acme, all with one canonical line but two of their
	// own explicit options (2,500 distinct arrays), so 7,500 rows: more
	// than a batch of 1,000. beta's build has acme's canonical line.
	if _, err := conn.Exec(ctx, `
		insert into invocations (id, project, status, first_event_at, last_event_at)
		select format('inv-%s', n), 'acme', 'succeeded', '2024-03-09 14:58Z', '2024-03-09 15:03Z'
		from generate_series(1, 2500) n;
		insert into invocations (id, project, status, first_event_at, last_event_at)
		values ('inv-b', 'beta', 'failed', '2024-03-09 14:58Z', '2024-03-09 15:03Z');
		insert into build_command_lines (project, invocation_id, source, label, argv)
		select 'acme', format('inv-%s', n), 'structured_command_line', 'canonical',
		       '{bazel,--batch,build,--keep_going=1,"--remote_header=x-token=<redacted>",//...}'
		from generate_series(1, 2500) n
		union all
		select 'acme', format('inv-%s', n), 'options_parsed', 'explicit_cmd_line', array['--keep_going', format('--run=%s', n)]
		from generate_series(1, 2500) n
		union all
		select 'acme', format('inv-%s', n), 'options_parsed', 'explicit_startup_options', array[format('--é=%s', n % 2), '']
		from generate_series(1, 2500) n;
		insert into build_command_lines (project, invocation_id, source, label, argv)
		values ('beta', 'inv-b', 'structured_command_line', 'canonical',
		        '{bazel,--batch,build,--keep_going=1,"--remote_header=x-token=<redacted>",//...}')`); err != nil {
		t.Fatal(err)
	}
	before := oldCommandLines(t, conn)

	if err := m.MigrateTo(ctx, version); err != nil {
		t.Fatal(err)
	}
	var rows, stored, unhashed, batches int
	if err := conn.QueryRow(ctx, `select count(*), count(*) filter (where argv_hash is null), count(distinct xmin::text)
		from build_command_lines`).Scan(&rows, &unhashed, &batches); err != nil {
		t.Fatal(err)
	}
	if err := conn.QueryRow(ctx, `select count(*) from build_argv`).Scan(&stored); err != nil {
		t.Fatal(err)
	}
	// acme: one canonical line, 2,500 explicit_cmd_line, 2 startup; beta
	// its own copy of the canonical line.
	if rows != 7501 || unhashed != 0 || stored != 1+2500+2+1 {
		t.Errorf("after the migration: %d rows (%d unhashed), %d arrays stored; want 7,501, 0 and 2,504", rows, unhashed, stored)
	}
	if batches < 8 {
		t.Errorf("the rows were moved by %d transactions, want one per 1,000", batches)
	}
	if got := newCommandLines(t, conn); !equalLines(got, before) {
		t.Errorf("command lines after the migration differ from before")
	}
	var notNull, argvGone, leftovers, validIndex int
	if err := conn.QueryRow(ctx, `select
		(select count(*) from pg_attribute where attrelid = 'build_command_lines'::regclass and attname = 'argv_hash' and attnotnull),
		(select count(*) from pg_attribute where attrelid = 'build_command_lines'::regclass and attname = 'argv' and not attisdropped),
		(select count(*) from pg_proc where proname in ('build_argv_backfill', 'build_command_lines_hash_argv'))
		  + (select count(*) from pg_trigger where tgrelid = 'build_command_lines'::regclass and not tgisinternal)
		  + (select count(*) from pg_constraint where conrelid = 'build_command_lines'::regclass and contype = 'c'),
		(select count(*) from pg_index where indexrelid = 'build_command_lines_argv_idx'::regclass and indisvalid)`).Scan(
		&notNull, &argvGone, &leftovers, &validIndex); err != nil {
		t.Fatal(err)
	}
	if notNull != 1 || argvGone != 0 || leftovers != 0 || validIndex != 1 {
		t.Errorf("schema after the migration: argv_hash not null %d, argv present %d, procedures/triggers/constraints left %d, valid index %d",
			notNull, argvGone, leftovers, validIndex)
	}
	// Shown by the newest schema, which the read side follows.
	if err := m.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	b, err := builds.Show(ctx, conn, "acme", "inv-7")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"bazel", "--batch", "build", "--keep_going=1", "--remote_header=x-token=<redacted>", "//..."}; !slices.Equal(b.CommandLine, want) || len(b.CommandLines) != 3 {
		t.Errorf("inv-7 after the migration: canonical %q, %d command lines; want %q of 3", b.CommandLine, len(b.CommandLines), want)
	}

	if err := m.MigrateTo(ctx, version-1); err != nil {
		t.Fatal(err)
	}
	if got := oldCommandLines(t, conn); !equalLines(got, before) {
		t.Errorf("command lines after down differ from before")
	}
	var argvTables int
	if err := conn.QueryRow(ctx, `select count(*) from pg_class where relname in ('build_argv', 'build_command_lines_argv_idx')`).Scan(&argvTables); err != nil || argvTables != 0 {
		t.Errorf("after down: %d of build_argv and its index left (%v)", argvTables, err)
	}
	if err := m.MigrateTo(ctx, version); err != nil {
		t.Fatal(err)
	}
	if got := newCommandLines(t, conn); !equalLines(got, before) {
		t.Errorf("command lines after down and up again differ from before")
	}
}

// A command line by build: "project id source label" and its arguments.
type commandLines map[string][]string

func collectLines(t *testing.T, conn *pgx.Conn, sql string) commandLines {
	t.Helper()
	rows, err := conn.Query(context.Background(), sql)
	if err != nil {
		t.Fatal(err)
	}
	out := commandLines{}
	var key string
	var argv []string
	if _, err := pgx.ForEachRow(rows, []any{&key, &argv}, func() error {
		out[key] = slices.Clone(argv)
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	return out
}

func oldCommandLines(t *testing.T, conn *pgx.Conn) commandLines {
	return collectLines(t, conn, `select concat_ws(' ', project, invocation_id, source, label), argv from build_command_lines`)
}

func newCommandLines(t *testing.T, conn *pgx.Conn) commandLines {
	return collectLines(t, conn, `select concat_ws(' ', c.project, c.invocation_id, c.source, c.label), a.argv
		from build_command_lines c join build_argv a on a.project = c.project and a.hash = c.argv_hash`)
}

func equalLines(a, b commandLines) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if w, ok := b[k]; !ok || !slices.Equal(v, w) {
			return false
		}
	}
	return true
}

// TestBuildsArgvMigrationInterrupted: while the rows are being moved, a
// projector of the previous version still inserts rows with their arrays
// (the trigger hashes them); and a run that stopped midway (here, before
// the backfill) leaves a schema that running the migration again
// completes.
func TestBuildsArgvMigrationInterrupted(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_argv")
	insertOld := func(inv string) {
		t.Helper()
		if _, err := conn.Exec(ctx, `insert into build_command_lines (project, invocation_id, source, label, argv)
			values ('acme', $1, 'structured_command_line', 'canonical', '{bazel,build,//...}') on conflict do nothing`, inv); err != nil {
			t.Fatal(err)
		}
	}
	insertOld("inv-1")
	up := m.Migrations[version-1].UpSQL // tern numbers them from 1, contiguous
	cut := strings.Index(up, "call build_argv_backfill")
	if cut < 0 {
		t.Fatal("no call of build_argv_backfill in the migration")
	}
	if _, err := conn.Exec(ctx, up[:cut]); err != nil {
		t.Fatalf("the migration up to the backfill: %v", err)
	}
	insertOld("inv-2")
	var hashed, stored int
	if err := conn.QueryRow(ctx, `select count(*) filter (where argv_hash is not null and argv is null),
		(select count(*) from build_argv) from build_command_lines`).Scan(&hashed, &stored); err != nil {
		t.Fatal(err)
	}
	if hashed != 1 || stored != 1 {
		t.Errorf("a row inserted the old way during the migration: %d hashed, %d arrays stored; want 1 and 1", hashed, stored)
	}
	conn.Exec(ctx, "reset all")
	if err := m.MigrateTo(ctx, version); err != nil {
		t.Fatalf("the migration run again: %v", err)
	}
	want := commandLines{
		"acme inv-1 structured_command_line canonical": {"bazel", "build", "//..."},
		"acme inv-2 structured_command_line canonical": {"bazel", "build", "//..."},
	}
	if got := newCommandLines(t, conn); !equalLines(got, want) {
		t.Errorf("command lines: %v, want %v", got, want)
	}
	if err := conn.QueryRow(ctx, `select count(*) from build_argv`).Scan(&stored); err != nil || stored != 1 {
		t.Errorf("%d arrays stored (%v), want 1", stored, err)
	}
}
