package builds

import (
	"context"
	"fmt"
	"strconv"
	"testing"
	"time"

	"github.com/millrace/millrace/schemas/bep"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"

	"github.com/millrace/millrace/internal/testenv"
)

// testBuild adds a finished build of project at commit whose tests end as
// given (label: status).
func testBuild(s *stream, project, inv, commit string, tests map[string]bep.TestStatus) {
	b := s.invocation(project, inv)
	b.enqueued()
	b.attemptStarted()
	b.tool(startedEv(inv, s.now))
	b.tool(buildMetadataEv(map[string]string{"COMMIT_SHA": commit}))
	exit, name := int32(0), "SUCCESS"
	for label, st := range tests {
		b.tool(configuredEv(label, "sh_test rule"))
		b.tool(completedEv(label, true, ""))
		runs := int32(1)
		if st == bep.TestStatus_FLAKY {
			b.tool(testResultEv(label, 1, bep.TestStatus_FAILED, 100, false))
			b.tool(testResultEv(label, 2, bep.TestStatus_PASSED, 100, false))
			runs = 2
		} else {
			b.tool(testResultEv(label, 1, st, 100, false))
		}
		if st == bep.TestStatus_FAILED {
			exit, name = 3, "TESTS_FAILED"
		}
		b.tool(testSummaryEv(label, st, runs, 100*int64(runs)))
	}
	b.tool(finishedEv(exit, name, s.now.Add(time.Second)))
	b.finishStream()
	b.attemptFinished(buildpb.BuildStatus_COMMAND_SUCCEEDED)
	b.buildFinished(buildpb.BuildStatus_COMMAND_SUCCEEDED)
	s.advance(time.Minute)
}

// A test's runs across builds and its counts: a FLAKY run, and a failed
// run whose commit another build passed (flaked, whichever came first),
// counted the same whatever the batches; the history newest first with
// its last failure; the project's flaky tests; another project's runs of
// the same label apart; a deletion taken back.
func TestTestHistory(t *testing.T) {
	s := newStream(t0)
	const x, y = "//t:x", "//t:y"
	testBuild(s, "acme", "a1", "c1", map[string]bep.TestStatus{x: bep.TestStatus_FAILED, y: bep.TestStatus_PASSED})
	testBuild(s, "acme", "a2", "c2", map[string]bep.TestStatus{x: bep.TestStatus_FLAKY, y: bep.TestStatus_PASSED})
	testBuild(s, "acme", "a3", "c1", map[string]bep.TestStatus{x: bep.TestStatus_PASSED, y: bep.TestStatus_PASSED})
	// Another project, the same label and commit: not acme's history.
	testBuild(s, "beta", "b1", "c1", map[string]bep.TestStatus{x: bep.TestStatus_PASSED})

	ctx := context.Background()
	var digests []map[string]string
	for _, n := range []int{1, 7, 1000} {
		t.Run(fmt.Sprintf("batches of %d", n), func(t *testing.T) {
			pool, _ := testenv.Pool(t)
			p := newProjector(t, Config{})
			applyAll(t, pool, p, s.msgs, n)
			d := digest(t, pool)
			digests = append(digests, map[string]string{"tests": d["tests"], "test_daily": d["test_daily"]})

			now := s.now
			h, err := ReadTestHistory(ctx, pool, HistoryQuery{Project: "acme", Label: x, Now: now})
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, r := range h.Runs {
				got = append(got, fmt.Sprintf("%s %s %v", r.Build, r.Status, r.Flaked))
			}
			if want := []string{"a3 PASSED false", "a2 FLAKY false", "a1 FAILED true"}; fmt.Sprint(got) != fmt.Sprint(want) {
				t.Errorf("history %v, want %v", got, want)
			}
			st := h.Stats
			if st.Runs != 3 || st.Passed != 1 || st.Failed != 1 || st.Flaky != 1 || st.CommitFlakes != 1 || st.FlakeRate < 0.66 || st.FlakeRate > 0.67 {
				t.Errorf("stats %+v", st)
			}
			if h.LastFailure == nil || h.LastFailure.Build != "a1" {
				t.Errorf("last failure %+v, want a1", h.LastFailure)
			}
			// Paged: one run a page, the cursor to the next.
			page, err := ReadTestHistory(ctx, pool, HistoryQuery{Project: "acme", Label: x, Limit: 1, Now: now})
			if err != nil || len(page.Runs) != 1 || page.Next == "" {
				t.Fatalf("first page %+v %v", page, err)
			}
			page, err = ReadTestHistory(ctx, pool, HistoryQuery{Project: "acme", Label: x, Limit: 1, Before: page.Next, Now: now})
			if err != nil || len(page.Runs) != 1 || page.Runs[0].Build != "a2" {
				t.Errorf("second page %+v %v", page, err)
			}
			if b, _ := ReadTestHistory(ctx, pool, HistoryQuery{Project: "beta", Label: x, Now: now}); len(b.Runs) != 1 || b.Stats.CommitFlakes != 0 {
				t.Errorf("beta's history %+v", b)
			}
			if _, err := ReadTestHistory(ctx, pool, HistoryQuery{Project: "acme", Label: "//t:none", Now: now}); err != ErrNotFound {
				t.Errorf("an unknown test: %v", err)
			}

			flaky, err := FlakyTests(ctx, pool, FlakyQuery{Project: "acme", Now: now})
			if err != nil || len(flaky) != 1 || flaky[0].Label != x || flaky[0].Stats.Runs != 3 {
				t.Errorf("acme's flaky tests %+v %v", flaky, err)
			}
			if flaky, _ := FlakyTests(ctx, pool, FlakyQuery{Project: "beta", Now: now}); len(flaky) != 0 {
				t.Errorf("beta's flaky tests %+v", flaky)
			}

			// Deleting a build takes its runs away from the counts.
			tx, err := pool.Begin(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := DeleteBuilds(ctx, tx, "acme", []string{"a2"}); err != nil {
				t.Fatal(err)
			}
			if err := tx.Commit(ctx); err != nil {
				t.Fatal(err)
			}
			h, _ = ReadTestHistory(ctx, pool, HistoryQuery{Project: "acme", Label: x, Now: now})
			if len(h.Runs) != 2 || h.Stats.Runs != 2 || h.Stats.Flaky != 0 || h.Stats.CommitFlakes != 1 {
				t.Errorf("after deleting a2: %d runs, stats %+v", len(h.Runs), h.Stats)
			}
		})
	}
	for i := 1; i < len(digests); i++ {
		if fmt.Sprint(digests[i]) != fmt.Sprint(digests[0]) {
			t.Errorf("batches change the counts: %v vs %v", digests[i], digests[0])
		}
	}
}

// BenchmarkTestHistory: a project of 20,000 builds over 140 days, 10,000
// of them `bazel test` runs of 20 tests (200,000 rows of tests: //t:x
// runs in each, //t:rare in one in 50, //t:f0 to //t:f17 flake now and
// then); a page of a test's history and the flaky tests of 30 days.
// go test ./projectors/builds -run '^$' -bench TestHistory -benchtime 20x
func BenchmarkTestHistory(b *testing.B) {
	pool, _ := testenv.Pool(b)
	ctx := context.Background()
	for _, sql := range []string{
		`insert into invocations (id, project, status, command, first_event_at, last_event_at, started_at, build_key)
		 select 'inv-' || n, 'acme', 'succeeded', case when n % 2 = 0 then 'test' else 'build' end, at, at, at,
		        (floor(extract(epoch from at) / 86400)::bigint << 47) | n
		 from generate_series(1, 20000) n, lateral (select timestamptz '2026-06-01' + n * interval '10 minutes' as at) t`,
		`select build_partitions_for(w) from (select distinct ((build_key >> 47) / 7)::int4 as w from invocations) x`,
		`insert into build_labels (project, id, label)
		 select 'acme', build_label_id(l), l from (select '//t:x' union all select '//t:rare' union all select '//t:f' || k from generate_series(0, 17) k) v(l)`,
		`insert into tests (build_key, label_id, status, attempts, duration_ms, has_summary)
		 select i.build_key, build_label_id(l.label),
		        case when l.label like '//t:f%' and (i.build_key & 65535) % 97 = 0 then 'FLAKY'
		             when (i.build_key & 65535) % 331 = 0 then 'FAILED' else 'PASSED' end, 1, 1000, true
		 from invocations i cross join build_labels l
		 where i.command = 'test' and (l.label <> '//t:rare' or (i.build_key & 65535) % 50 = 0)`,
		sqlIntoDaily + `
		 select 'acme', label_id, ` + fmt.Sprintf(sqlDay, "build_key") + `, count(*), count(*) filter (where status = 'PASSED'),
		        count(*) filter (where status = 'FAILED'), count(*) filter (where status = 'FLAKY'), 0, sum(duration_ms)
		 from tests group by 1, 2, 3` + sqlAddDaily,
		`vacuum analyze invocations, tests, test_daily, build_labels`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			b.Fatal(err)
		}
	}
	now := time.Date(2026, 10, 18, 0, 0, 0, 0, time.UTC)
	first, err := ReadTestHistory(ctx, pool, HistoryQuery{Project: "acme", Label: "//t:x", Now: now})
	if err != nil || len(first.Runs) != DefaultHistoryRows || first.LastFailure == nil {
		b.Fatalf("history: %d runs, last failure %v, %v", len(first.Runs), first.LastFailure, err)
	}
	for _, c := range []struct {
		name string
		q    HistoryQuery
	}{
		{"a test of every build, first page", HistoryQuery{Project: "acme", Label: "//t:x", Now: now}},
		{"a test of every build, an old page", HistoryQuery{Project: "acme", Label: "//t:x", Now: now, Before: strconv.FormatInt(buildKey(time.Date(2026, 7, 1, 0, 0, 0, 0, time.UTC), 0), 10)}},
		{"a test of one build in 50", HistoryQuery{Project: "acme", Label: "//t:rare", Now: now}},
	} {
		b.Run("history/"+c.name, func(b *testing.B) {
			for range b.N {
				if _, err := ReadTestHistory(ctx, pool, c.q); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
	b.Run("flaky tests, 30 days", func(b *testing.B) {
		for range b.N {
			if f, err := FlakyTests(ctx, pool, FlakyQuery{Project: "acme", Now: now}); err != nil || len(f) == 0 {
				b.Fatalf("%d flaky tests, %v", len(f), err)
			}
		}
	})
}
