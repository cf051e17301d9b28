package migrations_test

import (
	"context"
	"encoding/json"
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/projectors/builds"
)

// TestBuildsCompactMigration: 016 re-keys the large build tables by a
// build key and moves their rows into partitions. Builds projected before
// it show as they did, in the same label order; down brings back the
// tables keyed by (invocation_id, project) with the same rows, and up
// again yields the same keys' rows.
func TestBuildsCompactMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_compact")
	if _, err := conn.Exec(ctx, `
		insert into invocations (id, project, status, first_event_at, last_event_at) values
		    ('inv-1', 'acme', 'failed', '2024-03-09 14:58Z', '2024-03-09 15:03Z'),
		    ('inv-1', 'beta', 'succeeded', '2024-03-20 08:00Z', '2024-03-20 08:01Z'),
		    ('inv-2', 'acme', 'running', '2024-03-20 09:00Z', '2024-03-20 09:01Z');
		insert into targets (invocation_id, project, label, kind, success, failure_reason, failure_rank, failed) values
		    ('inv-1', 'acme', '//b:b', 'genrule rule', false, 'boom', 3, true),
		    ('inv-1', 'acme', '//a:a', 'sh_test rule', true, null, 0, null),
		    ('inv-1', 'beta', '//a:a', 'sh_test rule', true, null, 0, null),
		    ('inv-2', 'acme', '//c:c', null, null, null, 0, null);
		insert into tests (invocation_id, project, label, status, has_summary, attempts, duration_ms) values
		    ('inv-1', 'acme', '//a:a', 'FLAKY', true, 2, 1200),
		    ('inv-1', 'beta', '//a:a', 'PASSED', true, 1, 900);
		insert into build_failures (project, invocation_id, kind, label, primary_output, configuration, mnemonic, exit_code, stderr) values
		    ('acme', 'inv-1', 'action', '//b:b', 'bazel-out/b.out', 'k8', 'Genrule', 1, 'no');
		insert into target_causes (project, invocation_id, label, cause_kind, cause_label, cause_output, cause_configuration) values
		    ('acme', 'inv-1', '//b:b', 'action', '//b:b', 'bazel-out/b.out', 'k8'),
		    ('acme', 'inv-1', '//b:b', 'configured_label', '//dep:x', '', 'k8')`); err != nil {
		t.Fatal(err)
	}
	before := oldRows(t, conn)
	// Up to the newest schema, which the read side follows (017 moved the
	// command lines); down again through 016 below.
	if err := m.Migrate(ctx); err != nil {
		t.Fatal(err)
	}
	shown := showAll(t, conn)
	for _, want := range []string{
		`"targets":[{"label":"//a:a","kind":"sh_test rule","success":true,"failure_reason":null,"root_causes":[]},` +
			`{"label":"//b:b","kind":"genrule rule","success":false,"failure_reason":"boom","root_causes":[{"kind":"action","label":"//b:b"`,
		// A cause the build holds no event about keeps its key.
		`{"kind":"configured_label","label":"//dep:x","primary_output":"","configuration":"k8","mnemonic":null`,
		`"tests":[{"label":"//a:a","status":"FLAKY","attempts":2,"shards":0,"duration_ms":1200`,
		`"tests":[{"label":"//a:a","status":"PASSED","attempts":1,"shards":0,"duration_ms":900`,
		`"targets":[{"label":"//c:c","kind":"","success":false`,
	} {
		if !strings.Contains(shown, want) {
			t.Errorf("after 016, no %s in\n%s", want, shown)
		}
	}
	var keys, partitions int
	var all bool
	if err := conn.QueryRow(ctx, `select count(distinct build_key), bool_and(build_key is not null),
		(select count(*) from pg_inherits where inhparent = 'targets'::regclass)
		from invocations`).Scan(&keys, &all, &partitions); err != nil {
		t.Fatal(err)
	}
	// Two weeks: 2024-03-09 and 2024-03-20 are 11 days apart.
	if keys != 3 || !all || partitions != 2 {
		t.Errorf("keys %d (all set: %v), target partitions %d; want 3, true, 2", keys, all, partitions)
	}
	var older bool
	if err := conn.QueryRow(ctx, `select (select build_key from invocations where id = 'inv-1' and project = 'acme')
		< (select build_key from invocations where id = 'inv-2')`).Scan(&older); err != nil || !older {
		t.Errorf("build keys do not follow the first events' order (%v)", err)
	}
	if err := m.MigrateTo(ctx, version-1); err != nil {
		t.Fatalf("down: %v", err)
	}
	if got := oldRows(t, conn); got != before {
		t.Errorf("after down:\n%s\nbefore up:\n%s", got, before)
	}
	if err := m.Migrate(ctx); err != nil {
		t.Fatalf("up again: %v", err)
	}
	if got := showAll(t, conn); got != shown {
		t.Errorf("up again:\n%s\nfirst up:\n%s", got, shown)
	}
}

// oldRows is the rows of the four tables in their shape before 016.
func oldRows(t *testing.T, conn *pgx.Conn) string {
	t.Helper()
	var s string
	err := conn.QueryRow(context.Background(), `select concat_ws(E'\n',
		(select string_agg(format('%s %s %s %s %s %s %s %s', invocation_id, project, label, kind, success, failure_reason, failure_rank, failed), E'\n' order by invocation_id, project, label) from targets),
		(select string_agg(format('%s %s %s %s %s %s', invocation_id, project, label, status, attempts, duration_ms), E'\n' order by invocation_id, project, label) from tests),
		(select string_agg(format('%s %s %s %s %s', invocation_id, project, label, primary_output, stderr), E'\n' order by invocation_id, project, label) from build_failures),
		(select string_agg(format('%s %s %s %s', invocation_id, project, label, cause_label), E'\n' order by invocation_id, project, label) from target_causes))`).Scan(&s)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// showAll is every build as builds.Show gives it.
func showAll(t *testing.T, conn *pgx.Conn) string {
	t.Helper()
	ctx := context.Background()
	var b strings.Builder
	for _, k := range [][2]string{{"acme", "inv-1"}, {"beta", "inv-1"}, {"acme", "inv-2"}} {
		s, err := builds.Show(ctx, conn, k[0], k[1])
		if err != nil {
			t.Fatal(err)
		}
		js, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		b.Write(js)
		b.WriteByte('\n')
	}
	return b.String()
}

// BenchmarkBuildsCompactMigration times 016, then the migrations after it,
// on a database of builds in the shape before 016: -builds-compact-builds builds of 50 targets and 15
// tests each, three failures and causes. It reports seconds per million
// target rows (the upgrade notes quote it, projectors/builds/README.md):
//
//	go test ./migrations -run '^$' -bench BuildsCompactMigration -benchtime 1x
func BenchmarkBuildsCompactMigration(b *testing.B) {
	ctx := context.Background()
	for range b.N {
		b.StopTimer()
		conn := emptyDatabase(b)
		m, version := migratedBefore(b, conn, "builds_compact")
		for _, sql := range []string{
			`insert into invocations (id, project, status, first_event_at, last_event_at)
			 select 'inv-' || n, 'p' || n % 5, 'failed', timestamptz '2026-01-01' + n * interval '1 minute',
			        timestamptz '2026-01-01' + n * interval '1 minute' + interval '30 seconds'
			 from generate_series(1, $1) n`,
			`insert into targets (invocation_id, project, label, kind, success, failure_rank, failed, tags)
			 select i.id, i.project, '//pkg' || t / 10 || ':t' || t, 'genrule rule', t % 17 <> 0, 0,
			        case when t % 17 = 0 then true end, '{}'
			 from invocations i, generate_series(1, 50) t`,
			`insert into tests (invocation_id, project, label, status, has_summary, attempts, duration_ms)
			 select i.id, i.project, '//pkg' || t / 10 || ':t' || t, 'PASSED', true, 1, 1200
			 from invocations i, generate_series(1, 50, 3) t`,
			`insert into build_failures (project, invocation_id, kind, label, primary_output, configuration, mnemonic, exit_code, message)
			 select i.project, i.id, 'action', '//pkg0:t' || t, 'bazel-out/k8-fastbuild/bin/pkg0/t' || t || '.txt',
			        md5(t::text) || md5(t::text), 'Genrule', 1, 'bash failed: error executing command'
			 from invocations i, generate_series(17, 50, 17) t`,
			`insert into target_causes (project, invocation_id, label, cause_kind, cause_label, cause_output, cause_configuration)
			 select project, invocation_id, label, kind, label, primary_output, configuration from build_failures`,
			// What 021 names by build key: a build's metadata, command
			// lines and metrics, as a Bazel build of the storage bench has
			// them.
			`insert into build_metadata (project, invocation_id, source, key, value)
			 select i.project, i.id, s, k, 'value-' || n from invocations i,
			        (values ('stable', 'BUILD_HOST', 1), ('stable', 'BUILD_USER', 2), ('stable', 'BUILD_EMBED_LABEL', 3),
			                ('volatile', 'BUILD_TIMESTAMP', 4)) v(s, k, n)`,
			`insert into build_command_lines (project, invocation_id, source, label, argv)
			 select i.project, i.id, s, l, array['bazel', 'test', '//...', i.id] from invocations i,
			        (values ('structured_command_line', 'canonical'), ('options_parsed', 'explicit_cmd_line'),
			                ('options_parsed', 'explicit_startup_options')) v(s, l)`,
			`insert into build_metrics (project, invocation_id, actions_created, cpu_time_ms)
			 select project, id, 100, 5000 from invocations`,
			`vacuum analyze`,
		} {
			var err error
			if strings.Contains(sql, "$1") {
				_, err = conn.Exec(ctx, sql, *compactBuilds)
			} else {
				_, err = conn.Exec(ctx, sql)
			}
			if err != nil {
				b.Fatalf("%s: %v", sql, err)
			}
		}
		b.StartTimer()
		start := time.Now()
		if err := m.MigrateTo(ctx, version); err != nil {
			b.Fatal(err)
		}
		mtargets := float64(*compactBuilds) * 50 / 1e6
		b.ReportMetric(time.Since(start).Seconds()/mtargets, "s/Mtargets")
		// And the migrations after it: 017-019 (command lines, output,
		// target kinds), which 019 dominates (it writes every target
		// again), then 020-021 (running builds' rows, metadata by key).
		var kinds int32
		for _, x := range m.Migrations {
			if strings.HasSuffix(x.Name, "_builds_kinds.sql") {
				kinds = x.Sequence
			}
		}
		start = time.Now()
		if err := m.MigrateTo(ctx, kinds); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(time.Since(start).Seconds()/mtargets, "s/Mtargets-after")
		start = time.Now()
		if err := m.Migrate(ctx); err != nil {
			b.Fatal(err)
		}
		b.ReportMetric(time.Since(start).Seconds()/mtargets, "s/Mtargets-020-021")
	}
}

var compactBuilds = flag.Int("builds-compact-builds", 20_000, "BenchmarkBuildsCompactMigration: builds of 50 targets (20,000: a million target rows)")

// TestBuildsKindsMigration: 019 moves targets' kinds into build_kinds;
// builds show the same kinds after it, and down brings the column back.
func TestBuildsKindsMigration(t *testing.T) {
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, version := migratedBefore(t, conn, "builds_kinds")
	if _, err := conn.Exec(ctx, `
		insert into invocations (id, project, status, first_event_at, last_event_at) values
		    ('inv-1', 'acme', 'succeeded', '2024-03-09 14:58Z', '2024-03-09 15:03Z');
		select build_partitions_for(((build_key >> 47) / 7)::int4) from invocations;
		insert into build_labels (project, id, label) values
		    ('acme', build_label_id('//a:a'), '//a:a'), ('acme', build_label_id('//b:b'), '//b:b'), ('acme', build_label_id('//c:c'), '//c:c');
		insert into targets (build_key, label_id, kind, success)
		select build_key, build_label_id(l), k, true from invocations,
		       (values ('//a:a', 'sh_test rule'), ('//b:b', 'genrule rule'), ('//c:c', null)) v(l, k)`); err != nil {
		t.Fatal(err)
	}
	kinds := func() string {
		b, err := builds.Show(ctx, conn, "acme", "inv-1")
		if err != nil {
			t.Fatal(err)
		}
		var ks []string
		for _, tg := range b.Targets {
			ks = append(ks, tg.Label+"="+tg.Kind)
		}
		return strings.Join(ks, ",")
	}
	const want = "//a:a=sh_test rule,//b:b=genrule rule,//c:c="
	for _, step := range []int32{version, version - 1, version} {
		if err := m.MigrateTo(ctx, step); err != nil {
			t.Fatalf("to %d: %v", step, err)
		}
		var col string
		if err := conn.QueryRow(ctx, `select string_agg(attname, ',' order by attname) from pg_attribute
			where attrelid = 'targets'::regclass and attname in ('kind', 'kind_id') and not attisdropped`).Scan(&col); err != nil {
			t.Fatal(err)
		}
		switch {
		case step == version && col != "kind_id":
			t.Fatalf("at %d targets have %q, want kind_id only", step, col)
		case step < version && col != "kind":
			t.Fatalf("at %d targets have %q, want kind only", step, col)
		}
		if step == version {
			// Read by the release's code, which needs the migrations
			// after 019 (and back down through them).
			if err := m.Migrate(ctx); err != nil {
				t.Fatal(err)
			}
			if got := kinds(); got != want {
				t.Fatalf("at %d: kinds %s, want %s", step, got, want)
			}
			if err := m.MigrateTo(ctx, step); err != nil {
				t.Fatalf("back to %d: %v", step, err)
			}
		}
	}
	var n int
	if err := conn.QueryRow(ctx, `select count(*) from build_kinds`).Scan(&n); err != nil || n != 2 {
		t.Fatalf("build_kinds holds %d kinds (%v), want 2", n, err)
	}
}
