-- The builds projection (projectors/builds): one row per Bazel invocation,
-- its targets, tests, metrics and console output, and hourly rollups per
-- project. Every table here except build_output_chunks is a pure function
-- of the BES stream (plus the sweep's abandonment decisions), so a replay
-- yields the same rows as the live run, whatever the batch boundaries.
--
-- WAL economy (the target is at most 250 WAL bytes per BES event): the
-- projector merges each batch in memory and writes each row at most once
-- per batch, as a plain INSERT or UPDATE (no INSERT ... ON CONFLICT on the
-- hot tables: its speculative insertion and row lock cost two WAL records
-- per row); there are no foreign keys and few indexes, and the tables
-- updated often leave room for HOT updates; console output is stored
-- zstd-compressed (bytea with storage external, so PostgreSQL does not try
-- to compress it again).

-- Fixed duration buckets of hourly_rollups.duration_hist, upper bounds
-- exclusive, in milliseconds:
--   1: < 1 s     2: < 5 s     3: < 10 s    4: < 30 s    5: < 1 min
--   6: < 2 min   7: < 5 min   8: < 10 min  9: < 30 min  10: < 1 h
--   11: < 2 h    12: >= 2 h
-- Changing them needs a new migration that also rebuilds the histograms.
create function build_duration_bucket(ms bigint) returns int
    language sql immutable parallel safe
    return width_bucket(ms, array[1000, 5000, 10000, 30000, 60000, 120000,
                                  300000, 600000, 1800000, 3600000, 7200000]::bigint[]) + 1;

create table invocations (
    id             text primary key,           -- Bazel's invocation id
    build_id       text not null default '',
    project        text not null default '',
    command        text,                       -- build, test, run, ...
    patterns       text[] not null default '{}',
    user_name      text,                       -- workspace status BUILD_USER
    host           text,                       -- workspace status BUILD_HOST
    workspace_dir  text,
    bazel_version  text,
    started_at     timestamptz,                -- BuildStarted
    -- BuildFinished; else InvocationAttemptFinished's time; for an abandoned
    -- invocation, its last event.
    finished_at    timestamptz,
    duration_ms    bigint generated always as
                   ((extract(epoch from (finished_at - started_at)) * 1000)::bigint) stored,
    exit_code      int,                        -- BuildFinished.exit_code.code
    exit_code_name text,                       -- BuildFinished.exit_code.name
    attempt_result text,                       -- InvocationAttemptFinished result name
    status         text not null default 'running'
                   check (status in ('running', 'succeeded', 'failed', 'abandoned')),
    stream_done    boolean not null default false, -- ComponentStreamFinished, last_message or attempt finished
    -- JetStream storage time of the first message applied.
    first_event_at timestamptz not null,

    -- What this invocation currently contributes to hourly_rollups (all null
    -- until it is counted). The projector applies the difference between
    -- these and the invocation's present values, so each invocation is
    -- counted exactly once, moves between statuses or hours when late events
    -- change it, and a redelivered batch changes nothing.
    counted_project     text,
    counted_hour        timestamptz,
    counted_status      text,
    counted_duration_ms bigint,
    counted_tests_passed int,
    counted_tests_failed int,
    counted_tests_flaky  int,

    -- The columns that change with every batch come last and together, so
    -- that an update's WAL record holds little more than them (PostgreSQL
    -- logs only what differs between the common prefix and suffix of the
    -- old and new row on the same page).
    --
    -- last_event_bucket is last_event_at rounded down to 5 minutes. The
    -- sweep's index is on it rather than on last_event_at, so that most
    -- updates leave every indexed value alone and are HOT (no index
    -- entries, new version on the same page; hence the fillfactor).
    last_event_bucket timestamptz generated always as
                      (date_bin('5 minutes', last_event_at, timestamptz '2000-01-01 00:00:00+00')) stored,
    last_event_at  timestamptz not null,       -- JetStream storage time of the last message applied
    last_sequence  bigint not null default 0,  -- highest BES tool sequence applied
    event_count    bigint not null default 0   -- BES tool events applied
) with (fillfactor = 70);

-- The sweep looks for running invocations that have gone quiet.
create index invocations_running_idx on invocations (last_event_bucket) where status = 'running';

create table targets (
    invocation_id  text not null,
    label          text not null,
    kind           text,                       -- "sh_test rule", ...
    success        boolean,                    -- null until TargetComplete (or Aborted)
    failure_reason text,
    -- Which source failure_reason came from, the strongest wins:
    -- 3 TargetComplete.failure_detail, 2 Aborted, 1 a failed action.
    failure_rank   smallint not null default 0,
    tags           text[],
    primary key (invocation_id, label)
) with (fillfactor = 80); -- room for the TargetComplete update of a TargetConfigured row

create table tests (
    invocation_id   text not null,
    label           text not null,
    status          text not null,             -- Bazel's TestStatus name, e.g. PASSED
    has_summary     boolean not null,          -- status and totals come from TestSummary
    attempts        int not null default 0,
    run_count       int not null default 0,
    shard_count     int not null default 0,
    total_run_count int not null default 0,
    results         int not null default 0,    -- TestResult events seen
    duration_ms     bigint not null default 0,
    num_cached      int not null default 0,
    cached          boolean generated always as
                    (num_cached > 0 and num_cached >= case when has_summary
                                                          then greatest(total_run_count, 1)
                                                          else results end) stored,
    primary key (invocation_id, label)
) with (fillfactor = 80);

create table build_metrics (
    invocation_id        text primary key,
    actions_created      bigint,
    actions_executed     bigint,
    action_cache_hits    bigint,
    action_cache_misses  bigint,
    remote_cache_hits    bigint,
    cpu_time_ms          bigint,
    wall_time_ms         bigint,
    analysis_phase_ms    bigint,
    execution_phase_ms   bigint,
    used_heap_size_post_build bigint,
    peak_post_gc_heap_size    bigint,
    packages_loaded      bigint,
    targets_loaded       bigint,
    targets_configured   bigint
);

-- Console output of finished invocations: one zstd frame per stream, made
-- deterministically (one encoder goroutine, fixed level) from the whole
-- output, so live and replay store identical bytes.
create table build_output (
    invocation_id text primary key,
    stdout        bytea not null,
    stderr        bytea not null,
    stdout_bytes  bigint not null,             -- uncompressed sizes
    stderr_bytes  bigint not null
);
alter table build_output alter column stdout set storage external,
                         alter column stderr set storage external;

-- Scratch: compressed output of invocations still running, one row per batch
-- that carried output, keyed by the BES sequence of its first progress
-- event. Folded into build_output and deleted when the invocation's stream
-- ends or it is abandoned. Its rows depend on batch boundaries, so it is not
-- part of the projection's digest.
create table build_output_chunks (
    invocation_id text not null,
    first_seq     bigint not null,
    stdout        bytea not null,
    stderr        bytea not null,
    primary key (invocation_id, first_seq)
);
alter table build_output_chunks alter column stdout set storage external,
                                alter column stderr set storage external;

-- Per project and hour (UTC) of the invocation's start: finished invocations
-- by final status, a histogram of their durations (buckets of
-- build_duration_bucket, 12 counters) and their tests by status.
create table hourly_rollups (
    project         text not null,
    hour            timestamptz not null,
    builds          bigint not null default 0,
    succeeded       bigint not null default 0,
    failed          bigint not null default 0,
    abandoned       bigint not null default 0,
    duration_hist   bigint[] not null,
    duration_sum_ms bigint not null default 0,
    tests_passed    bigint not null default 0,
    tests_failed    bigint not null default 0,
    tests_flaky     bigint not null default 0,
    primary key (project, hour)
);

---- create above / drop below ----

drop table hourly_rollups;
drop table build_output_chunks;
drop table build_output;
drop table build_metrics;
drop table tests;
drop table targets;
drop table invocations;
drop function build_duration_bucket(bigint);
