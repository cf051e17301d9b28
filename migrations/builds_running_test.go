package migrations_test

import (
	"context"
	"fmt"
	"strings"
	"testing"

	"github.com/millrace/millrace/projectors/builds"
)

// TestBuildsRunningMigration: 020 moves the target and test rows of running
// builds into targets_running and tests_running and leaves finished
// builds' where they were; builds show the same rows after it; down puts
// the running rows back.
func TestBuildsRunningMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_running")
	if _, err := conn.Exec(ctx, `
		insert into invocations (id, project, status, first_event_at, last_event_at) values
		    ('inv-done', 'acme', 'succeeded', '2024-03-09 14:58Z', '2024-03-09 15:03Z'),
		    ('inv-run', 'acme', 'running', '2024-03-09 15:00Z', '2024-03-09 15:04Z');
		select build_partitions_for(((build_key >> 47) / 7)::int4) from invocations;
		insert into build_labels (project, id, label) values
		    ('acme', build_label_id('//a:a'), '//a:a'), ('acme', build_label_id('//b:b'), '//b:b');
		insert into targets (build_key, label_id, success, failed)
		select build_key, build_label_id(l), ok, case when not ok then true end from invocations,
		       (values ('//a:a', true), ('//b:b', false)) v(l, ok);
		insert into tests (build_key, label_id, status, has_summary, attempts)
		select build_key, build_label_id('//a:a'), 'PASSED', true, 1 from invocations`); err != nil {
		t.Fatal(err)
	}
	count := func(sql string) int {
		t.Helper()
		var n int
		if err := conn.QueryRow(ctx, sql).Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	shown := func(inv string) string {
		t.Helper()
		b, err := builds.Show(ctx, conn, "acme", inv)
		if err != nil {
			t.Fatal(err)
		}
		s := ""
		for _, tg := range b.Targets {
			s += tg.Label + map[bool]string{true: "+", false: "-"}[tg.Success] + " "
		}
		for _, ts := range b.Tests {
			s += ts.Label + "=" + ts.Status
		}
		return s
	}
	const want = "//a:a+ //b:b- //a:a=PASSED"
	for _, step := range []int32{version, version - 1, version} {
		if err := m.MigrateTo(ctx, step); err != nil {
			t.Fatalf("to %d: %v", step, err)
		}
		run, done := count(`select count(*) from targets t join invocations i using (build_key) where i.id = 'inv-run'`),
			count(`select count(*) from targets t join invocations i using (build_key) where i.id = 'inv-done'`)
		if step < version {
			if run != 2 || done != 2 {
				t.Fatalf("at %d: targets holds %d rows of the running build and %d of the finished one, want 2 and 2", step, run, done)
			}
			continue
		}
		moved := count(`select count(*) from targets_running`) + count(`select count(*) from tests_running`)
		if run != 0 || done != 2 || moved != 3 {
			t.Fatalf("at %d: targets holds %d rows of the running build and %d of the finished one, the running tables %d; want 0, 2 and 3",
				step, run, done, moved)
		}
		// Read by the release's code, which needs the migrations after
		// 020 (and back down through them).
		if err := m.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		for _, inv := range []string{"inv-done", "inv-run"} {
			if got := shown(inv); got != want {
				t.Fatalf("at %d: %s shows %q, want %q", step, inv, got, want)
			}
		}
		if err := m.MigrateTo(ctx, step); err != nil {
			t.Fatalf("back to %d: %v", step, err)
		}
	}
}

// TestBuildsByKeyMigration: 021 names the rows of build_metadata,
// build_command_lines and build_metrics by build key, in batches, each its
// own transaction (5,000 builds: three batches); builds show the same
// metadata, command lines and metrics after it; down brings the
// invocation ids back, and up again the keys.
func TestBuildsByKeyMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_by_key")
	if _, err := conn.Exec(ctx, `
		insert into invocations (id, project, status, first_event_at, last_event_at)
		select format('inv-%s', n), case when n % 2 = 0 then 'acme' else 'beta' end, 'succeeded',
		       '2024-03-09 14:58Z'::timestamptz + n * interval '1 second', '2024-03-09 15:03Z'
		from generate_series(1, 5000) n;
		insert into invocations (id, project, status, first_event_at, last_event_at)
		values ('inv-2', 'beta', 'failed', '2024-03-09 14:58Z', '2024-03-09 15:03Z');
		insert into build_metadata (project, invocation_id, source, key, value)
		select project, id, 'build_metadata', 'COMMIT_SHA', 'sha-' || id from invocations
		union all select project, id, 'stable', 'BUILD_HOST', 'ci-' || project from invocations;
		insert into build_argv (project, hash, argv) values
		    ('acme', build_argv_hash('{bazel,test,//...}'), '{bazel,test,//...}'),
		    ('beta', build_argv_hash('{bazel,test,//...}'), '{bazel,test,//...}');
		insert into build_command_lines (project, invocation_id, source, label, argv_hash)
		select project, id, 'structured_command_line', 'canonical', build_argv_hash('{bazel,test,//...}') from invocations;
		insert into build_metrics (project, invocation_id, actions_created, cpu_time_ms)
		select project, id, 7, length(id) from invocations`); err != nil {
		t.Fatal(err)
	}
	shown := func() string {
		t.Helper()
		var out []string
		for _, k := range [][2]string{{"acme", "inv-2"}, {"beta", "inv-2"}, {"beta", "inv-4999"}} {
			b, err := builds.Show(ctx, conn, k[0], k[1])
			if err != nil {
				t.Fatal(err)
			}
			s := fmt.Sprintf("%s/%s %v %v %q", k[0], k[1], b.BuildMetadata, b.WorkspaceStatus, b.CommandLine)
			if b.Metrics != nil {
				s += fmt.Sprintf(" %d %d", b.Metrics.ActionsCreated, b.Metrics.CPUTimeMs)
			}
			out = append(out, s)
		}
		return strings.Join(out, "\n")
	}
	const want = `acme/inv-2 map[COMMIT_SHA:sha-inv-2] [{BUILD_HOST ci-acme true}] ["bazel" "test" "//..."] 7 5
beta/inv-2 map[COMMIT_SHA:sha-inv-2] [{BUILD_HOST ci-beta true}] ["bazel" "test" "//..."] 7 5
beta/inv-4999 map[COMMIT_SHA:sha-inv-4999] [{BUILD_HOST ci-beta true}] ["bazel" "test" "//..."] 7 8`
	latest := func() {
		t.Helper()
		if err := m.Migrate(ctx); err != nil {
			t.Fatal(err)
		}
		if got := shown(); got != want {
			t.Fatalf("after %d, builds show\n%s\nwant\n%s", version, got, want)
		}
	}
	if err := m.MigrateTo(ctx, version); err != nil {
		t.Fatal(err)
	}
	var batches, rows int
	if err := conn.QueryRow(ctx, `select count(distinct xmin::text), count(*) from build_metadata`).Scan(&batches, &rows); err != nil {
		t.Fatal(err)
	}
	if batches < 3 || rows != 2*5001 {
		t.Fatalf("build_metadata: %d rows written in %d transactions, want %d in 3 or more", rows, batches, 2*5001)
	}
	latest()
	if err := m.MigrateTo(ctx, version-1); err != nil {
		t.Fatal(err)
	}
	var ids int
	if err := conn.QueryRow(ctx, `select count(*) from build_metrics m join invocations i on i.id = m.invocation_id and i.project = m.project`).Scan(&ids); err != nil || ids != 5001 {
		t.Fatalf("after down, %d metrics rows name their invocation (%v), want 5001", ids, err)
	}
	latest()
}
