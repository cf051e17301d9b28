package migrations_test

import (
	"context"
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
		for _, inv := range []string{"inv-done", "inv-run"} {
			if got := shown(inv); got != want {
				t.Fatalf("at %d: %s shows %q, want %q", step, inv, got, want)
			}
		}
	}
}
