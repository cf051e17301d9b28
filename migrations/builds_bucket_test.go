package migrations_test

import (
	"context"
	"slices"
	"testing"
	"time"
)

// TestBuildsEventBucketMigration: invocations.last_event_bucket stops
// being a generated column and keeps every row's value (and its index);
// from then on the projector, not PostgreSQL, sets it. Down makes it
// generated again.
func TestBuildsEventBucketMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_event_bucket")
	if _, err := conn.Exec(ctx, `insert into invocations (id, project, first_event_at, last_event_at)
		values ('inv-1', 'acme', '2024-03-09 14:58Z', '2024-03-09 15:03:20Z'),
		       ('inv-2', 'acme', '2024-03-09 14:58Z', '2024-03-09 15:11Z')`); err != nil {
		t.Fatal(err)
	}
	generated := func() bool {
		var g bool
		if err := conn.QueryRow(ctx, `select attgenerated = 's' from pg_attribute
			where attrelid = 'invocations'::regclass and attname = 'last_event_bucket'`).Scan(&g); err != nil {
			t.Fatal(err)
		}
		return g
	}
	buckets := func() []time.Time {
		rows, err := conn.Query(ctx, `select last_event_bucket from invocations order by id`)
		if err != nil {
			t.Fatal(err)
		}
		defer rows.Close()
		var out []time.Time
		for rows.Next() {
			var at time.Time
			if err := rows.Scan(&at); err != nil {
				t.Fatal(err)
			}
			out = append(out, at.UTC())
		}
		return out
	}
	want := []time.Time{time.Date(2024, 3, 9, 15, 0, 0, 0, time.UTC), time.Date(2024, 3, 9, 15, 10, 0, 0, time.UTC)}
	if !generated() {
		t.Fatal("before the migration last_event_bucket is not a generated column")
	}

	if err := m.MigrateTo(ctx, version); err != nil {
		t.Fatal(err)
	}
	if generated() {
		t.Error("after the migration last_event_bucket is still a generated column")
	}
	if got := buckets(); !slices.Equal(got, want) {
		t.Errorf("buckets after the migration %v, want %v", got, want)
	}
	var indexed bool
	if err := conn.QueryRow(ctx, `select exists (select from pg_indexes where indexname = 'invocations_running_idx')`).Scan(&indexed); err != nil || !indexed {
		t.Errorf("the sweep's index after the migration: %v, %v", indexed, err)
	}
	// PostgreSQL no longer computes it: a write sets it.
	if _, err := conn.Exec(ctx, `update invocations set last_event_at = '2024-03-09 16:00Z',
		last_event_bucket = '2024-03-09 16:00Z' where id = 'inv-1'`); err != nil {
		t.Fatalf("setting last_event_bucket: %v", err)
	}

	if err := m.MigrateTo(ctx, version-1); err != nil {
		t.Fatalf("down: %v", err)
	}
	if !generated() {
		t.Error("after down last_event_bucket is not a generated column")
	}
	if got := buckets(); !slices.Equal(got, []time.Time{time.Date(2024, 3, 9, 16, 0, 0, 0, time.UTC), want[1]}) {
		t.Errorf("buckets after down %v", got)
	}
	if err := m.MigrateTo(ctx, version); err != nil {
		t.Fatalf("up again: %v", err)
	}
}
