-- Compact build tables, partitioned by time (projectors/builds,
-- partitions.go; docs/design.md, "Storage").
--
-- Until 015 every row of targets, tests, build_failures and target_causes,
-- and every entry of their primary keys, began with the build's
-- (invocation_id, project): a random 36-byte id and the project, about 45
-- bytes, and random keys fill an index by page splits. A 50-target build
-- kept 34.5 KB in PostgreSQL, 18 KB of it in targets. From here on:
--
-- * A build has a build key, invocations.build_key, a bigint that grows
--   with time: the UTC day of the first message the projector applied for
--   the build (JetStream's storage time) in the high bits, that message's
--   BES stream sequence in the low 47 (projectors/builds, buildKey). It is
--   unique (one message belongs to one build) and a replay computes the
--   same key from the same message (the archive keeps stream sequences).
--   Rows that existed before this migration get the low bits 2^46 plus a
--   counter, above any stream sequence the edge will reach.
-- * The four tables are keyed by (build_key, ...) and range-partitioned by
--   build_key, one partition per 7 days (build_partitions_for creates
--   them; the projector makes the ones it needs, the retention the next
--   week's ahead, and drops a week whole past the longest retention).
--   Appending in key order fills index pages instead of splitting them.
-- * Targets and tests name their label by an id: the first 8 bytes of the
--   label's SHA-256 (build_label_id, the same in Go), with the text once
--   per project in build_labels. A hash, not a counter, so that the
--   projector computes it without a round trip and a replay finds the
--   same ids; two labels of one project with the same 64-bit prefix
--   (about one chance in 10^7 at a million labels) would share a row.
--
-- Online: invocations only gains a nullable column (no rewrite), filled in
-- batches of 5,000 rows, each its own transaction; the new tables are
-- filled in batches of 2,000 builds behind it, and swapped in by renames
-- at the end (each a catalog change, no scan). The builds projector of the
-- release before must be stopped before this runs (the BES stream keeps
-- what arrives meanwhile, and the projector catches up when it starts);
-- readers of the release before work until the swap. Measured time per
-- million target rows: see projectors/builds/README.md, "Upgrading".

---- tern: disable-tx ----

create or replace function build_label_id(label text) returns bigint
    language sql immutable parallel safe strict
    return ('x' || left(encode(sha256(convert_to(label, 'UTF8')), 'hex'), 16))::bit(64)::bigint;

create table if not exists build_labels (
    project text not null,
    id      bigint not null,  -- build_label_id(label)
    label   text not null,
    primary key (project, id)
);
-- Pages of a build's targets and tests in label order walk this index.
create unique index if not exists build_labels_label_idx on build_labels (project, label collate "C") include (id);

alter table invocations add column if not exists build_key bigint;
-- A row inserted without a key (by hand, or a tool) gets one of today in
-- the range of the keys given here (2^46 and above). A default on an
-- existing column rewrites nothing.
create sequence if not exists build_keys_unsequenced;
alter table invocations alter column build_key set default
    (floor(extract(epoch from now()) / 86400)::bigint << 47) | ((1::bigint << 46) + (1::bigint << 45) + nextval('build_keys_unsequenced'));

create table if not exists targets_p (
    build_key      bigint not null,
    label_id       bigint not null,
    failure_rank   smallint not null default 0,
    success        boolean,
    failed         boolean,
    kind           text,
    failure_reason text,
    tags           text[],
    primary key (build_key, label_id)
) partition by range (build_key);
create index if not exists targets_p_failed_idx on targets_p (build_key, label_id) where failed;

create table if not exists tests_p (
    build_key       bigint not null,
    label_id        bigint not null,
    duration_ms     bigint not null default 0,
    attempts        int not null default 0,
    run_count       int not null default 0,
    shard_count     int not null default 0,
    total_run_count int not null default 0,
    results         int not null default 0,
    num_cached      int not null default 0,
    has_summary     boolean not null,
    cached          boolean generated always as
                    (num_cached > 0 and num_cached >= case when has_summary
                                                          then greatest(total_run_count, 1)
                                                          else results end) stored,
    status          text not null,
    primary key (build_key, label_id)
) partition by range (build_key);
-- The tests of a build that did not pass, for pages of one status: 012's
-- tests_status_idx held every test, but a page of passed tests (nearly
-- all of a build's) is served best by walking the labels in order and
-- probing the primary key, and only the rare statuses need an index.
create index if not exists tests_p_status_idx on tests_p (build_key, status, label_id) where status <> 'PASSED';

-- A failure (a root cause) is named by an id too: build_failure_id of its
-- key (kind, label, primary output, configuration), so that the causes of
-- a failed target are three bigints a row instead of its key's text again
-- (a configuration is 64 hex digits, an output a path). A cause whose
-- event the build has not (yet) carried has a row of its key alone,
-- reported false, which the event's row replaces.
create or replace function build_failure_id(kind text, label text, primary_output text, configuration text)
    returns bigint language sql immutable parallel safe strict
    return build_label_id(kind || E'\x1f' || label || E'\x1f' || primary_output || E'\x1f' || configuration);

create table if not exists build_failures_p (
    build_key      bigint not null,
    id             bigint not null,           -- build_failure_id(kind, label, primary_output, configuration)
    reported       boolean not null,          -- false: named by a cause only, no event about it yet
    exit_code      int,
    kind           text not null check (kind in ('action', 'configured_label', 'unconfigured_label')),
    label          text not null,
    primary_output text not null,
    configuration  text not null,
    mnemonic       text,
    message        text,
    stderr_uri     text,
    stderr         text,
    stdout_uri     text,
    primary key (build_key, id)
) partition by range (build_key);

create table if not exists target_causes_p (
    build_key bigint not null,
    label_id  bigint not null,                -- the failed target
    cause_id  bigint not null,                -- its root cause's build_failures.id
    primary key (build_key, label_id, cause_id)
) partition by range (build_key);

-- build_partitions_for creates, if missing, the partitions of the four
-- tables that hold the builds keyed in the given 7-day week (days since
-- 1970-01-01 divided by 7), named <table>_w<week>. Each is made apart and
-- then attached: ATTACH PARTITION takes a SHARE UPDATE EXCLUSIVE lock on
-- the parent, so readers and writers of the other partitions go on (a
-- CREATE TABLE ... PARTITION OF would take an ACCESS EXCLUSIVE one).
-- suffix names the parents <table><suffix> (this migration fills them as
-- <table>_p before it swaps them in).
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
            -- Room for the update that completes a row on its own page (HOT).
            execute format('alter table %I set (fillfactor = 80)', t || '_w' || week);
        end if;
    end loop;
end $$;

-- Existing builds get their keys, 5,000 at a time, in their first events'
-- order.
create or replace procedure build_keys_backfill() language plpgsql as $$
declare
    n int;
    next bigint := 0;
begin
    loop
        with batch as (
            select id, project, row_number() over (order by first_event_at, id, project) as r,
                   floor(extract(epoch from first_event_at) / 86400)::bigint as day
            from invocations where build_key is null
            order by first_event_at, id, project limit 5000
        )
        update invocations i set build_key = (b.day << 47) | ((1::bigint << 46) + next + b.r)
        from batch b where i.id = b.id and i.project = b.project;
        get diagnostics n = row_count;
        commit;
        exit when n = 0;
        next := next + n;
    end loop;
end $$;
call build_keys_backfill();
drop procedure build_keys_backfill();

create unique index concurrently if not exists invocations_build_key_idx on invocations (build_key);

-- The partitions the existing builds need, then their rows, 2,000 builds
-- at a time in key order.
do $$
declare w int;
begin
    for w in select distinct (build_key >> 47) / 7 from invocations loop
        perform build_partitions_for(w, '_p');
    end loop;
end $$;

create or replace procedure build_tables_copy() language plpgsql as $$
declare
    lo bigint := -1;
    hi bigint;
begin
    loop
        select max(build_key) into hi from
            (select build_key from invocations where build_key > lo order by build_key limit 2000) b;
        exit when hi is null;
        insert into build_labels (project, id, label)
        select distinct i.project, build_label_id(x.label), x.label
        from invocations i
        cross join lateral (select label from targets t where t.invocation_id = i.id and t.project = i.project
                            union select label from tests t where t.invocation_id = i.id and t.project = i.project) x
        where i.build_key > lo and i.build_key <= hi
        on conflict do nothing;
        insert into targets_p (build_key, label_id, failure_rank, success, failed, kind, failure_reason, tags)
        select i.build_key, build_label_id(t.label), t.failure_rank, t.success, t.failed, t.kind, t.failure_reason,
               nullif(t.tags, '{}')
        from invocations i join targets t on t.invocation_id = i.id and t.project = i.project
        where i.build_key > lo and i.build_key <= hi;
        insert into tests_p (build_key, label_id, duration_ms, attempts, run_count, shard_count, total_run_count,
                             results, num_cached, has_summary, status)
        select i.build_key, build_label_id(t.label), t.duration_ms, t.attempts, t.run_count, t.shard_count,
               t.total_run_count, t.results, t.num_cached, t.has_summary, t.status
        from invocations i join tests t on t.invocation_id = i.id and t.project = i.project
        where i.build_key > lo and i.build_key <= hi;
        insert into build_failures_p (build_key, id, reported, exit_code, kind, label, primary_output, configuration,
                                      mnemonic, message, stderr_uri, stderr, stdout_uri)
        select i.build_key, build_failure_id(f.kind, f.label, f.primary_output, f.configuration), true, f.exit_code,
               f.kind, f.label, f.primary_output, f.configuration, f.mnemonic, f.message, f.stderr_uri, f.stderr, f.stdout_uri
        from invocations i join build_failures f on f.invocation_id = i.id and f.project = i.project
        where i.build_key > lo and i.build_key <= hi;
        insert into build_failures_p (build_key, id, reported, kind, label, primary_output, configuration)
        select distinct i.build_key, build_failure_id(c.cause_kind, c.cause_label, c.cause_output, c.cause_configuration),
               false, c.cause_kind, c.cause_label, c.cause_output, c.cause_configuration
        from invocations i join target_causes c on c.invocation_id = i.id and c.project = i.project
        where i.build_key > lo and i.build_key <= hi
        on conflict do nothing;
        insert into target_causes_p (build_key, label_id, cause_id)
        select i.build_key, build_label_id(c.label), build_failure_id(c.cause_kind, c.cause_label, c.cause_output, c.cause_configuration)
        from invocations i join target_causes c on c.invocation_id = i.id and c.project = i.project
        where i.build_key > lo and i.build_key <= hi
        on conflict do nothing;
        commit;
        lo := hi;
    end loop;
end $$;
call build_tables_copy();
drop procedure build_tables_copy();

-- The swap: one short transaction of renames.
begin;
alter table invocations add constraint invocations_build_key_check check (build_key is not null) not valid;
drop table targets, tests, build_failures, target_causes;
alter table targets_p rename to targets;
alter table tests_p rename to tests;
alter table build_failures_p rename to build_failures;
alter table target_causes_p rename to target_causes;
alter index targets_p_failed_idx rename to targets_failed_idx;
alter index tests_p_status_idx rename to tests_status_idx;
alter index targets_p_pkey rename to targets_pkey;
alter index tests_p_pkey rename to tests_pkey;
alter index build_failures_p_pkey rename to build_failures_pkey;
alter index target_causes_p_pkey rename to target_causes_pkey;
commit;
alter table invocations validate constraint invocations_build_key_check;

---- create above / drop below ----

---- tern: disable-tx ----

-- Back to the tables of 015, keyed by (invocation_id, project). The rows
-- are copied in one statement per table: a downgrade is for a database
-- that has not grown under this shape for long.
begin;
create table targets_v (
    invocation_id  text not null,
    label          text not null,
    kind           text,
    success        boolean,
    failure_reason text,
    failure_rank   smallint not null default 0,
    tags           text[],
    project        text not null,
    failed         boolean,
    primary key (invocation_id, project, label)
) with (fillfactor = 80);
insert into targets_v select i.id, l.label, t.kind, t.success, t.failure_reason, t.failure_rank, t.tags, i.project, t.failed
from targets t join invocations i on i.build_key = t.build_key join build_labels l on l.project = i.project and l.id = t.label_id;
create table tests_v (
    invocation_id   text not null,
    label           text not null,
    status          text not null,
    has_summary     boolean not null,
    attempts        int not null default 0,
    run_count       int not null default 0,
    shard_count     int not null default 0,
    total_run_count int not null default 0,
    results         int not null default 0,
    duration_ms     bigint not null default 0,
    num_cached      int not null default 0,
    cached          boolean generated always as
                    (num_cached > 0 and num_cached >= case when has_summary
                                                          then greatest(total_run_count, 1)
                                                          else results end) stored,
    project         text not null,
    primary key (invocation_id, project, label)
) with (fillfactor = 80);
insert into tests_v (invocation_id, label, status, has_summary, attempts, run_count, shard_count, total_run_count,
                     results, duration_ms, num_cached, project)
select i.id, l.label, t.status, t.has_summary, t.attempts, t.run_count, t.shard_count, t.total_run_count,
       t.results, t.duration_ms, t.num_cached, i.project
from tests t join invocations i on i.build_key = t.build_key join build_labels l on l.project = i.project and l.id = t.label_id;
create table build_failures_v (
    project        text not null,
    invocation_id  text not null,
    kind           text not null check (kind in ('action', 'configured_label', 'unconfigured_label')),
    label          text not null,
    primary_output text not null,
    configuration  text not null,
    mnemonic       text,
    exit_code      int,
    message        text,
    stderr_uri     text,
    stderr         text,
    stdout_uri     text,
    primary key (invocation_id, project, kind, label, primary_output, configuration)
);
insert into build_failures_v select i.project, i.id, f.kind, f.label, f.primary_output, f.configuration, f.mnemonic,
    f.exit_code, f.message, f.stderr_uri, f.stderr, f.stdout_uri
from build_failures f join invocations i on i.build_key = f.build_key
where f.reported;
create table target_causes_v (
    project             text not null,
    invocation_id       text not null,
    label               text not null,
    cause_kind          text not null,
    cause_label         text not null,
    cause_output        text not null,
    cause_configuration text not null,
    primary key (invocation_id, project, label, cause_kind, cause_label, cause_output, cause_configuration)
);
insert into target_causes_v select i.project, i.id, l.label, f.kind, f.label, f.primary_output, f.configuration
from target_causes c join invocations i on i.build_key = c.build_key
join build_labels l on l.project = i.project and l.id = c.label_id
join build_failures f on f.build_key = c.build_key and f.id = c.cause_id;
drop table targets, tests, build_failures, target_causes;
alter table targets_v rename to targets;
alter table tests_v rename to tests;
alter table build_failures_v rename to build_failures;
alter table target_causes_v rename to target_causes;
alter index targets_v_pkey rename to targets_pkey;
alter index tests_v_pkey rename to tests_pkey;
alter index build_failures_v_pkey rename to build_failures_pkey;
alter index target_causes_v_pkey rename to target_causes_pkey;
create index targets_failed_idx on targets (invocation_id, project, label) where failed;
create index tests_status_idx on tests (status, invocation_id, project, label);
alter table invocations drop constraint invocations_build_key_check;
drop index invocations_build_key_idx;
alter table invocations drop column build_key;
drop sequence build_keys_unsequenced;
drop function build_partitions_for(int, text);
drop table build_labels;
drop function build_failure_id(text, text, text, text);
drop function build_label_id(text);
commit;
