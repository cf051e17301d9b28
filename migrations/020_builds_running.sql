-- The target and test rows of a running build live in targets_running and
-- tests_running; the projector moves them into targets and tests, sorted by
-- label id, in the batch that ends the build (or the sweep that abandons
-- it), and a finished build's rows are written there once
-- (projectors/builds/README.md, "Running builds").
--
-- Why: a build names its targets over minutes (TargetConfigured while it
-- analyses, TargetComplete as it executes), in batches that interleave
-- with the other builds running. Written in place, each row was inserted,
-- then updated, and the rows of builds running side by side took turns in
-- the same key range: the primary keys of targets and tests were half
-- full (every page split in the middle) and their heaps kept a fifth of
-- every page free for the updates (fillfactor 80). A finished build's rows
-- now go in as one sorted run at the end of the key range, where B-tree
-- pages fill to 90%, into heap pages filled to 100%; the running tables,
-- which keep room for the updates, stay as large as the builds running at
-- once.
--
-- Rows of running builds move in this migration, a few hundred a build:
-- stop the builds projector of the release before, as for 016.
-- all_targets and all_tests are what readers use: both tables, for one
-- build only one of them holds rows.

create table if not exists targets_running (like targets including all) with (fillfactor = 80);
create table if not exists tests_running (like tests including all) with (fillfactor = 80);

create or replace view all_targets as
    select build_key, label_id, failure_rank, success, failed, failure_reason, tags, kind_id from targets
    union all
    select build_key, label_id, failure_rank, success, failed, failure_reason, tags, kind_id from targets_running;

create or replace view all_tests as
    select build_key, label_id, duration_ms, attempts, run_count, shard_count, total_run_count, results,
           num_cached, has_summary, cached, status from tests
    union all
    select build_key, label_id, duration_ms, attempts, run_count, shard_count, total_run_count, results,
           num_cached, has_summary, cached, status from tests_running;

with moved as (
    delete from targets t using invocations i
    where i.status = 'running' and t.build_key = i.build_key
    returning t.build_key, t.label_id, t.failure_rank, t.success, t.failed, t.failure_reason, t.tags, t.kind_id
)
insert into targets_running (build_key, label_id, failure_rank, success, failed, failure_reason, tags, kind_id)
select * from moved;

with moved as (
    delete from tests t using invocations i
    where i.status = 'running' and t.build_key = i.build_key
    returning t.build_key, t.label_id, t.duration_ms, t.attempts, t.run_count, t.shard_count,
              t.total_run_count, t.results, t.num_cached, t.has_summary, t.status
)
insert into tests_running (build_key, label_id, duration_ms, attempts, run_count, shard_count,
    total_run_count, results, num_cached, has_summary, status)
select * from moved;

-- Partitions are written once a row: no room for updates any more.
create or replace function build_partitions_for(week int, suffix text default '') returns void
    language plpgsql as $$
declare
    t text;
    lo bigint := (week::bigint * 7) << 47;
    hi bigint := ((week::bigint + 1) * 7) << 47;
begin
    foreach t in array array['targets', 'tests', 'build_failures', 'target_causes'] loop
        if to_regclass(format('%s_w%s', t, week)) is not null then
            continue;
        end if;
        execute format('create table %I (like %I including all)', t || '_w' || week, t || suffix);
        execute format('alter table %I attach partition %I for values from (%s) to (%s)',
                       t || suffix, t || '_w' || week, lo, hi);
    end loop;
end $$;

-- Existing partitions fill their pages from now on (a catalog change;
-- pages already written keep their free space until reused).
do $$
declare
    p regclass;
begin
    for p in select c.oid::regclass from pg_inherits h join pg_class c on c.oid = h.inhrelid
             where h.inhparent in ('targets'::regclass, 'tests'::regclass) loop
        execute format('alter table %s reset (fillfactor)', p);
    end loop;
end $$;

---- create above / drop below ----

do $$
declare
    p regclass;
begin
    for p in select c.oid::regclass from pg_inherits h join pg_class c on c.oid = h.inhrelid
             where h.inhparent in ('targets'::regclass, 'tests'::regclass) loop
        execute format('alter table %s set (fillfactor = 80)', p);
    end loop;
end $$;

create or replace function build_partitions_for(week int, suffix text default '') returns void
    language plpgsql as $$
declare
    t text;
    lo bigint := (week::bigint * 7) << 47;
    hi bigint := ((week::bigint + 1) * 7) << 47;
begin
    foreach t in array array['targets', 'tests', 'build_failures', 'target_causes'] loop
        if to_regclass(format('%s_w%s', t, week)) is not null then
            continue;
        end if;
        execute format('create table %I (like %I including all)', t || '_w' || week, t || suffix);
        execute format('alter table %I attach partition %I for values from (%s) to (%s)',
                       t || suffix, t || '_w' || week, lo, hi);
        if t in ('targets', 'tests') then
            execute format('alter table %I set (fillfactor = 80)', t || '_w' || week);
        end if;
    end loop;
end $$;

insert into targets (build_key, label_id, failure_rank, success, failed, failure_reason, tags, kind_id)
select build_key, label_id, failure_rank, success, failed, failure_reason, tags, kind_id from targets_running;
insert into tests (build_key, label_id, duration_ms, attempts, run_count, shard_count, total_run_count,
    results, num_cached, has_summary, status)
select build_key, label_id, duration_ms, attempts, run_count, shard_count, total_run_count, results,
       num_cached, has_summary, status from tests_running;
drop view all_tests;
drop view all_targets;
drop table tests_running;
drop table targets_running;
