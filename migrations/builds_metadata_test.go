package migrations_test

import (
	"context"
	"testing"

	"github.com/millrace/millrace/projectors/builds"
)

// TestBuildsMetadataMigration: 013 only adds tables, so a build projected
// before it shows as it did, with empty metadata and no root causes; down
// drops the tables and up makes them again.
func TestBuildsMetadataMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_metadata")
	if _, err := conn.Exec(ctx, `
		insert into invocations (id, project, user_name, host, status, first_event_at, last_event_at)
		values ('inv-1', 'acme', 'ci', 'ci-7', 'failed', '2024-03-09 14:58Z', '2024-03-09 15:03Z');
		insert into targets (invocation_id, project, label, success, failure_reason, failure_rank)
		values ('inv-1', 'acme', '//a:a', false, 'boom', 3)`); err != nil {
		t.Fatal(err)
	}
	for _, step := range []int32{version, version - 1, version} {
		if err := m.MigrateTo(ctx, step); err != nil {
			t.Fatalf("to %d: %v", step, err)
		}
	}
	// Shown by today's schema (the read side follows the newest tables).
	if err := m.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	b, err := builds.Show(ctx, conn, "acme", "inv-1")
	if err != nil {
		t.Fatal(err)
	}
	if len(b.Targets) != 1 || *b.Targets[0].FailureReason != "boom" || len(b.Targets[0].RootCauses) != 0 ||
		len(b.BuildMetadata) != 0 || len(b.WorkspaceStatus) != 0 || b.CommandLine != nil || *b.User != "ci" {
		t.Errorf("a build projected before 013: %+v", b)
	}
}
