package migrations_test

import (
	"context"
	"slices"
	"testing"
)

// TestArchivedOutputMigration: builds archived before the migration keep
// their console output where it is, in PostgreSQL (output_seq null), and
// are among those the archiver may move (the partial index holds them);
// down and up again work.
func TestArchivedOutputMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "archived_output")
	if _, err := conn.Exec(ctx, `insert into archived_builds (invocation_id, project, object_key, dict_id, events, first_seq, last_seq,
		last_event_at, raw_bytes, stored_bytes, archived_at)
		values ('inv-1', 'acme', 'archive/builds/acme/inv-1.mrar', 0, 10, 1, 10, now(), 100, 20, now()),
		       ('inv-2', 'acme', '', 0, 0, 0, 0, now(), 0, 0, now())`); err != nil {
		t.Fatal(err)
	}
	if err := m.MigrateTo(ctx, version); err != nil {
		t.Fatal(err)
	}
	var inPG int
	if err := conn.QueryRow(ctx, `select count(*) from archived_builds where output_seq is null and output_stdout_bytes is null
		and output_stderr_bytes is null and output_error is null`).Scan(&inPG); err != nil || inPG != 2 {
		t.Fatalf("builds whose output is in PostgreSQL after the migration: %d, %v; want both", inPG, err)
	}
	// The archiver's look for output to move finds the build with an
	// object, by the index.
	var ids []string
	rows, err := conn.Query(ctx, `select invocation_id from archived_builds
		where object_key <> '' and verify_error is null and output_error is null and raw_expired_at is null
		  and (output_seq is null or output_seq < last_seq) order by last_seq`)
	if err != nil {
		t.Fatal(err)
	}
	for rows.Next() {
		var id string
		rows.Scan(&id)
		ids = append(ids, id)
	}
	if rows.Close(); !slices.Equal(ids, []string{"inv-1"}) {
		t.Fatalf("builds whose output may move: %v, want inv-1", ids)
	}
	var indexed bool
	if err := conn.QueryRow(ctx, `select exists (select from pg_indexes where indexname = 'archived_builds_output_idx')`).Scan(&indexed); err != nil || !indexed {
		t.Fatalf("the index after the migration: %v, %v", indexed, err)
	}
	if err := m.MigrateTo(ctx, version-1); err != nil {
		t.Fatalf("down: %v", err)
	}
	if err := m.MigrateTo(ctx, version); err != nil {
		t.Fatalf("up again: %v", err)
	}
}
