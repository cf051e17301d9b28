package migrations_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/builds"
)

// emptyDatabase creates a database with no schema at all and drops it when
// the test ends.
func emptyDatabase(t testing.TB) *pgx.Conn {
	t.Helper()
	conn, err := pgx.Connect(context.Background(), testenv.EmptyDatabase(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close(context.Background()) })
	return conn
}

// TestBuildsProjectMigration: rows of the builds projection in the shape
// before a build was (project, invocation id) are moved: every table gets
// its invocation's project, ” becomes the edge's default project (with its
// rollups merged into that project's), orphans take the default, and the
// new key then holds the same invocation id in two projects.
func TestBuildsProjectMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_project")

	// The old shape: keyed by invocation id alone; inv-2's events named no
	// project; a target row whose invocation is gone.
	_, err := conn.Exec(ctx, `
		insert into invocations (id, project, status, first_event_at, last_event_at, started_at, finished_at,
		                         counted_project, counted_hour, counted_status, counted_duration_ms,
		                         counted_tests_passed, counted_tests_failed, counted_tests_flaky)
		values ('inv-1', 'acme', 'succeeded', '2024-03-09 14:58Z', '2024-03-09 15:00Z', '2024-03-09 14:58Z', '2024-03-09 15:00Z',
		        'acme', '2024-03-09 14:00Z', 'succeeded', 120000, 1, 0, 0),
		       ('inv-2', '', 'failed', '2024-03-09 14:10Z', '2024-03-09 14:11Z', '2024-03-09 14:10Z', '2024-03-09 14:10:03Z',
		        '', '2024-03-09 14:00Z', 'failed', 3000, 0, 1, 0);
		insert into targets (invocation_id, label, kind, success) values
		    ('inv-1', '//a:a', 'genrule rule', true), ('inv-2', '//b:b', 'genrule rule', false),
		    ('inv-gone', '//c:c', 'genrule rule', true);
		insert into tests (invocation_id, label, status, has_summary) values
		    ('inv-1', '//a:t', 'PASSED', true), ('inv-2', '//b:t', 'FAILED', true);
		insert into build_metrics (invocation_id, actions_executed) values ('inv-1', 7), ('inv-2', 3);
		insert into build_output (invocation_id, stdout, stderr, stdout_bytes, stderr_bytes) values
		    ('inv-1', '', '', 0, 0), ('inv-2', '', '', 0, 0);
		insert into build_output_chunks (invocation_id, first_seq, stdout, stderr) values ('inv-2', 4, '', '');
		insert into hourly_rollups (project, hour, builds, succeeded, failed, duration_hist, duration_sum_ms, tests_passed, tests_failed) values
		    ('acme', '2024-03-09 14:00Z', 1, 1, 0, '{0,0,0,0,0,0,1,0,0,0,0,0}', 120000, 1, 0),
		    ('', '2024-03-09 14:00Z', 1, 0, 1, '{0,1,0,0,0,0,0,0,0,0,0,0}', 3000, 0, 1),
		    ('default', '2024-03-09 14:00Z', 2, 2, 0, '{0,1,1,0,0,0,0,0,0,0,0,0}', 9000, 4, 0)`)
	if err != nil {
		t.Fatal(err)
	}

	if err := m.MigrateTo(ctx, version); err != nil {
		t.Fatal(err)
	}

	want := map[string]string{"inv-1": "acme", "inv-2": "default", "inv-gone": "default"}
	for _, table := range []string{"invocations", "targets", "tests", "build_metrics", "build_output", "build_output_chunks"} {
		idCol := "invocation_id"
		if table == "invocations" {
			idCol = "id"
		}
		rows, err := conn.Query(ctx, "select "+idCol+", project from "+table)
		if err != nil {
			t.Fatal(err)
		}
		var id, project string
		n := 0
		_, err = pgx.ForEachRow(rows, []any{&id, &project}, func() error {
			n++
			if project != want[id] {
				t.Errorf("%s: %s moved to project %q, want %q", table, id, project, want[id])
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		if n == 0 {
			t.Errorf("%s: no rows after the migration", table)
		}
	}
	var counted string
	if err := conn.QueryRow(ctx, `select counted_project from invocations where id = 'inv-2'`).Scan(&counted); err != nil || counted != "default" {
		t.Errorf("inv-2 counted under %q (%v), want default", counted, err)
	}
	var (
		nbuilds, failed, passed, tfailed, sum int64
		hist                                  []int64
		empty                                 int
	)
	if err := conn.QueryRow(ctx, `select builds, failed, tests_passed, tests_failed, duration_sum_ms, duration_hist
		from hourly_rollups where project = 'default'`).Scan(&nbuilds, &failed, &passed, &tfailed, &sum, &hist); err != nil {
		t.Fatal(err)
	}
	if nbuilds != 3 || failed != 1 || passed != 4 || tfailed != 1 || sum != 12000 || !slices.Equal(hist, []int64{0, 2, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0}) {
		t.Errorf("default's rollup after the merge: builds %d failed %d passed %d tests failed %d sum %d hist %v",
			nbuilds, failed, passed, tfailed, sum, hist)
	}
	conn.QueryRow(ctx, `select count(*) from hourly_rollups where project = ''`).Scan(&empty)
	if empty != 0 {
		t.Errorf("%d rollup rows of project '' left", empty)
	}

	// The read side (today's, so on today's schema) finds the moved rows
	// under their project.
	if err := m.Migrate(ctx); err != nil {
		t.Fatalf("up to the newest: %v", err)
	}
	b, err := builds.Show(ctx, conn, "default", "inv-2")
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Targets) != 1 || b.Targets[0].Label != "//b:b" || len(b.Tests) != 1 || b.Metrics == nil || b.Metrics.ActionsExecuted != 3 {
		t.Errorf("moved build inv-2: %+v", b)
	}

	// Down and up again while every id is in one project only.
	if err := m.MigrateTo(ctx, version-1); err != nil {
		t.Fatalf("down: %v", err)
	}
	if err := m.MigrateTo(ctx, version); err != nil {
		t.Fatalf("up again: %v", err)
	}

	// The new key: the same invocation id in another project is another build.
	if _, err := conn.Exec(ctx, `insert into invocations (id, project, first_event_at, last_event_at)
		values ('inv-1', 'beta', now(), now())`); err != nil {
		t.Fatalf("a second project's build with the same id: %v", err)
	}
	if _, err := conn.Exec(ctx, `insert into targets (invocation_id, project, label) values ('inv-1', 'beta', '//a:a')`); err != nil {
		t.Fatalf("a second project's target with the same id and label: %v", err)
	}
	if _, err := conn.Exec(ctx, `insert into invocations (id, project, first_event_at, last_event_at)
		values ('inv-3', '', now(), now())`); err == nil {
		t.Error("an invocation without a project was accepted")
	}
}
