package builds

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"reflect"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams/projection"
)

// bigOutputBuild is a build whose output spans several pages of each
// stream, in progress events of uneven sizes, with a late event after its
// stream ended.
func bigOutputBuild(s *stream, inv string) (b *builder, stdout, stderr []byte) {
	b = s.invocation("acme", inv)
	b.attemptStarted()
	b.tool(startedEv(inv, s.now))
	var o, e bytes.Buffer
	for i := range 700 {
		out := fmt.Sprintf("line %d %s\n", i, strings.Repeat("o", i%300))
		errs := fmt.Sprintf("[%d / 700] %s\n", i, strings.Repeat("e", (i*7)%500))
		o.WriteString(out)
		e.WriteString(errs)
		b.tool(progressEv(int32(i), out, errs))
	}
	b.tool(finishedEv(0, "SUCCESS", s.now))
	b.finishStream()
	return b, o.Bytes(), e.Bytes()
}

// TestOutputPages: output is cut into pages of OutputPageBytes at fixed
// offsets, so the rows are the same whatever the batch boundaries (the
// scratch chunks of many batches fold into the same pages as one batch's
// output), a late event appends to the last page, and each page reads on
// its own.
func TestOutputPages(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	var want map[string]string
	for _, n := range []int{5000, 1, 13, 200} {
		truncate(t, pool)
		s := newStream(t0)
		b, stdout, stderr := bigOutputBuild(s, "inv-big")
		late := "late output after the end\n"
		b.tool(progressEv(9999, late, ""))
		applyAll(t, pool, p, s.msgs, n)
		stdout = append(stdout, late...)

		if got := digest(t, pool); want == nil {
			want = got
		} else if !maps.Equal(want, got) {
			t.Errorf("batches of %d: digest differs from one batch:\n got %v\nwant %v", n, got, want)
		}
		var chunks int
		pool.QueryRow(ctx, `select count(*) from build_output_chunks`).Scan(&chunks)
		if chunks != 0 {
			t.Errorf("batches of %d: %d scratch chunks left after the build ended", n, chunks)
		}
		size, err := OutputSizes(ctx, pool, "acme", "inv-big")
		if err != nil {
			t.Fatal(err)
		}
		wantPages := func(n int) int32 { return int32((n + OutputPageBytes - 1) / OutputPageBytes) }
		if size.StdoutBytes != int64(len(stdout)) || size.StderrBytes != int64(len(stderr)) ||
			size.StdoutPages != wantPages(len(stdout)) || size.StderrPages != wantPages(len(stderr)) || size.StdoutPages < 2 {
			t.Fatalf("batches of %d: sizes %+v; want %d bytes (%d pages) and %d bytes (%d pages)", n, size,
				len(stdout), wantPages(len(stdout)), len(stderr), wantPages(len(stderr)))
		}
		for _, c := range []struct {
			stream int16
			all    []byte
			pages  int32
		}{{StreamStdout, stdout, size.StdoutPages}, {StreamStderr, stderr, size.StderrPages}} {
			for i := range c.pages {
				got, err := OutputPage(ctx, pool, "acme", "inv-big", c.stream, i)
				if err != nil {
					t.Fatal(err)
				}
				want := c.all[int(i)*OutputPageBytes : min(len(c.all), int(i+1)*OutputPageBytes)]
				if !bytes.Equal(got, want) {
					t.Fatalf("batches of %d: stream %d page %d: %d bytes differ from the output's %d", n, c.stream, i, len(got), len(want))
				}
			}
			if _, err := OutputPage(ctx, pool, "acme", "inv-big", c.stream, c.pages); err != ErrNotFound {
				t.Fatalf("page past the end: %v, want ErrNotFound", err)
			}
		}
		o, e, err := Output(ctx, pool, "acme", "inv-big")
		if err != nil || !bytes.Equal(o, stdout) || !bytes.Equal(e, stderr) {
			t.Fatalf("batches of %d: Output: %d and %d bytes, %v; want %d and %d", n, len(o), len(e), err, len(stdout), len(stderr))
		}
	}
}

// TestLegacyOutputRow: a build folded before pages (one build_output row)
// reads as one page per stream, and a late event of it moves its output
// into pages.
func TestLegacyOutputRow(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	b := s.invocation("acme", "inv-old")
	b.tool(startedEv("inv-old", s.now))
	b.tool(finishedEv(0, "SUCCESS", s.now))
	b.finishStream()
	applyAll(t, pool, p, s.msgs, 100)
	old := strings.Repeat("before pages\n", 10000)
	if _, err := pool.Exec(ctx, `insert into build_output (invocation_id, project, stdout, stderr, stdout_bytes, stderr_bytes)
		values ('inv-old', 'acme', $1, $2, $3, 0)`, compress([]byte(old)), compress(nil), len(old)); err != nil {
		t.Fatal(err)
	}
	got, err := OutputPage(ctx, pool, "acme", "inv-old", StreamStdout, 0)
	if err != nil || string(got) != old {
		t.Fatalf("legacy page 0: %d bytes, %v", len(got), err)
	}
	if size, err := OutputSizes(ctx, pool, "acme", "inv-old"); err != nil || size.StdoutBytes != int64(len(old)) || size.StdoutPages != 1 {
		t.Fatalf("legacy sizes %+v, %v", size, err)
	}

	mark := len(s.msgs)
	b.tool(progressEv(1, "late\n", ""))
	applyAll(t, pool, p, s.msgs[mark:], 100)
	var legacy, pages int
	pool.QueryRow(ctx, `select (select count(*) from build_output), (select count(*) from build_output_pages)`).Scan(&legacy, &pages)
	if want := (len(old) + 5 + OutputPageBytes - 1) / OutputPageBytes; legacy != 0 || pages != want {
		t.Fatalf("after a late event: %d legacy rows and %d pages; want 0 and %d", legacy, pages, want)
	}
	o, _, err := Output(ctx, pool, "acme", "inv-old")
	if err != nil || string(o) != old+"late\n" {
		t.Fatalf("output after the move: %d bytes, %v", len(o), err)
	}
}

// bigBuild writes a build of n targets (every third a test, every seventh
// target failing, tests failing every fifth) straight into the tables,
// for the reads.
func bigBuild(exec func(string, ...any), project, inv string, n int) {
	exec(`insert into invocations (id, project, first_event_at, last_event_at, status, exit_code, exit_code_name)
		values ($1, $2, now(), now(), 'failed', 3, 'TESTS_FAILED')`, inv, project)
	exec(sqlTestPartitions)
	exec(`insert into build_labels (project, id, label)
		select $1, build_label_id(l), l from (select format('//pkg%s:t%s', i / 100, i) from generate_series(0, $2 - 1) i) x(l)
		on conflict do nothing`, project, n)
	exec(`insert into build_kinds values (build_kind_id('genrule rule'), 'genrule rule') on conflict do nothing`)
	exec(`insert into targets (build_key, label_id, kind_id, success, failure_reason, failed)
		select (select build_key from invocations where id = $1 and project = $2), build_label_id(format('//pkg%s:t%s', i / 100, i)),
		       build_kind_id('genrule rule'), i % 7 <> 3, case when i % 7 = 3 then 'broke' end, case when i % 7 = 3 then true end
		from generate_series(0, $3 - 1) i`, inv, project, n)
	exec(`insert into tests (build_key, label_id, status, has_summary)
		select (select build_key from invocations where id = $1 and project = $2), build_label_id(format('//pkg%s:t%s', i / 100, i)),
		       case when i % 5 = 0 then 'FAILED' when i % 997 = 0 then 'FLAKY' else 'PASSED' end, true
		from generate_series(0, $3 - 1, 3) i`, inv, project, n)
	exec(`analyze targets`)
	exec(`analyze tests`)
	// Not vacuumed, as right after a big build lands: the walk must not
	// depend on build_labels' visibility map.
	exec(`analyze build_labels`)
}

func TestPagedReads(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	const n = 3000
	bigBuild(exec, "acme", "inv-big", n)
	bigBuild(exec, "beta", "inv-big", 50) // same id, other project: never mixed in

	full, err := Show(ctx, pool, "acme", "inv-big")
	if err != nil {
		t.Fatal(err)
	}
	// Paging through yields Show's rows, in order, each page at most the limit.
	walk := func(_ any, count int, next func(after string) (int, string, error)) {
		t.Helper()
		after, seen := "", 0
		for {
			got, last, err := next(after)
			if err != nil {
				t.Fatal(err)
			}
			if got == 0 {
				break
			}
			seen += got
			after = last
		}
		if seen != count {
			t.Fatalf("paged through %d rows, want %d", seen, count)
		}
	}
	var targets []Target
	walk(nil, n, func(after string) (int, string, error) {
		ts, err := Targets(ctx, pool, "acme", "inv-big", PageQuery{After: after, Limit: 250})
		if len(ts) > 250 {
			t.Fatalf("page of %d rows, limit 250", len(ts))
		}
		targets = append(targets, ts...)
		if len(ts) == 0 {
			return 0, "", err
		}
		return len(ts), ts[len(ts)-1].Label, err
	})
	if !reflect.DeepEqual(targets, full.Targets) {
		t.Fatal("pages of targets differ from Show's targets")
	}
	var failed []Target
	for _, tg := range full.Targets {
		if !tg.Success {
			failed = append(failed, tg)
		}
	}
	var gotFailed []Target
	walk(nil, len(failed), func(after string) (int, string, error) {
		ts, err := Targets(ctx, pool, "acme", "inv-big", PageQuery{After: after, Limit: 100, Failed: true})
		gotFailed = append(gotFailed, ts...)
		if len(ts) == 0 {
			return 0, "", err
		}
		return len(ts), ts[len(ts)-1].Label, err
	})
	if !reflect.DeepEqual(gotFailed, failed) {
		t.Fatal("pages of failed targets differ from Show's failed targets")
	}
	for _, status := range []string{"", "FAILED", "PASSED", "FLAKY"} {
		var want, got []Test
		for _, ts := range full.Tests {
			if status == "" || ts.Status == status {
				want = append(want, ts)
			}
		}
		walk(nil, len(want), func(after string) (int, string, error) {
			ts, err := Tests(ctx, pool, "acme", "inv-big", PageQuery{After: after, Status: status})
			got = append(got, ts...)
			if len(ts) == 0 {
				return 0, "", err
			}
			return len(ts), ts[len(ts)-1].Label, err
		})
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("pages of tests with status %q differ from Show's", status)
		}
	}
	if ts, _ := Targets(ctx, pool, "acme", "inv-big", PageQuery{Limit: 5000}); len(ts) != MaxPageRows {
		t.Fatalf("a limit of 5000 gave %d rows, want MaxPageRows", len(ts))
	}
	if ts, _ := Targets(ctx, pool, "acme", "inv-big", PageQuery{}); len(ts) != DefaultPageRows {
		t.Fatalf("no limit gave %d rows, want DefaultPageRows", len(ts))
	}
}

// TestPagedReadsUseTheIndex: each query of a paged read reads its rows
// through an index: no sequential scan, and no sort but of a small
// build's rows or of the few rows of a partial index, so a page's cost
// does not grow with the build (a build of 100,000 targets here).
func TestPagedReadsUseTheIndex(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	bigBuild(exec, "acme", "inv-big", 100_000)
	bigBuild(exec, "acme", "inv-small", 20)
	// The week's other builds: a partition holds more than one build, and
	// a probe of a chunk's rows must find them by key, not scan the week.
	for i := range 3 {
		bigBuild(exec, "other", fmt.Sprintf("inv-other-%d", i), 100_000)
	}
	exec(`insert into build_output_pages (invocation_id, project, stream, page, bytes, data)
		select 'inv-' || b, 'acme', s, p, 65536, '\x00' from generate_series(1, 2) s, generate_series(0, 999) p,
		       unnest(array['big', 'other-1', 'other-2', 'other-3', 'other-4', 'other-5', 'other-6', 'other-7', 'other-8', 'other-9']) b`)
	exec(`analyze build_output_pages`)
	var big, small int64
	if err := pool.QueryRow(ctx, `select (select build_key from invocations where id = 'inv-big'),
		(select build_key from invocations where id = 'inv-small')`).Scan(&big, &small); err != nil {
		t.Fatal(err)
	}
	ids := make([]int64, 400)
	for i := range ids {
		ids[i] = labelID(fmt.Sprintf("//pkg%d:t%d", (5000+i)/100, 5000+i))
	}
	for _, c := range []struct {
		name, sql, index string
		args             []any
	}{
		// A large build: its labels a chunk at a time, in order from
		// build_labels_label_idx, then the chunk's ids probed in the week's
		// partition's primary key.
		{"label chunk", sqlLabelChunk, `Index (Only )?Scan/build_labels_label_idx`, []any{"acme", "//pkg5:t5", 400}},
		{"targets of labels", fmt.Sprintf(sqlTargetsOfLabels, "targets"), `Index Scan/targets_w[0-9]+_pkey`, []any{big, ids}},
		{"tests of labels", fmt.Sprintf(sqlTestsOfLabels, "tests"), `Index Scan/tests_w[0-9]+_pkey`, []any{big, ids, "PASSED"}},
		// Of a running build: both tables (running.go), each by its key.
		{"targets of labels, running", fmt.Sprintf(sqlTargetsOfLabels, "all_targets"), `Index Scan/targets_w[0-9]+_pkey`, []any{big, ids}},
		// A small build read whole and sorted: its range of the primary key.
		{"targets, small build", fmt.Sprintf(sqlTargetsSorted, "targets"), `Index Scan/targets_w[0-9]+_pkey`, []any{small, "acme", "", 100}},
		{"tests, small build", fmt.Sprintf(sqlTestsSorted, "tests"), `Index Scan/tests_w[0-9]+_pkey`, []any{small, "acme", "", 100, ""}},
		// The few failed targets, and a rare status: from the partial
		// indexes (named after their columns by the partitions' LIKE), then
		// sorted.
		{"failed targets", fmt.Sprintf(sqlFailedTargetsPage, "targets"), `Index Scan/targets_w[0-9]+_build_key_label_id_idx`, []any{big, "acme", "", 100}},
		{"tests of a rare status", fmt.Sprintf(sqlTestsNotPassedPage, "tests"), `Index Scan/tests_w[0-9]+_build_key_status_label_id_idx`, []any{big, "acme", "", 100, "FLAKY"}},
		{"output page", sqlOutputPages, `Index Scan/build_output_pages_pkey`, []any{"inv-big", "acme", int16(1), int32(7), int32(7)}},
		{"output size", sqlOutputSize, `Index Scan/build_output_pages_pkey`, []any{"inv-big", "acme"}},
	} {
		var plan []map[string]any
		var raw []byte
		if err := pool.QueryRow(ctx, "explain (format json) "+c.sql, c.args...).Scan(&raw); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if err := json.Unmarshal(raw, &plan); err != nil {
			t.Fatal(err)
		}
		var nodes []string
		var visit func(n map[string]any)
		visit = func(n map[string]any) {
			nodes = append(nodes, fmt.Sprintf("%v/%v", n["Node Type"], n["Index Name"]))
			if kids, ok := n["Plans"].([]any); ok {
				for _, k := range kids {
					visit(k.(map[string]any))
				}
			}
		}
		visit(plan[0]["Plan"].(map[string]any))
		s := strings.Join(nodes, " ")
		if !regexp.MustCompile(c.index).MatchString(s) && !strings.Contains(s, "Index Only Scan/"+strings.TrimPrefix(c.index, "Index Scan/")) {
			t.Errorf("%s: plan %s does not scan %s", c.name, s, c.index)
		}
		// A bitmap scan reads the index too, but not in order: only the
		// size, which sums every page of the build, may take one.
		rare := c.name == "tests of a rare status" || c.name == "failed targets" || strings.HasSuffix(c.name, "small build")
		if strings.Contains(s, "Seq Scan") || (strings.Contains(s, "Sort/") && !rare) || (strings.Contains(s, "Bitmap") && c.name != "output size" && !rare) {
			t.Errorf("%s: plan %s scans or sorts the build's rows", c.name, s)
		}
	}
}

// TestWriteJSON: the streamed JSON is byte for byte what printing Show's
// Build gives (json.Encoder, two-space indent), for builds with and
// without targets and tests.
func TestWriteJSON(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s, ids := scenario()
	applyAll(t, pool, p, s.msgs, 1000)
	s2 := newStream(t0)
	synthBuild(s2, "acme", "inv-synth", 40, true)
	applyAll(t, pool, p, s2.msgs, 1000)
	s3 := newStream(t0)
	s3.invocation("acme", "inv-bare").tool(startedEv("inv-bare", t0))
	applyAll(t, pool, p, s3.msgs, 1000)
	for _, k := range append(ids, invKey{"acme", "inv-synth"}, invKey{"acme", "inv-bare"}) {
		b, err := Show(ctx, pool, k.project, k.id)
		if err != nil {
			t.Fatal(err)
		}
		var want, got bytes.Buffer
		enc := json.NewEncoder(&want)
		enc.SetIndent("", "  ")
		enc.Encode(b)
		if err := WriteJSON(ctx, pool, &got, k.project, k.id); err != nil {
			t.Fatal(err)
		}
		if got.String() != want.String() {
			t.Fatalf("%s: streamed JSON differs:\n%s\nwant\n%s", k.id, got.String(), want.String())
		}
	}
	if err := WriteJSON(ctx, pool, &bytes.Buffer{}, "acme", "nope"); err != ErrNotFound {
		t.Fatalf("unknown build: %v, want ErrNotFound", err)
	}
}

// TestProbesKeepTheirKeys: the indexes of the paged reads do not lure the
// projector's probes of a batch's rows (by invocation, project and label)
// away from the primary keys, even in a plan made while the tables are
// empty, as the first batches' generic plans are. (An index that began
// with invocation and project did: each probe of a build's tests scanned
// all of them, and a build of a million events took minutes a batch.)
func TestProbesKeepTheirKeys(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, sqlKeyedPlans); err != nil {
		t.Fatal(err)
	}
	if err := EnsurePartitions(ctx, tx, time.Now(), 0); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ name, sql, index string }{
		{"tests", sqlExistingTests, "tests"},
		{"targets", sqlExistingTargets, "targets"},
	} {
		if _, err := tx.Exec(ctx, "prepare probe_"+c.name+" as "+c.sql); err != nil {
			t.Fatal(err)
		}
		var raw []byte
		if err := tx.QueryRow(ctx, "explain (format json) execute probe_"+c.name+"('{acme}', '{inv}', '{//a:b}', '{7}')").Scan(&raw); err != nil {
			t.Fatal(err)
		}
		// The build by its key, then its row by the partition's key.
		var indexes []string
		for _, m := range regexp.MustCompile(`"Index Name": "([a-z0-9_]+)"`).FindAllStringSubmatch(string(raw), -1) {
			indexes = append(indexes, m[1])
		}
		// Each probe names the row by its whole key, not its build's
		// rows filtered.
		for _, m := range regexp.MustCompile(`"Index Cond": "([^"]*build_key[^"]*)"`).FindAllStringSubmatch(string(raw), -1) {
			if !strings.Contains(m[1], "label_id") {
				t.Errorf("the probe of %s reads a build's rows by %s, want the label id in the condition", c.name, m[1])
			}
		}
		// Per table (the partitions', the running one): the build by its
		// key, then its row by the table's.
		part := regexp.MustCompile(`^` + c.index + `(_w[0-9]+|_running)_pkey$`)
		ok := len(indexes) == 4
		for i := 0; ok && i < len(indexes); i += 2 {
			ok = indexes[i] == "invocations_pkey" && part.MatchString(indexes[i+1])
		}
		if !ok || !strings.HasSuffix(indexes[3], "_running_pkey") {
			t.Errorf("the probe of %s uses %v, want invocations_pkey and %s's partition key, then invocations_pkey and its running table's:\n%s", c.name, indexes, c.index, raw)
		}
	}
}

// Completing a target that succeeded changes no column an index holds or
// filters on, so its update is HOT (no new index entries): the
// failed-targets index filters on failed, which only a failure sets.
func TestSuccessfulCompletionIsHOT(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	b := s.invocation("acme", "inv-hot")
	b.tool(startedEv("inv-hot", s.now))
	for i := range 20 {
		b.tool(configuredEv(fmt.Sprintf("//pkg:t%02d", i), "genrule rule"))
	}
	configured := len(s.msgs)
	for i := range 20 {
		b.tool(completedEv(fmt.Sprintf("//pkg:t%02d", i), i != 7, ""))
	}
	applyAll(t, pool, p, s.msgs[:configured], 1000)
	var upd, hot int64
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		batch := make([]projection.Message, 0, len(s.msgs)-configured)
		for _, m := range s.msgs[configured:] {
			batch = append(batch, m)
		}
		if err := p.Apply(ctx, tx, batch); err != nil {
			return err
		}
		// The build runs: its rows are in targets_running (running.go).
		return tx.QueryRow(ctx, `select n_tup_upd, n_tup_hot_upd from pg_stat_xact_user_tables
			where relid = 'targets_running'::regclass`).Scan(&upd, &hot)
	})
	if err != nil {
		t.Fatal(err)
	}
	if upd != 20 || hot != 19 {
		t.Fatalf("completing 20 targets (one failed): %d updates, %d HOT; want 20 and 19", upd, hot)
	}
	var failed []string
	rows, _ := pool.Query(ctx, `select l.label from all_targets t join build_labels l on l.id = t.label_id where t.failed order by 1`)
	if failed, err = pgx.CollectRows(rows, pgx.RowTo[string]); err != nil || len(failed) != 1 || failed[0] != "//pkg:t07" {
		t.Fatalf("failed targets %v (%v), want //pkg:t07", failed, err)
	}
}
