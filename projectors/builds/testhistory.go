package builds

// Tests across builds (migrations/023_builds_test_history.sql): test_runs
// holds each run of a test in a finished build, test_daily its counts per
// project, test and day. The projector keeps both in the batch that
// counts a build in hourly_rollups (sqlReconcile's builds), by one
// statement, sqlCountTests: a build's runs are what its tests rows are
// once it has finished; a change (a build cut off, then resumed, then
// finished) replaces them, and test_daily takes the difference. Reads are
// in testreads.go.

// failedStatus is the SQL condition of a run that failed (a test_daily
// "failed"): not passed, flaky or without a status, as hourly_rollups and
// Search count them.
const failedStatus = `not in ('PASSED', 'FLAKY', 'NO_STATUS')`

// sqlCountTests brings test_runs and test_daily in line with the builds
// ($1 projects, $2 ids; $3 the commit keys): the runs of those finished
// are their tests rows, those of a build running again have none. flaked
// marks a failed run whose commit has a passed run of the test in the
// same project: found for the batch's failed runs among the runs already
// there and the batch's, and set on earlier failed runs when the batch
// brings the passed one, so that which runs are flaked does not depend on
// the order builds were counted in (a replay finds the same).
var sqlCountTests = `
with b as (
    select i.build_key, i.project, i.status <> 'running' as done,
           (coalesce(i.started_at, i.first_event_at) at time zone 'UTC')::date as day,
           (select build_label_id(m.value) from build_metadata m
            where m.build_key = i.build_key and m.key = any($3)
            order by array_position($3, m.key), m.source limit 1) as commit_id
    from unnest($1::text[], $2::text[]) as u(project, id)
    join invocations i on i.id = u.id and i.project = u.project
), cur as (
    select t.label_id, b.build_key, b.project, b.day, t.status, t.attempts, t.duration_ms, b.commit_id
    from b join tests t on t.build_key = b.build_key
    where b.done
), old as (
    select r.label_id, r.build_key, b.project, r.day, r.status, r.attempts, r.duration_ms, r.commit_id, r.flaked
    from b join all_tests t on t.build_key = b.build_key
    join test_runs r on r.label_id = t.label_id and r.build_key = b.build_key
), changed as (
    select c.*, o.label_id is not null as had,
           c.status ` + failedStatus + ` and c.commit_id is not null and (
               exists (select 1 from test_runs p join invocations pi on pi.build_key = p.build_key
                       where p.label_id = c.label_id and p.commit_id = c.commit_id and p.status = 'PASSED'
                         and p.build_key <> c.build_key and pi.project = c.project)
            or exists (select 1 from cur p where p.label_id = c.label_id and p.commit_id = c.commit_id
                       and p.status = 'PASSED' and p.project = c.project)) as flaked
    from cur c left join old o on o.label_id = c.label_id and o.build_key = c.build_key
    where o.label_id is null
       or (o.day, o.status, o.attempts, o.duration_ms, o.commit_id) is distinct from (c.day, c.status, c.attempts, c.duration_ms, c.commit_id)
), dropped as (
    select o.* from old o
    where not exists (select 1 from cur c where c.label_id = o.label_id and c.build_key = o.build_key)
), put as (
    insert into test_runs as r (label_id, build_key, day, status, attempts, duration_ms, commit_id, flaked)
    select label_id, build_key, day, status, attempts, duration_ms, commit_id, flaked from changed
    on conflict (label_id, build_key) do update set
        day = excluded.day, status = excluded.status, attempts = excluded.attempts,
        duration_ms = excluded.duration_ms, commit_id = excluded.commit_id, flaked = excluded.flaked
), gone as (
    delete from test_runs r using dropped d where r.label_id = d.label_id and r.build_key = d.build_key
), flag as (
    update test_runs f set flaked = true
    from changed c, invocations fi
    where c.status = 'PASSED' and c.commit_id is not null
      and f.label_id = c.label_id and f.commit_id = c.commit_id and f.build_key <> c.build_key
      and f.status ` + failedStatus + ` and not f.flaked
      and fi.build_key = f.build_key and fi.project = c.project
      and not exists (select 1 from b where b.build_key = f.build_key)
    returning fi.project, f.label_id, f.day
), delta as (
    select o.project, o.label_id, o.day, -1 as sign, o.status, o.duration_ms, o.flaked
    from old o join changed c on c.label_id = o.label_id and c.build_key = o.build_key
    union all
    select project, label_id, day, -1, status, duration_ms, flaked from dropped
    union all
    select project, label_id, day, 1, status, duration_ms, flaked from changed
    union all -- a group for each day flag touched
    select distinct project, label_id, day, 0, 'FAILED', 0::bigint, false from flag
), flagged as (
    select project, label_id, day, count(*) as n from flag group by 1, 2, 3
)
` + sqlIntoDaily + `
select x.project, x.label_id, x.day, sum(sign),
       coalesce(sum(sign) filter (where status = 'PASSED'), 0),
       coalesce(sum(sign) filter (where status ` + failedStatus + `), 0),
       coalesce(sum(sign) filter (where status = 'FLAKY'), 0),
       coalesce(sum(sign) filter (where flaked), 0) + coalesce(max(f.n), 0),
       sum(sign * duration_ms)
from delta x left join flagged f on f.project = x.project and f.label_id = x.label_id and f.day = x.day
group by x.project, x.label_id, x.day
` + sqlAddDaily

// sqlDeleteTestRuns deletes the runs of project's builds $2, found by
// their tests rows' labels (test_runs has no index by build): before
// those rows go. What they counted in test_daily stays (the retention's
// deletes: test_daily is a rollup, with the rollups' retention).
const sqlDeleteTestRuns = `delete from test_runs r using invocations i, all_tests t
where i.project = $1 and i.id = any($2) and t.build_key = i.build_key
  and r.label_id = t.label_id and r.build_key = i.build_key`

// sqlUncountTests takes away from test_daily what the runs of every
// build not in builds_keep count there, and those runs (a replay's reset:
// sqlUncount for the tests; the replay counts them again).
const sqlUncountTests = `
with gone as (
    delete from test_runs r where not exists (select 1 from builds_keep k where k.build_key = r.build_key)
    returning r.build_key, r.label_id, r.day, r.status, r.duration_ms, r.flaked
)
` + sqlIntoDaily + `
select i.project, g.label_id, g.day, -count(*), -count(*) filter (where g.status = 'PASSED'),
       -count(*) filter (where g.status ` + failedStatus + `), -count(*) filter (where g.status = 'FLAKY'),
       -count(*) filter (where g.flaked), -sum(g.duration_ms)
from gone g join invocations i on i.build_key = g.build_key group by 1, 2, 3
` + sqlAddDaily

// sqlForgetTests takes project's builds $2 out of test_runs and what they
// count in test_daily (a deletion on request, as sqlForget does for
// hourly_rollups). Runs flaked by a passed run of a deleted build stay
// flaked.
const sqlForgetTests = `
with gone as (
    delete from test_runs r using invocations i, all_tests t
    where i.project = $1 and i.id = any($2) and t.build_key = i.build_key
      and r.label_id = t.label_id and r.build_key = i.build_key
    returning i.project, r.label_id, r.day, r.status, r.duration_ms, r.flaked
)
` + sqlIntoDaily + `
select project, label_id, day, -count(*), -count(*) filter (where status = 'PASSED'),
       -count(*) filter (where status ` + failedStatus + `), -count(*) filter (where status = 'FLAKY'),
       -count(*) filter (where flaked), -sum(duration_ms)
from gone group by 1, 2, 3
` + sqlAddDaily

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
