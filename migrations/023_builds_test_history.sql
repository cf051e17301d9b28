-- Tests across builds (projectors/builds, testhistory.go): the console's
-- history of a test, its flake rate, and a project's flaky tests, read
-- from what the projector keeps rather than aggregated over every row.
--
-- A test's history is its rows of tests, found build by build (newest
-- first on invocations_project_key_idx, each probed by the primary key):
-- no copy of them is kept. tests.flaked marks a failed run whose commit
-- has a passed run of the test in another finished build of the project:
-- a flake across builds (pass and fail on the same commit). A boolean
-- where the row had padding: it costs no space.
--
-- test_daily: per project, test and UTC day (of the build key: the day
-- of the build's first event), what the finished builds' tests rows of
-- that day count: runs, passed, failed (not PASSED, FLAKY or NO_STATUS, as
-- hourly_rollups counts), flaky (FLAKY), commit_flakes (runs flaked) and
-- the total duration. The projector keeps it as rows enter, change in or
-- leave tests; it is a rollup: it outlives the rows (the rollups'
-- retention takes it). The partial index has the days with a flake only,
-- for a project's flaky tests of a window.

alter table tests add column if not exists flaked boolean not null default false;
alter table tests_running add column if not exists flaked boolean not null default false;

create table if not exists test_daily (
    project         text not null,
    label_id        bigint not null,
    day             date not null,
    runs            int not null default 0,
    passed          int not null default 0,
    failed          int not null default 0,
    flaky           int not null default 0,
    commit_flakes   int not null default 0,
    duration_sum_ms bigint not null default 0,
    primary key (project, label_id, day)
);
create index if not exists test_daily_flaky_idx on test_daily (project, day, label_id) where flaky > 0 or commit_flakes > 0;

-- The finished builds already there: their flakes across builds, then
-- their counts.
with c as (
    select i.build_key, i.project,
           (select m.value from build_metadata m
            where m.build_key = i.build_key and m.key = any('{COMMIT_SHA,BUILD_SCM_REVISION,STABLE_GIT_COMMIT}')
            order by array_position('{COMMIT_SHA,BUILD_SCM_REVISION,STABLE_GIT_COMMIT}'::text[], m.key), m.source limit 1) as value
    from invocations i where i.status <> 'running'
)
update tests f set flaked = true from c
where f.build_key = c.build_key and c.value is not null
  and f.status <> 'PASSED' and f.status not in ('FLAKY', 'NO_STATUS')
  and exists (select 1 from c c2 join tests p on p.build_key = c2.build_key and p.label_id = f.label_id
              where c2.project = c.project and c2.value = c.value and c2.build_key <> c.build_key and p.status = 'PASSED');
insert into test_daily (project, label_id, day, runs, passed, failed, flaky, commit_flakes, duration_sum_ms)
select i.project, t.label_id, date '1970-01-01' + (t.build_key >> 47)::int, count(*),
       count(*) filter (where t.status = 'PASSED'),
       count(*) filter (where t.status not in ('PASSED', 'FLAKY', 'NO_STATUS')),
       count(*) filter (where t.status = 'FLAKY'),
       count(*) filter (where t.flaked), sum(t.duration_ms)
from tests t join invocations i on i.build_key = t.build_key
group by 1, 2, 3
on conflict do nothing;

---- create above / drop below ----

drop table if exists test_daily;
alter table tests_running drop column if exists flaked;
alter table tests drop column if exists flaked;
