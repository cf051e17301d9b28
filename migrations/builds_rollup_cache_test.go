package migrations_test

import (
	"context"
	"testing"
)

// TestBuildsRollupCacheMigration: 024 records what the builds already
// counted of their action cache and adds it to their rollups; a build
// without metrics counts none; a running build is not counted; down and
// up again give the same.
func TestBuildsRollupCacheMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_rollup_cache")
	if _, err := conn.Exec(ctx, `
		insert into invocations (id, project, status, command, first_event_at, last_event_at,
		                         counted_project, counted_hour, counted_status, counted_duration_ms) values
		    ('a1', 'acme', 'failed', 'test', '2024-03-09 14:58Z', '2024-03-09 15:03Z', 'acme', '2024-03-09 14:00Z', 'failed', 1000),
		    ('a2', 'acme', 'succeeded', 'test', '2024-03-09 14:59Z', '2024-03-09 15:04Z', 'acme', '2024-03-09 14:00Z', 'succeeded', 1000),
		    ('a3', 'acme', 'succeeded', 'test', '2024-03-09 14:40Z', '2024-03-09 15:04Z', 'acme', '2024-03-09 14:00Z', 'succeeded', 1000);
		insert into invocations (id, project, status, command, first_event_at, last_event_at) values
		    ('r1', 'acme', 'running', 'test', '2024-03-09 14:10Z', '2024-03-09 15:14Z');
		insert into hourly_rollups (project, hour, builds, succeeded, failed, duration_hist)
		values ('acme', '2024-03-09 14:00Z', 3, 2, 1, '{0,3,0,0,0,0,0,0,0,0,0,0}');
		insert into build_metrics (build_key, action_cache_hits, action_cache_misses)
		select build_key, case id when 'a1' then 30 when 'a2' then 5 else 100 end, case id when 'a1' then 10 when 'a2' then 5 else 0 end
		from invocations where id <> 'a3'`); err != nil {
		t.Fatal(err)
	}
	for _, step := range []int32{version, version - 1, version} {
		if err := m.MigrateTo(ctx, step); err != nil {
			t.Fatalf("to %d: %v", step, err)
		}
	}
	var hits, misses int64
	if err := conn.QueryRow(ctx, `select cache_hits, cache_misses from hourly_rollups where project = 'acme'`).Scan(&hits, &misses); err != nil {
		t.Fatal(err)
	}
	if hits != 35 || misses != 15 {
		t.Errorf("acme's hour: %d hits, %d misses; want 35 and 15 (a1 and a2; the running build not counted)", hits, misses)
	}
	var a3, r1 *int32
	if err := conn.QueryRow(ctx, `select (select counted_cache_hits from invocations where id = 'a3'),
		(select counted_cache_hits from invocations where id = 'r1')`).Scan(&a3, &r1); err != nil {
		t.Fatal(err)
	}
	if a3 == nil || *a3 != 0 || r1 != nil {
		t.Errorf("counted hits: a build without metrics %v (want 0), a running build %v (want null)", a3, r1)
	}
	if err := m.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
}
