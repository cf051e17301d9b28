package builds

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/bep"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

var t0 = time.Date(2024, 3, 9, 14, 58, 0, 0, time.UTC)

// golden compares got with testdata/name, or rewrites it with -update.
func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run the test with -update to create it)", err)
	}
	if !bytes.Equal(want, got) {
		t.Errorf("%s differs from the projection (run with -update to accept):\n--- want\n%s\n--- got\n%s", path, want, got)
	}
}

// dump renders everything the projection holds for the given builds plus
// all rollups, for golden files. (The project of each build is in its
// show document.)
func dump(t *testing.T, pool *pgxpool.Pool, keys ...invKey) []byte {
	t.Helper()
	var buf bytes.Buffer
	for _, k := range keys {
		buf.Write(dumpBuild(t, pool, k))
	}
	buf.Write(dumpRollups(t, pool))
	return buf.Bytes()
}

// dumpBuild renders one build: its show document, the invocation's other
// columns and its output.
func dumpBuild(t *testing.T, pool *pgxpool.Pool, k invKey) []byte {
	t.Helper()
	ctx := context.Background()
	var buf bytes.Buffer
	{
		id := k.id
		b, err := Show(ctx, pool, k.project, id)
		if err != nil {
			t.Fatalf("show %s: %v", id, err)
		}
		js, _ := json.MarshalIndent(b, "", "  ")
		fmt.Fprintf(&buf, "== show %s\n%s\n", id, js)
		var extra struct {
			Patterns                       []string
			User, Host, Workspace, Version *string
			LastSequence, EventCount       int64
			StreamDone                     bool
			AttemptResult                  *string
			FirstEventAt, LastEventAt      time.Time
		}
		err = pool.QueryRow(ctx, `select patterns, user_name, host, workspace_dir, bazel_version, last_sequence,
			event_count, stream_done, attempt_result, first_event_at, last_event_at from invocations
			where id = $1 and project = $2`, id, k.project).Scan(
			&extra.Patterns, &extra.User, &extra.Host, &extra.Workspace, &extra.Version, &extra.LastSequence,
			&extra.EventCount, &extra.StreamDone, &extra.AttemptResult, &extra.FirstEventAt, &extra.LastEventAt)
		if err != nil {
			t.Fatal(err)
		}
		extra.FirstEventAt, extra.LastEventAt = extra.FirstEventAt.UTC(), extra.LastEventAt.UTC()
		js, _ = json.Marshal(extra)
		fmt.Fprintf(&buf, "== invocation %s\n%s\n", id, js)
		stdout, stderr, err := Output(ctx, pool, k.project, id)
		if err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&buf, "== output %s: stdout %d bytes, stderr %d bytes\n%q\n", id, len(stdout), len(stderr), tail(stderr, 200))
	}
	return buf.Bytes()
}

// dumpRollups renders every hourly rollup row.
func dumpRollups(t *testing.T, pool *pgxpool.Pool) []byte {
	t.Helper()
	ctx := context.Background()
	var buf bytes.Buffer
	rows, err := pool.Query(ctx, `select project, to_char(hour at time zone 'UTC', 'YYYY-MM-DD HH24:MI'), builds, succeeded,
		failed, abandoned, duration_hist, duration_sum_ms, tests_passed, tests_failed, tests_flaky, cache_hits, cache_misses
		from hourly_rollups order by 1, 2`)
	if err != nil {
		t.Fatal(err)
	}
	buf.WriteString("== hourly_rollups (project hour builds succeeded failed abandoned hist sum_ms passed failed flaky cache_hits cache_misses)\n")
	for rows.Next() {
		var (
			project, hour                                   string
			builds, ok, failed, abandoned, sum, tp, tf, tfl int64
			hits, misses                                    int64
			hist                                            []int64
		)
		if err := rows.Scan(&project, &hour, &builds, &ok, &failed, &abandoned, &hist, &sum, &tp, &tf, &tfl, &hits, &misses); err != nil {
			t.Fatal(err)
		}
		fmt.Fprintf(&buf, "%s %s %d %d %d %d %v %d %d %d %d %d %d\n", project, hour, builds, ok, failed, abandoned, hist, sum, tp, tf, tfl, hits, misses)
	}
	if err := rows.Err(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// scenario is a small stream with one of each situation the projection
// must get right.
func scenario() (*stream, []invKey) {
	s := newStream(t0)

	// A: a failing `bazel test` with every kind of target outcome.
	a := s.invocation("acme", "inv-a")
	a.enqueued()
	a.attemptStarted()
	a.tool(startedEv("inv-a", s.now))
	a.tool(workspaceStatusEv("alice", "ws-12"))
	a.tool(patternEv("//pkg/...", "-//pkg:skip"))
	a.tool(progressEv(1, "", "Loading: 0 packages loaded\n"))
	a.tool(configuredEv("//pkg:gen", "genrule rule", "manual"))
	a.tool(configuredEv("//pkg:broken", "genrule rule"))
	a.tool(configuredEv("//pkg:pass_test", "sh_test rule"))
	a.tool(configuredEv("//pkg:flaky_test", "sh_test rule"))
	a.tool(configuredEv("//pkg:fail_test", "sh_test rule"))
	a.seq++
	a.toolBytes(a.seq, rawEv(16, rawString(1, "//pkg:caf\xe9\x00"), 18, rawString(1, "genrule rule", 3, "l\xe9gacy")))
	a.tool(abortedEv(&bep.BuildEventId{Id: &bep.BuildEventId_TargetConfigured{
		TargetConfigured: &bep.BuildEventId_TargetConfiguredId{Label: "//pkg:missing"}}},
		bep.Aborted_ANALYSIS_FAILURE, "no such target '//pkg:missing.txt'"))
	a.tool(progressEv(2, "stdout line\n", "[1 / 9] Executing genrule //pkg:gen\n"))
	a.tool(actionEv("//pkg:gen", "bazel-out/k8-fastbuild/bin/pkg/gen.txt", true, 0, ""))
	a.tool(completedEv("//pkg:gen", true, ""))
	// A failed action of a dependency that is not a target of the build.
	a.tool(actionEv("//dep:helper", "bazel-out/k8-fastbuild/bin/dep/helper.txt", false, 2, ""))
	a.tool(actionEv("//pkg:broken", "bazel-out/k8-fastbuild/bin/pkg/broken.txt", false, 1,
		"Executing genrule //pkg:broken failed: (Exit 1)"))
	a.tool(completedEv("//pkg:broken", false, ""))
	a.tool(completedEv("//pkg:pass_test", true, ""))
	a.tool(completedEv("//pkg:flaky_test", true, ""))
	a.tool(completedEv("//pkg:fail_test", true, ""))
	a.tool(testResultEv("//pkg:pass_test", 1, bep.TestStatus_PASSED, 40, true))
	a.tool(testSummaryEv("//pkg:pass_test", bep.TestStatus_PASSED, 1, 40))
	a.tool(testResultEv("//pkg:flaky_test", 1, bep.TestStatus_FAILED, 1200, false))
	a.tool(progressEv(3, "", "FAIL: //pkg:flaky_test (see .../test.log)\n"))
	a.tool(testResultEv("//pkg:flaky_test", 2, bep.TestStatus_PASSED, 1100, false))
	a.tool(testSummaryEv("//pkg:flaky_test", bep.TestStatus_FLAKY, 2, 2300))
	a.tool(testResultEv("//pkg:fail_test", 1, bep.TestStatus_FAILED, 70, false))
	// No summary for fail_test: its status comes from the last result.
	a.tool(finishedEv(1, "BUILD_FAILURE", s.advance(75*time.Second)))
	a.tool(simpleEv(&bep.BuildEventId{Id: &bep.BuildEventId_BuildToolLogs{}}))
	a.tool(metricsEv(9))
	// Bytes that are not UTF-8 reach PostgreSQL as valid text, output unchanged.
	a.seq++
	a.toolBytes(a.seq, rawEv(2, nil, 3, rawString(2, "ERROR: Build did NOT complete successfully\x00 \xff\n")))
	a.finishStream()
	a.attemptFinished(buildpb.BuildStatus_COMMAND_FAILED)
	a.buildFinished(buildpb.BuildStatus_COMMAND_FAILED)

	// B: goes quiet and is abandoned by the sweep (between the two halves
	// of the scenario), then finishes late. It starts in the same hour as A.
	b := s.invocation("acme", "inv-b")
	b.attemptStarted()
	b.tool(startedEv("inv-b", s.advance(10*time.Second)))
	b.tool(progressEv(1, "", "building b\n"))
	b.tool(configuredEv("//b:lib", "genrule rule"))

	// C: Bazel crashed: the attempt finished, no BuildFinished ever came.
	c := s.invocation("beta", "inv-c")
	c.attemptStarted()
	c.tool(startedEv("inv-c", s.advance(10*time.Second)))
	c.tool(progressEv(1, "", "about to crash\n"))
	s.advance(4 * time.Second)
	c.attemptFinished(buildpb.BuildStatus_USER_ERROR)

	// D: a resend beyond JetStream's duplicate window: sequences 2-3 again.
	d := s.invocation("beta", "inv-d")
	d.tool(startedEv("inv-d", s.advance(10*time.Second)))
	d.tool(progressEv(1, "", "d: first\n"))
	d.tool(progressEv(2, "", "d: second\n"))
	d.toolAt(2, progressEv(1, "", "d: first\n"))
	d.toolAt(3, progressEv(2, "", "d: second\n"))
	d.tool(finishedEv(0, "SUCCESS", s.advance(10*time.Second)))
	d.tool(newerMetricsEv())
	d.finishStream()

	return s, []invKey{{"acme", "inv-a"}, {"acme", "inv-b"}, {"beta", "inv-c"}, {"beta", "inv-d"}}
}

// lateB is inv-b's second half, after the sweep abandoned it.
func lateB(s *stream) {
	b := s.invocation("acme", "inv-b")
	b.seq = 3
	b.tool(progressEv(2, "", "b: back again\n"))
	b.tool(completedEv("//b:lib", true, ""))
	b.tool(finishedEv(0, "SUCCESS", s.advance(time.Minute)))
	b.finishStream()
	b.attemptFinished(buildpb.BuildStatus_COMMAND_SUCCEEDED)
}

func TestScenarioGolden(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := newProjector(t, Config{})
	var first map[string]string
	var firstSwept []byte
	for _, n := range []int{1000, 1, 3, 7} {
		t.Run(fmt.Sprintf("batch%d", n), func(t *testing.T) {
			truncate(t, pool)
			s, ids := scenario()
			applyAll(t, pool, p, s.msgs, n)
			swept := s.now.Add(31 * time.Minute)
			sweep(t, pool, p, swept)
			afterSweep := dump(t, pool, ids...)
			mark := len(s.msgs)
			s.now = swept.Add(time.Minute)
			lateB(s)
			applyAll(t, pool, p, s.msgs[mark:], n)
			got := dump(t, pool, ids...)
			d := digest(t, pool)
			if first == nil {
				first, firstSwept = d, afterSweep
				golden(t, "scenario_swept.golden", afterSweep)
				golden(t, "scenario.golden", got)
				return
			}
			if !maps.Equal(first, d) {
				t.Errorf("digest with batches of %d differs from batches of 1000:\n%v\n%v", n, d, first)
			}
			if !bytes.Equal(afterSweep, firstSwept) {
				t.Errorf("state after sweep with batches of %d differs:\n%s", n, afterSweep)
			}
		})
	}
}

// interleave merges several invocations' messages round-robin, k messages
// at a time, renumbering stream sequences and times as one stream would.
func interleave(start time.Time, k int, parts ...[]*msg) []*msg {
	var out []*msg
	s := newStream(start)
	for left := true; left; {
		left = false
		for i := range parts {
			n := min(k, len(parts[i]))
			for _, m := range parts[i][:n] {
				c := *m
				out = append(out, s.add(&c))
			}
			parts[i] = parts[i][n:]
			left = left || len(parts[i]) > 0
		}
	}
	return out
}

// concurrentBuilds is a stream of several builds running at once, one of
// them never finishing, ending with a few late resends.
func concurrentBuilds() []*msg {
	var parts [][]*msg
	for i, n := range []int{50, 20, 35, 8} {
		s := newStream(t0)
		synthBuild(s, []string{"acme", "beta"}[i%2], fmt.Sprintf("inv-%d", i), n, i != 3)
		parts = append(parts, s.msgs)
	}
	msgs := interleave(t0, 5, parts...)
	// Resends beyond the duplicate window: the same BES events again.
	for _, m := range msgs[40:60] {
		c := *m
		msgs = append(msgs, &c)
	}
	for i, m := range msgs {
		m.seq = uint64(i + 1)
	}
	return msgs
}

func TestBatchBoundariesAndRedelivery(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := newProjector(t, Config{})
	msgs := concurrentBuilds()
	var want map[string]string
	for _, n := range []int{1000, 1, 7, 64} {
		truncate(t, pool)
		applyAll(t, pool, p, msgs, n)
		got := digest(t, pool)
		if want == nil {
			want = got
			golden(t, "concurrent.golden", dump(t, pool, invKey{"acme", "inv-0"}, invKey{"beta", "inv-1"}, invKey{"acme", "inv-2"}, invKey{"beta", "inv-3"}))
		} else if !maps.Equal(want, got) {
			t.Errorf("batches of %d: digest differs from batches of 1000\n got %v\nwant %v", n, got, want)
		}

		// Redelivery: every batch again, each in a new transaction, as after
		// a crash between commit and ack (the runner would skip them by
		// position; the per-invocation sequence guard must hold anyway).
		applyAll(t, pool, p, msgs, n)
		if again := digest(t, pool); !maps.Equal(want, again) {
			t.Errorf("batches of %d applied twice: digest changed\n got %v\nwant %v", n, again, want)
		}
	}
	var chunks int
	if err := pool.QueryRow(context.Background(), `select count(*) from build_output_chunks where invocation_id <> 'inv-3'`).Scan(&chunks); err != nil {
		t.Fatal(err)
	}
	if chunks != 0 {
		t.Errorf("%d output chunks left behind by finished invocations", chunks)
	}
}

func TestRollupsCountedOnce(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{AbandonAfter: 10 * time.Minute})
	s := newStream(t0)
	b := synthBuild(s, "acme", "inv-x", 30, false)
	applyAll(t, pool, p, s.msgs, 50)

	rollup := func() (builds, ok, failed, abandoned int64) {
		t.Helper()
		err := pool.QueryRow(ctx, `select coalesce(sum(builds), 0), coalesce(sum(succeeded), 0), coalesce(sum(failed), 0),
			coalesce(sum(abandoned), 0) from hourly_rollups where project = 'acme'`).Scan(&builds, &ok, &failed, &abandoned)
		if err != nil {
			t.Fatal(err)
		}
		return
	}
	if n, _, _, _ := rollup(); n != 0 {
		t.Fatalf("a running build is counted: %d", n)
	}
	// Not yet idle long enough, then idle: abandoned once, however often
	// the sweep runs.
	sweep(t, pool, p, s.now.Add(9*time.Minute))
	if n, _, _, _ := rollup(); n != 0 {
		t.Fatalf("swept too early: %d builds", n)
	}
	for range 3 {
		sweep(t, pool, p, s.now.Add(11*time.Minute))
	}
	if n, ok, failed, ab := rollup(); n != 1 || ab != 1 || ok != 0 || failed != 0 {
		t.Fatalf("after sweep: builds %d succeeded %d failed %d abandoned %d, want 1 0 0 1", n, ok, failed, ab)
	}
	bld, err := Show(ctx, pool, "acme", "inv-x")
	if err != nil {
		t.Fatal(err)
	}
	if bld.Status != "abandoned" || bld.FinishedAt == nil {
		t.Fatalf("abandoned build: %+v", bld)
	}
	// Its output was folded into the canonical row.
	stdout, stderr, err := Output(ctx, pool, "acme", "inv-x")
	if err != nil || len(stderr) == 0 {
		t.Fatalf("output of abandoned build: %d %d %v", len(stdout), len(stderr), err)
	}

	// Late: the build finishes after all. The count moves.
	mark := len(s.msgs)
	s.advance(20 * time.Minute)
	b.tool(finishedEv(3, "TESTS_FAILED", s.now))
	b.tool(progressEv(99, "", "INFO: late\n"))
	b.finishStream()
	late := s.msgs[mark:]
	applyAll(t, pool, p, late, 1)
	if n, ok, failed, ab := rollup(); n != 1 || ab != 0 || ok != 0 || failed != 1 {
		t.Fatalf("after late finish: builds %d succeeded %d failed %d abandoned %d, want 1 0 1 0", n, ok, failed, ab)
	}
	// Redelivered, and swept again: still counted once.
	applyAll(t, pool, p, late, 10)
	sweep(t, pool, p, s.now.Add(time.Hour))
	if n, ok, failed, ab := rollup(); n != 1 || ab != 0 || ok != 0 || failed != 1 {
		t.Fatalf("after redelivery: builds %d succeeded %d failed %d abandoned %d, want 1 0 1 0", n, ok, failed, ab)
	}
	_, stderr2, err := Output(ctx, pool, "acme", "inv-x")
	if err != nil || !bytes.Equal(stderr2, append(stderr, "INFO: late\n"...)) {
		t.Fatalf("output after late events: %q (err %v)", tail(stderr2, 40), err)
	}
	bld, _ = Show(ctx, pool, "acme", "inv-x")
	if bld.Status != "failed" || *bld.ExitCode != 3 || *bld.ExitCodeName != "TESTS_FAILED" {
		t.Fatalf("late-finished build: %+v", bld)
	}
}

func TestPoison(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	synthBuild(s, "acme", "inv-p", 5, true)
	good := s.msgs

	bad := func(name string, mutate func(m *msg)) {
		t.Run(name, func(t *testing.T) {
			truncate(t, pool)
			msgs := make([]projection.Message, len(good))
			for i, m := range good {
				c := *m
				c.hdr = maps.Clone(m.hdr)
				msgs[i] = &c
			}
			victim := msgs[7].(*msg)
			mutate(victim)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.Apply(ctx, tx, msgs) })
			pe, ok := projection.AsPoison(err)
			if !ok {
				t.Fatalf("Apply = %v, want a PoisonError", err)
			}
			if pe.Seq != victim.seq {
				t.Fatalf("poison seq %d, want %d (%v)", pe.Seq, victim.seq, err)
			}
			// The runner retries without it: everything else applies.
			rest := slices.Delete(slices.Clone(msgs), 7, 8)
			if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.Apply(ctx, tx, rest) }); err != nil {
				t.Fatalf("batch without the poison message: %v", err)
			}
			if _, err := Show(ctx, pool, "acme", "inv-p"); err != nil {
				t.Fatal(err)
			}
		})
	}
	bad("truncated protobuf", func(m *msg) { m.data = m.data[:len(m.data)-3] })
	bad("garbage", func(m *msg) { m.data = []byte{0xff, 0xff, 0xff, 0xff} })
	bad("unknown schema", func(m *msg) { m.hdr[envelope.Schema] = "bes.v9" })
	bad("unknown kind", func(m *msg) { m.hdr[envelope.Kind] = "console" })
	bad("no event", func(m *msg) { m.data = nil })
	bad("invocation mismatch", func(m *msg) { m.hdr[envelope.InvocationID] = "someone-else" })
	bad("corrupt BuildEvent", func(m *msg) {
		// Keep the envelope intact, break the Any's value: a BuildEvent whose
		// id field claims more bytes than there are.
		b := newStream(t0).invocation("acme", "inv-p")
		value := []byte{0x0a, 0x7f, 0x01}
		*m = *b.toolBytes(8, value)
		m.seq = good[7].seq
	})
	bad("lifecycle holding a tool event", func(m *msg) { m.hdr[envelope.Kind] = envelope.KindLifecycle })

	if _, err := Show(ctx, pool, "acme", "nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Show of an unknown id: %v, want ErrNotFound", err)
	}
	if _, _, err := Output(ctx, pool, "acme", "nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Output of an unknown id: %v, want ErrNotFound", err)
	}
}

// TestSweepFoldsIdleOutput: a build whose tool stream never reported its
// end (Bazel killed after BuildFinished) has its output folded by the sweep.
func TestSweepFoldsIdleOutput(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	b := synthBuild(s, "acme", "inv-k", 10, false)
	b.tool(finishedEv(0, "SUCCESS", s.now))
	b.tool(progressEv(77, "", "INFO: Build completed successfully\n"))
	applyAll(t, pool, p, s.msgs, 7)
	_, before, err := Output(ctx, pool, "acme", "inv-k")
	if err != nil {
		t.Fatal(err)
	}
	var chunks int
	pool.QueryRow(ctx, `select count(*) from build_output_chunks`).Scan(&chunks)
	if chunks == 0 {
		t.Fatal("expected output chunks while the stream is open")
	}
	sweep(t, pool, p, s.now.Add(DefaultAbandonAfter+time.Second))
	pool.QueryRow(ctx, `select count(*) from build_output_chunks`).Scan(&chunks)
	_, after, err := Output(ctx, pool, "acme", "inv-k")
	if err != nil || chunks != 0 || !bytes.Equal(before, after) {
		t.Fatalf("after sweep: %d chunks, output equal %v, err %v", chunks, bytes.Equal(before, after), err)
	}
	if bld, _ := Show(ctx, pool, "acme", "inv-k"); bld.Status != "succeeded" {
		t.Fatalf("status %s, want succeeded", bld.Status)
	}
}

func TestResetEmptiesEveryTable(t *testing.T) {
	// Every table of the projection with rows per build is one that a
	// reset empties (or keeps per build); the rollups (hourly_rollups,
	// test_daily) and the argument arrays that builds share are the
	// others.
	for _, table := range DigestTables {
		if _, ok := rowTables[table]; !ok && !slices.Contains([]string{"hourly_rollups", "build_argv", "test_daily"}, table) {
			t.Errorf("%s is in DigestTables but not in rowTables: a reset would keep its rows", table)
		}
	}
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, "insert into invocations (id, project, first_event_at, last_event_at) values ('x', 'p', now(), now())"); err != nil {
		t.Fatal(err)
	}
	tx, err := pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := newProjector(t, Config{}).Reset(ctx, tx); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	for _, table := range append(DigestTables, "build_output_chunks") {
		var n int
		if err := pool.QueryRow(ctx, "select count(*) from "+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("%s has %d rows after Reset", table, n)
		}
	}
}

// TestEventBucket: invocations.last_event_bucket, which the sweep's index
// holds, is last_event_at rounded down to 5 minutes after every batch,
// whichever statement wrote the row (the projector sets it: migration 011).
func TestEventBucket(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := newProjector(t, Config{})
	s := newStream(t0)
	b := s.invocation("acme", "inv-slow")
	b.enqueued()
	b.attemptStarted()
	b.tool(startedEv("inv-slow", s.now))
	for i := range int32(4) {
		s.advance(4 * time.Minute)
		b.tool(progressEv(i+1, "", "still going\n"))
		b.tool(configuredEv(fmt.Sprintf("//pkg:t%d", i), "genrule rule"))
	}
	s.advance(6 * time.Minute)
	b.tool(finishedEv(0, "SUCCESS", s.now))
	b.finishStream()
	ctx := context.Background()
	for _, n := range []int{1, 2, 1000} {
		truncate(t, pool)
		p.Aborted()
		for i := 0; i < len(s.msgs); i += n {
			applyAll(t, pool, p, s.msgs[i:min(i+n, len(s.msgs))], n)
			var wrong int
			err := pool.QueryRow(ctx, `select count(*) from invocations
				where last_event_bucket is distinct from date_bin('5 minutes', last_event_at, timestamptz '2000-01-01 00:00:00+00')`).Scan(&wrong)
			if err != nil {
				t.Fatal(err)
			}
			if wrong != 0 {
				t.Fatalf("batches of %d: after message %d, %d invocations have a last_event_bucket other than their last_event_at's", n, i, wrong)
			}
		}
	}
}
