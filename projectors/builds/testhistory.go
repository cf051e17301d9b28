package builds

import (
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
)

// Tests across builds (migrations/023_builds_test_history.sql). A test's
// history is read from its rows of tests (testreads.go); test_daily holds
// what the finished builds' rows count per project, test and day, and
// tests.flaked marks the failed runs whose commit passed the test in
// another build. test_daily is what the rows of tests (the finished
// builds') count, plus what rows gone by retention counted:
//   - rows entering tests add theirs: the move of a finishing build's rows
//     (queueFinish, whole builds) and the rows COPYed straight into a
//     finished build (queue, by key and label);
//   - a finished build's row updated in place is taken away before its
//     update and added after;
//   - then flagCommits marks the failed runs of the commits of those
//     builds that a passed run of the same commit makes flakes, and adds
//     them: which runs are flaked depends on the rows there, not on the
//     order builds finished in, so a replay in any batches gives the same;
//   - a deletion on request takes a build's rows away (DeleteBuilds), a
//     replay's reset the emptied builds' (sqlUncountTests); the
//     retention's deletes do not: test_daily is a rollup.

// failedStatus is the SQL condition of a run that failed (a test_daily
// "failed"): not passed, flaky or without a status, as hourly_rollups and
// Search count them. The first term lets a query use the partial index
// of the statuses but PASSED (tests_p_status_idx).
const failedStatus = `<> 'PASSED' and %[1]s.status not in ('FLAKY', 'NO_STATUS')`

// sqlDay is the day of a build key (its high bits, partitions.go).
const sqlDay = `date '1970-01-01' + (%s >> 47)::int`

// sqlCountRows adds to test_daily $4 (1 or -1) times what the tests rows
// of the builds $1 (whole) and of the pairs ($2 build keys, $3 label ids)
// count.
var sqlCountRows = `
with r as (
    select t.build_key, t.label_id, t.status, t.duration_ms, t.flaked
    from tests t where t.build_key = any($1::int8[])
    union
    select t.build_key, t.label_id, t.status, t.duration_ms, t.flaked
    from unnest($2::int8[], $3::int8[]) as u(k, l) join tests t on t.build_key = u.k and t.label_id = u.l
)
` + sqlIntoDaily + `
select i.project, r.label_id, ` + fmt.Sprintf(sqlDay, "r.build_key") + `, $4::int * count(*),
       $4::int * count(*) filter (where r.status = 'PASSED'),
       $4::int * count(*) filter (where r.status ` + fmt.Sprintf(failedStatus, "r") + `),
       $4::int * count(*) filter (where r.status = 'FLAKY'),
       $4::int * count(*) filter (where r.flaked), $4::int * sum(r.duration_ms)
from r join invocations i on i.build_key = r.build_key
group by 1, 2, 3 order by 1, 2, 3` + sqlAddDaily

// sqlFlagCommits marks flaked the failed runs in finished builds of the
// commits (values of $2's keys, the first found of each build) of the
// builds $1 whose test has a passed run in another finished build of the
// same commit and project, and adds them to test_daily's commit_flakes.
var sqlFlagCommits = `
with c as (
    select distinct i.project, cm.value
    from unnest($1::int8[]) as k(key) join invocations i on i.build_key = k.key
    cross join lateral (select m.value from build_metadata m where m.build_key = i.build_key and m.key = any($2)
                        order by array_position($2, m.key), m.source limit 1) cm
), sib as (
    select distinct c.project, c.value, m.build_key
    from c join build_metadata m on m.key = any($2) and m.value = c.value and m.project = c.project
), f as (
    update tests t set flaked = true
    from sib s
    where t.build_key = s.build_key and t.status ` + fmt.Sprintf(failedStatus, "t") + ` and not t.flaked
      and exists (select 1 from sib s2 join tests p on p.build_key = s2.build_key and p.label_id = t.label_id
                  where s2.project = s.project and s2.value = s.value and s2.build_key <> t.build_key
                    and p.status = 'PASSED')
    returning t.build_key, t.label_id
)
` + sqlIntoDaily + `
select i.project, f.label_id, ` + fmt.Sprintf(sqlDay, "f.build_key") + `, 0, 0, 0, 0, count(*), 0
from f join invocations i on i.build_key = f.build_key
group by 1, 2, 3 order by 1, 2, 3` + sqlAddDaily

// sqlForgetTests takes project's builds $2 out of test_daily (a deletion
// on request, as sqlForget does for hourly_rollups). Runs that a deleted
// build's passed run flaked stay flaked.
var sqlForgetTests = `
with r as (
    select t.build_key, t.label_id, t.status, t.duration_ms, t.flaked
    from invocations i join tests t on t.build_key = i.build_key
    where i.project = $1 and i.id = any($2)
)
` + sqlIntoDaily + `
select $1::text, r.label_id, ` + fmt.Sprintf(sqlDay, "r.build_key") + `, -count(*),
       -count(*) filter (where r.status = 'PASSED'),
       -count(*) filter (where r.status ` + fmt.Sprintf(failedStatus, "r") + `),
       -count(*) filter (where r.status = 'FLAKY'),
       -count(*) filter (where r.flaked), -sum(r.duration_ms)
from r group by 2, 3 order by 2, 3` + sqlAddDaily

// sqlUncountTests takes away from test_daily what the rows of tests of
// every build not in builds_keep count (a replay's reset: sqlUncount for
// the tests; the replay counts them again).
var sqlUncountTests = `
with r as (
    select i.project, t.build_key, t.label_id, t.status, t.duration_ms, t.flaked
    from tests t join invocations i on i.build_key = t.build_key
    where not exists (select 1 from builds_keep k where k.build_key = t.build_key)
)
` + sqlIntoDaily + `
select r.project, r.label_id, ` + fmt.Sprintf(sqlDay, "r.build_key") + `, -count(*),
       -count(*) filter (where r.status = 'PASSED'),
       -count(*) filter (where r.status ` + fmt.Sprintf(failedStatus, "r") + `),
       -count(*) filter (where r.status = 'FLAKY'),
       -count(*) filter (where r.flaked), -sum(r.duration_ms)
from r group by 1, 2, 3 order by 1, 2, 3` + sqlAddDaily

// sqlIntoDaily and sqlAddDaily wrap a select of test_daily's columns
// (project, label, day, then the counts to add, negative to take away)
// into the upsert that adds them.
const (
	sqlIntoDaily = `insert into test_daily as d (project, label_id, day, runs, passed, failed, flaky, commit_flakes, duration_sum_ms)`
	sqlAddDaily  = `
on conflict (project, label_id, day) do update set
    runs            = d.runs + excluded.runs,
    passed          = d.passed + excluded.passed,
    failed          = d.failed + excluded.failed,
    flaky           = d.flaky + excluded.flaky,
    commit_flakes   = d.commit_flakes + excluded.commit_flakes,
    duration_sum_ms = d.duration_sum_ms + excluded.duration_sum_ms`
)

// pairsOutside returns the (key, label) pairs whose key is not in skip.
func pairsOutside(keys, labels []int64, skip []int64) (k, l []int64) {
	for i, key := range keys {
		if !slices.Contains(skip, key) {
			k, l = append(k, key), append(l, labels[i])
		}
	}
	return k, l
}

// queueFlags adds to b the flags of the commits of builds (sqlFlagCommits).
func queueFlags(b *pgx.Batch, builds ...[]int64) {
	var all []int64
	for _, bs := range builds {
		all = append(all, bs...)
	}
	if len(all) == 0 {
		return
	}
	slices.Sort(all)
	b.Queue(sqlFlagCommits, slices.Compact(all), commitKeys)
}
