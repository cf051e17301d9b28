package migrations_test

import (
	"context"
	"testing"

	"github.com/millrace/millrace/projectors/builds"
)

// TestBuildsTestHistoryMigration: 023 counts the finished builds already
// there into test_daily and marks the failed runs whose commit passed
// in another build; the history reads them; down and up again give the
// same.
func TestBuildsTestHistoryMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_test_history")
	if _, err := conn.Exec(ctx, `
		insert into invocations (id, project, status, command, first_event_at, last_event_at) values
		    ('a1', 'acme', 'failed', 'test', '2024-03-09 14:58Z', '2024-03-09 15:03Z'),
		    ('a2', 'acme', 'succeeded', 'test', '2024-03-09 15:00Z', '2024-03-09 15:04Z'),
		    ('a3', 'acme', 'running', 'test', '2024-03-09 15:10Z', '2024-03-09 15:14Z'),
		    ('b1', 'beta', 'succeeded', 'test', '2024-03-09 15:20Z', '2024-03-09 15:24Z');
		select build_partitions_for(w) from (select distinct ((build_key >> 47) / 7)::int4 as w from invocations) x;
		insert into build_labels (project, id, label) values ('acme', build_label_id('//t:x'), '//t:x'), ('beta', build_label_id('//t:x'), '//t:x');
		insert into build_metadata (project, build_key, source, key, value)
		select project, build_key, 'build_metadata', 'COMMIT_SHA', 'c1' from invocations;
		insert into tests (build_key, label_id, status, has_summary, attempts, duration_ms)
		select build_key, build_label_id('//t:x'), case when id = 'a1' then 'FAILED' else 'PASSED' end, true, 1, 100
		from invocations where status <> 'running';
		insert into tests_running (build_key, label_id, status, has_summary, attempts, duration_ms)
		select build_key, build_label_id('//t:x'), 'FAILED', true, 1, 100 from invocations where status = 'running'`); err != nil {
		t.Fatal(err)
	}
	for _, step := range []int32{version, version - 1, version} {
		if err := m.MigrateTo(ctx, step); err != nil {
			t.Fatalf("to %d: %v", step, err)
		}
	}
	var runs, failed, flakes int
	if err := conn.QueryRow(ctx, `select runs, failed, commit_flakes from test_daily where project = 'acme'`).Scan(&runs, &failed, &flakes); err != nil {
		t.Fatal(err)
	}
	if runs != 2 || failed != 1 || flakes != 1 {
		t.Errorf("acme's day: %d runs, %d failed, %d commit flakes; want 2, 1, 1 (the running build not counted)", runs, failed, flakes)
	}
	if err := conn.QueryRow(ctx, `select commit_flakes from test_daily where project = 'beta'`).Scan(&flakes); err != nil || flakes != 0 {
		t.Errorf("beta's day: %d commit flakes (%v): another project's pass is not acme's flake", flakes, err)
	}
	if err := m.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	h, err := builds.ReadTestHistory(ctx, conn, builds.HistoryQuery{Project: "acme", Label: "//t:x", Days: builds.MaxWindowDays})
	if err != nil || len(h.Runs) != 2 || h.Runs[1].Build != "a1" || !h.Runs[1].Flaked {
		t.Errorf("acme's history after 023: %+v (%v)", h.Runs, err)
	}
}
