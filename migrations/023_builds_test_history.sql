-- Tests across builds (projectors/builds, testhistory.go): the console's
-- history of a test, its flake rate, and a project's flaky tests, read
-- from tables the projector keeps rather than from every row of tests.
--
-- test_runs: one row per run of a test in a finished build (a build's
-- tests rows once it is counted, as hourly_rollups counts it), keyed by
-- label so that a test's history is one range of the primary key, newest
-- first. day is the UTC day of the build's start; commit_id the hash
-- (build_label_id) of the build's commit, from the metadata keys Search
-- reads; flaked marks a failed run whose commit also has a passed run of
-- the test (a flake across builds: pass and fail on the same commit).
--
-- test_daily: per project, test and day, the runs and how they ended
-- (passed, failed: not PASSED, FLAKY or NO_STATUS; flaky: FLAKY), their
-- total duration, and commit_flakes: the day's flaked runs. Kept by deltas
-- of test_runs' changes, like hourly_rollups; the partial index serves a
-- project's flaky tests of a window without reading its other tests.

create table if not exists test_runs (
    label_id    bigint not null,
    build_key   bigint not null,
    day         date not null,
    status      text not null,
    attempts    int not null,
    duration_ms bigint not null,
    commit_id   bigint,
    flaked      boolean not null default false,
    primary key (label_id, build_key)
);
create index if not exists test_runs_commit_idx on test_runs (label_id, commit_id) where commit_id is not null;

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

-- The tests of the builds already finished.
insert into test_runs (label_id, build_key, day, status, attempts, duration_ms, commit_id)
select t.label_id, i.build_key, (coalesce(i.started_at, i.first_event_at) at time zone 'UTC')::date,
       t.status, t.attempts, t.duration_ms,
       (select build_label_id(m.value) from build_metadata m
        where m.build_key = i.build_key and m.key = any('{COMMIT_SHA,BUILD_SCM_REVISION,STABLE_GIT_COMMIT}')
        order by array_position('{COMMIT_SHA,BUILD_SCM_REVISION,STABLE_GIT_COMMIT}'::text[], m.key), m.source limit 1)
from invocations i join tests t on t.build_key = i.build_key
where i.counted_status is not null
on conflict do nothing;
update test_runs f set flaked = true
where f.commit_id is not null and f.status not in ('PASSED', 'FLAKY', 'NO_STATUS')
  and exists (select 1 from test_runs p where p.label_id = f.label_id and p.commit_id = f.commit_id and p.status = 'PASSED');
insert into test_daily (project, label_id, day, runs, passed, failed, flaky, commit_flakes, duration_sum_ms)
select i.project, r.label_id, r.day, count(*),
       count(*) filter (where r.status = 'PASSED'),
       count(*) filter (where r.status not in ('PASSED', 'FLAKY', 'NO_STATUS')),
       count(*) filter (where r.status = 'FLAKY'),
       count(*) filter (where r.flaked), sum(r.duration_ms)
from test_runs r join invocations i on i.build_key = r.build_key
group by 1, 2, 3
on conflict do nothing;

---- create above / drop below ----

drop table if exists test_daily;
drop table if exists test_runs;
