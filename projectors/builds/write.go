package builds

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgtype"
)

// listSep joins a text[] value into one text element of an unnest()
// argument (PostgreSQL arrays cannot be ragged). It is a control character
// that clean() lets through, so joinList replaces it in the elements.
const listSep = "\x1f"

// splitList is string_to_array(s, listSep) of a joined list: the empty
// string is the empty list.
func splitList(s string) []string {
	if s == "" {
		return []string{}
	}
	return strings.Split(s, listSep)
}

func joinList(xs []string) string {
	for i, x := range xs {
		if strings.Contains(x, listSep) {
			xs[i] = strings.ReplaceAll(x, listSep, "\uFFFD")
		}
	}
	return strings.Join(xs, listSep)
}

// Writes avoid INSERT ... ON CONFLICT for the tables written with every
// batch: its speculative insertion and row locks add two WAL records per
// row (about 35 bytes per event measured). Instead, the batch's first
// round trip reads which invocations, targets and tests exist, and then
// new rows are inserted and existing ones UPDATEd, each with one statement
// over unnest() arrays. The UPDATEs apply the same merge rules as the
// in-memory merge in state.go. (A second projector writing concurrently
// would make an insert fail on the primary key and its batch be retried;
// the runner does not do that.)
//
// New target, test and output chunk rows are COPYed (copyNew), not
// INSERTed: COPY writes the rows that go to one page as one WAL record
// (heap_multi_insert), where INSERT writes a record of about 50 bytes of
// headers for every row. At 1,000 paced streams a batch inserts about
// 250 target rows, and that was 11 of 168 WAL bytes per event
// (BenchmarkApplyPaced).

// Every statement names a build by (project, invocation id): two projects
// may send the same invocation id, and they are two builds.

// sqlKeyedPlans, first in every transaction of the projector, leaves the
// planner one way to join a batch's unnest() arrays with a table: a nested
// loop probing the table's primary key. A prepared statement is planned
// for the connection's life (its generic plan, after five custom ones)
// from the table sizes of that moment, and kept until the table's
// statistics change. Planned while a table is small or has no statistics
// (a fresh database, a server without autovacuum), the plan hashes a scan
// of the whole table against the batch, and every later batch scans it
// again: at 1,000 paced streams the targets table's two statements took
// most of PostgreSQL's time (BenchmarkApplyPaced). Planning every batch
// afresh costs about 3 ms a batch. With only key probes left to choose,
// the generic plan is the one each batch needs, so it is taken from the
// first execution on (a generic plan assumes arrays of 10 elements, and
// when a batch's are smaller the plan cache would otherwise keep planning
// for it). The settings are local: they end with the transaction.
const sqlKeyedPlans = `select set_config('enable_seqscan', 'off', true), set_config('enable_hashjoin', 'off', true),
       set_config('enable_mergejoin', 'off', true), set_config('plan_cache_mode', 'force_generic_plan', true)`

const sqlLoad = `
select i.project, i.id, i.last_sequence, i.status, i.stream_done, i.build_key
from unnest($1::text[], $2::text[]) as u(project, id)
join invocations i on i.id = u.id and i.project = u.project`

// sqlExistingTargets and sqlExistingTests find the batch's target and test
// rows (label ids in $4, labelID) of stored builds, in both tables of each
// (running.go); they run in the load's round trip, before the batch knows
// the builds' keys. Each probe is a subquery of LIMIT 1 on the whole key:
// as a join, PostgreSQL may take an index scan on the build key alone
// (equal in cost while the tables are small or without statistics, and
// prepared statements keep their plan), which reads every row of the
// build for each probe, and at a million events the projector stalled.
var (
	sqlExistingTargets = existingRows(targetTables)
	sqlExistingTests   = existingRows(testTables)
)

func existingRows(tables [places]string) string {
	var branches []string
	for _, t := range tables {
		branches = append(branches, `
select u.project, u.inv, u.label
from unnest($1::text[], $2::text[], $3::text[], $4::int8[]) as u(project, inv, label, label_id)
join invocations i on i.id = u.inv and i.project = u.project
cross join lateral (select from `+t+` t where t.build_key = i.build_key and t.label_id = u.label_id limit 1) t`)
	}
	return strings.Join(branches, "\nunion all")
}

// eventBucket is invocations.last_event_bucket of a last_event_at: the
// time rounded down to 5 minutes, which the sweep's index holds rather than
// the time itself, so that most updates change no indexed value and stay
// HOT. The projector sets it with last_event_at (migration 011: a stored
// generated column cost every update that moved last_event_at a step of
// its own).
func eventBucket(at string) string {
	return "date_bin('5 minutes', " + at + ", timestamptz '2000-01-01 00:00:00+00')"
}

// invocationRows is the batch's invocations as rows (status derived from
// this batch alone: BuildFinished's exit code, else the attempt's result).
var invocationRows = `
select u.id, u.build_id, u.project, nullif(u.command, '') as command,
       coalesce(string_to_array(nullif(u.patterns, ''), E'\x1f'), '{}') as patterns,
       nullif(u.user_name, '') as user_name, nullif(u.host, '') as host,
       nullif(u.workspace_dir, '') as workspace_dir, nullif(u.bazel_version, '') as bazel_version,
       u.started_at, u.finished_at, u.exit_code,
       case when u.exit_code is not null then nullif(u.exit_code_name, '') end as exit_code_name,
       nullif(u.attempt_result, '') as attempt_result,
       case when u.exit_code is not null then case when u.exit_code = 0 then 'succeeded' else 'failed' end
            when u.attempt_result <> '' then case when u.attempt_result = 'COMMAND_SUCCEEDED' then 'succeeded' else 'failed' end
            else 'running' end as status,
       u.done, u.first_at, u.last_at, ` + eventBucket("u.last_at") + `, u.last_seq, u.n, u.build_key
from unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
            $8::text[], $9::text[], $10::timestamptz[], $11::timestamptz[], $12::int4[], $13::text[],
            $14::text[], $15::timestamptz[], $16::timestamptz[], $17::int8[], $18::int8[], $19::bool[], $20::int8[])
     as u(id, build_id, project, command, patterns, user_name, host, workspace_dir, bazel_version,
          started_at, finished_at, exit_code, exit_code_name, attempt_result,
          first_at, last_at, last_seq, n, done, build_key)`

var sqlInsertInvocations = `
insert into invocations (id, build_id, project, command, patterns, user_name, host, workspace_dir,
    bazel_version, started_at, finished_at, exit_code, exit_code_name, attempt_result, status,
    stream_done, first_event_at, last_event_at, last_event_bucket, last_sequence, event_count, build_key)
` + invocationRows + `
returning project, id, last_sequence, status, stream_done, build_key`

// sqlUpdateInvocations merges the batch into stored invocations. Status and
// finished_at: BuildFinished decides (exit code 0 = succeeded); else
// InvocationAttemptFinished's result; else an abandoned invocation stays
// abandoned and ends at its last event; else it is running. Descriptive
// fields: the newest value wins; patterns accumulate.
var sqlUpdateInvocations = `
update invocations i set
    build_id       = case when i.build_id = '' then u.build_id else i.build_id end,
    command        = coalesce(u.command, i.command),
    patterns       = i.patterns || u.patterns,
    user_name      = coalesce(u.user_name, i.user_name),
    host           = coalesce(u.host, i.host),
    workspace_dir  = coalesce(u.workspace_dir, i.workspace_dir),
    bazel_version  = coalesce(u.bazel_version, i.bazel_version),
    started_at     = coalesce(u.started_at, i.started_at),
    finished_at    = case when u.exit_code is not null then u.finished_at
                          when i.exit_code is not null then i.finished_at
                          when u.attempt_result is not null then u.finished_at
                          when i.attempt_result is not null then i.finished_at
                          when i.status = 'abandoned' then greatest(i.last_event_at, u.last_at)
                     end,
    exit_code      = coalesce(u.exit_code, i.exit_code),
    exit_code_name = case when u.exit_code is not null then u.exit_code_name else i.exit_code_name end,
    attempt_result = coalesce(u.attempt_result, i.attempt_result),
    status         = case when u.exit_code is not null then u.status
                          when i.exit_code is not null then i.status
                          when u.attempt_result is not null then u.status
                          when i.attempt_result is not null then i.status
                          when i.status = 'abandoned' then 'abandoned'
                          else 'running' end,
    stream_done    = i.stream_done or u.done,
    first_event_at = least(i.first_event_at, u.first_at),
    last_event_at  = greatest(i.last_event_at, u.last_at),
    last_event_bucket = ` + eventBucket("greatest(i.last_event_at, u.last_at)") + `,
    last_sequence  = greatest(i.last_sequence, u.last_seq),
    event_count    = i.event_count + u.n
from (` + invocationRows + `) u
where i.id = u.id and i.project = u.project
returning i.project, i.id, i.last_sequence, i.status, i.stream_done, i.build_key`

// sqlUpdateProgress is sqlUpdateInvocations for the invocations that a
// batch only moves on (inv.progressOnly): running, and no event of the
// batch sets a field but the times, the sequence and the count. For them
// every other expression of sqlUpdateInvocations keeps the stored value,
// and at 1,000 paced streams they are nearly all of a batch's
// invocations (one per event), so they get a statement of eight columns
// rather than nineteen. A row whose last_sequence is not the one the batch
// filtered its resends by ($8, which may come from the cache) is left
// alone, and the batch fails (found).
var sqlUpdateProgress = `
update invocations i set
    build_id       = case when i.build_id = '' then u.build_id else i.build_id end,
    first_event_at = least(i.first_event_at, u.first_at),
    last_event_at  = greatest(i.last_event_at, u.last_at),
    last_event_bucket = ` + eventBucket("greatest(i.last_event_at, u.last_at)") + `,
    last_sequence  = greatest(i.last_sequence, u.last_seq),
    event_count    = i.event_count + u.n
from unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[], $5::timestamptz[], $6::int8[], $7::int8[],
            $8::int8[])
     as u(id, project, build_id, first_at, last_at, last_seq, n, stored_seq)
where i.id = u.id and i.project = u.project and i.last_sequence = u.stored_seq`

const targetRows = `
select u.build_key, u.label_id, u.kind_id, u.success, nullif(u.reason, '') as reason, u.rank,
       case when u.has_tags then string_to_array(u.tags, E'\x1f') end as tags
from unnest($1::int8[], $2::int8[], $3::int4[], $4::bool[], $5::text[], $6::int2[], $7::bool[], $8::text[])
     as u(build_key, label_id, kind_id, success, reason, rank, has_tags, tags)`

// sqlUpdateTargets (of the table to name: targets or targets_running, see
// place): the first kind and tags win; a target succeeded only if
// all its completions (one per configuration) did; the failure reason from
// the strongest source wins, the first of equals. failed is true for a
// failed target and null otherwise (not false): targets_failed_idx is on
// it, so a target that completes successfully changes no indexed column
// and its update stays HOT (migrations/012_builds_output_pages.sql).
const sqlUpdateTargets = `
update %s t set
    kind_id        = coalesce(t.kind_id, u.kind_id),
    success        = case when t.success is null then u.success
                          when u.success is null then t.success
                          else t.success and u.success end,
    failure_reason = case when u.rank > t.failure_rank then u.reason else t.failure_reason end,
    failure_rank   = greatest(t.failure_rank, u.rank),
    failed         = case when t.success = false or u.success = false then true end,
    tags           = coalesce(t.tags, u.tags)
from (` + targetRows + `) u
where t.build_key = u.build_key and t.label_id = u.label_id`

const testRows = `
select * from unnest($1::int8[], $2::int8[], $3::text[], $4::bool[], $5::int4[], $6::int4[],
                     $7::int4[], $8::int4[], $9::int4[], $10::int8[], $11::int4[])
     as u(build_key, label_id, status, has_summary, attempts, run_count, shard_count, total_run_count,
          results, duration_ms, num_cached)`

// sqlUpdateTests (of tests or tests_running): a TestSummary decides status, run totals, duration and
// cache counts; before it, TestResults accumulate.
const sqlUpdateTests = `
update %s t set
    status          = case when u.has_summary or not t.has_summary then u.status else t.status end,
    has_summary     = t.has_summary or u.has_summary,
    attempts        = greatest(t.attempts, u.attempts),
    run_count       = greatest(t.run_count, u.run_count),
    shard_count     = greatest(t.shard_count, u.shard_count),
    total_run_count = case when u.has_summary then u.total_run_count else t.total_run_count end,
    results         = t.results + u.results,
    duration_ms     = case when u.has_summary then u.duration_ms
                           when t.has_summary then t.duration_ms
                           else t.duration_ms + u.duration_ms end,
    num_cached      = case when u.has_summary then u.num_cached
                           when t.has_summary then t.num_cached
                           else t.num_cached + u.num_cached end
from (` + testRows + `) u
where t.build_key = u.build_key and t.label_id = u.label_id`

const sqlMetrics = `
insert into build_metrics as m (build_key, actions_created, actions_executed, action_cache_hits,
    action_cache_misses, remote_cache_hits, cpu_time_ms, wall_time_ms, analysis_phase_ms,
    execution_phase_ms, used_heap_size_post_build, peak_post_gc_heap_size, packages_loaded,
    targets_loaded, targets_configured)
select * from unnest($1::int8[], $2::int8[], $3::int8[], $4::int8[], $5::int8[], $6::int8[],
                     $7::int8[], $8::int8[], $9::int8[], $10::int8[], $11::int8[], $12::int8[],
                     $13::int8[], $14::int8[], $15::int8[])
on conflict (build_key) do update set
    actions_created = excluded.actions_created, actions_executed = excluded.actions_executed,
    action_cache_hits = excluded.action_cache_hits, action_cache_misses = excluded.action_cache_misses,
    remote_cache_hits = excluded.remote_cache_hits, cpu_time_ms = excluded.cpu_time_ms,
    wall_time_ms = excluded.wall_time_ms, analysis_phase_ms = excluded.analysis_phase_ms,
    execution_phase_ms = excluded.execution_phase_ms,
    used_heap_size_post_build = excluded.used_heap_size_post_build,
    peak_post_gc_heap_size = excluded.peak_post_gc_heap_size, packages_loaded = excluded.packages_loaded,
    targets_loaded = excluded.targets_loaded, targets_configured = excluded.targets_configured`

// sqlCriticalPath sets the critical path's length and steps
// (BuildToolLogs), columns sqlMetrics leaves alone: whichever event comes
// first, in whichever batch, the row ends the same.
const sqlCriticalPath = `
insert into build_metrics as m (build_key, critical_path_ms, critical_path)
select * from unnest($1::int8[], $2::int4[], $3::text[])
on conflict (build_key) do update set critical_path_ms = excluded.critical_path_ms, critical_path = excluded.critical_path`

const sqlDropChunks = `
delete from build_output_chunks c
using unnest($1::text[], $2::text[]) as u(project, id)
where c.invocation_id = u.id and c.project = u.project`

const sqlAbandon = `
update invocations set status = 'abandoned', finished_at = last_event_at
where status = 'running' and last_event_bucket < $1 and last_event_at < $1
returning project, id, build_key`

// sqlAbandonCandidates and sqlAbandonThese are sqlAbandon in two steps
// for a partition's projector: which invocations are to be abandoned, and
// then those of them its partition holds (ForPartition).
const (
	sqlAbandonCandidates = `
select project, id, build_key from invocations
where status = 'running' and last_event_bucket < $1 and last_event_at < $1`
	sqlAbandonThese = `
update invocations set status = 'abandoned', finished_at = last_event_at
where build_key = any($1) and status = 'running'
returning project, id, build_key`
)

// sqlIdleOutput finds output chunks of invocations that will get no
// finalizing event: abandoned ones, and finished ones whose tool stream
// never reported its end.
const sqlIdleOutput = `
select distinct c.project, c.invocation_id
from build_output_chunks c join invocations i on i.id = c.invocation_id and i.project = c.project
where i.status <> 'running' and i.last_event_at < $1
order by 2, 1`

// sqlInsertLabels records the labels of the batch's new target and test
// rows in build_labels. A label already there is found by the primary key
// and written nothing (no WAL).
const sqlInsertLabels = `
insert into build_labels (project, id, label)
select * from unnest($1::text[], $2::int8[], $3::text[]) order by 1, 2
on conflict do nothing`

// sqlInsertKinds records the batch's target kinds in build_kinds.
const sqlInsertKinds = `
insert into build_kinds (id, kind)
select * from unnest($1::int4[], $2::text[]) order by 1
on conflict do nothing`

// durationBuckets is the number of duration_hist counters (see
// build_duration_bucket in migrations/002_builds.sql).
const durationBuckets = 12

// sqlReconcile brings hourly_rollups in line with the given invocations: it
// subtracts what each counted before (counted_*) and adds what it counts
// now, for those whose contribution changed, and records the new one. The
// hour is that of the invocation's start (or first event), in UTC; a
// negative duration (client clock skew) counts as 0.
var sqlReconcile = `
with cur as (
    select i.id, i.counted_project, i.counted_hour, i.counted_status, i.counted_duration_ms,
           i.counted_tests_passed, i.counted_tests_failed, i.counted_tests_flaky,
           i.counted_cache_hits, i.counted_cache_misses,
           i.project, date_trunc('hour', coalesce(i.started_at, i.first_event_at), 'UTC') as hour,
           i.status, greatest(coalesce(i.duration_ms, 0), 0) as duration_ms, n.passed, n.failed, n.flaky,
           coalesce(m.action_cache_hits, 0)::int as hits, coalesce(m.action_cache_misses, 0)::int as misses
    from unnest($1::text[], $2::text[]) as u(project, id)
    join invocations i on i.id = u.id and i.project = u.project
    left join build_metrics m on m.build_key = i.build_key
    cross join lateral (
        select count(*) filter (where t.status = 'PASSED')::int as passed,
               count(*) filter (where t.status not in ('PASSED', 'FLAKY', 'NO_STATUS'))::int as failed,
               count(*) filter (where t.status = 'FLAKY')::int as flaky
        from all_tests t where t.build_key = i.build_key) n
    where i.status <> 'running' or i.counted_status is not null
), changed as (
    select * from cur
    where status = 'running'
       or (counted_project, counted_hour, counted_status, counted_duration_ms,
           counted_tests_passed, counted_tests_failed, counted_tests_flaky,
           counted_cache_hits, counted_cache_misses)
          is distinct from (project, hour, status, duration_ms, passed, failed, flaky, hits, misses)
), mark as (
    update invocations i set
        counted_project      = case when c.status <> 'running' then c.project end,
        counted_hour         = case when c.status <> 'running' then c.hour end,
        counted_status       = case when c.status <> 'running' then c.status end,
        counted_duration_ms  = case when c.status <> 'running' then c.duration_ms end,
        counted_tests_passed = case when c.status <> 'running' then c.passed end,
        counted_tests_failed = case when c.status <> 'running' then c.failed end,
        counted_tests_flaky  = case when c.status <> 'running' then c.flaky end,
        counted_cache_hits   = case when c.status <> 'running' then c.hits end,
        counted_cache_misses = case when c.status <> 'running' then c.misses end
    from changed c where i.id = c.id and i.project = c.project
), delta as (
    select counted_project as project, counted_hour as hour, -1 as sign, counted_status as status,
           counted_duration_ms as duration_ms, counted_tests_passed as passed,
           counted_tests_failed as failed, counted_tests_flaky as flaky,
           coalesce(counted_cache_hits, 0) as hits, coalesce(counted_cache_misses, 0) as misses
    from changed where counted_status is not null
    union all
    select project, hour, 1, status, duration_ms, passed, failed, flaky, hits, misses
    from changed where status <> 'running'
)
` + sqlRollupDelta + `
returning project, hour, builds`

// sqlRollupDelta adds to hourly_rollups the rows of the CTE delta: a
// project, an hour, a sign (+1 counts an invocation there, -1 takes it
// away) and what the invocation counts (status, duration, tests, action
// cache hits and misses).
var sqlRollupDelta = `insert into hourly_rollups as r (project, hour, builds, succeeded, failed, abandoned, duration_hist,
                                 duration_sum_ms, tests_passed, tests_failed, tests_flaky, cache_hits, cache_misses)
select project, hour, sum(sign),
       coalesce(sum(sign) filter (where status = 'succeeded'), 0),
       coalesce(sum(sign) filter (where status = 'failed'), 0),
       coalesce(sum(sign) filter (where status = 'abandoned'), 0),
       ` + histArray() + `,
       sum(sign * duration_ms)::bigint, sum(sign * passed), sum(sign * failed), sum(sign * flaky),
       sum(sign * hits), sum(sign * misses)
from delta group by project, hour
order by project, hour -- one order of the rows' locks for every writer: partitions' batches share rows
on conflict (project, hour) do update set
    builds          = r.builds + excluded.builds,
    succeeded       = r.succeeded + excluded.succeeded,
    failed          = r.failed + excluded.failed,
    abandoned       = r.abandoned + excluded.abandoned,
    duration_hist   = array(select a + b from unnest(r.duration_hist, excluded.duration_hist)
                            with ordinality as h(a, b, n) order by n),
    duration_sum_ms = r.duration_sum_ms + excluded.duration_sum_ms,
    tests_passed    = r.tests_passed + excluded.tests_passed,
    tests_failed    = r.tests_failed + excluded.tests_failed,
    tests_flaky     = r.tests_flaky + excluded.tests_flaky,
    cache_hits      = r.cache_hits + excluded.cache_hits,
    cache_misses    = r.cache_misses + excluded.cache_misses`

func histArray() string {
	var b strings.Builder
	b.WriteString("array[")
	for i := 1; i <= durationBuckets; i++ {
		if i > 1 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "coalesce(sum(sign) filter (where build_duration_bucket(duration_ms) = %d), 0)", i)
	}
	b.WriteString("]::bigint[]")
	return b.String()
}

// sqlDropEmptyRollups removes rollup rows that a move left at zero, so that
// they look as if the invocation had never been counted there (as in a
// replay that never saw the intermediate state).
const sqlDropEmptyRollups = `
delete from hourly_rollups r
using unnest($1::text[], $2::timestamptz[]) as u(project, hour)
where r.project = u.project and r.hour = u.hour and r.builds = 0`

// writes is a batch's rows by table and kind, as unnest() arguments.
type writes struct {
	newInv, oldInv invCols
	progress       progressCols
	newTgt, oldTgt [places]targetCols
	newTst, oldTst [places]testCols
	finish         []int64 // builds whose running rows move (sqlFinishTargets)
	met            metricCols
	critical       criticalCols
	once           onceCols // metadata.go
	chunks         chunkCols
	labels         labelCols
	kinds          kindCols
	weeks          []int32 // partitions the batch writes into (addWeek)
	finalize       map[invKey]*inv
	finIDs         []invKey
	reconcIDs      []invKey
}

// write sends the batch's statements in one pipeline (plus one read ahead of
// it when an invocation's output is finalized), then records in the cache
// what they left.
func (s *state) write(ctx context.Context, tx pgx.Tx) error {
	slices.SortFunc(s.ids, invKey.compare)
	w := &writes{finalize: map[invKey]*inv{}}
	var fresh []*inv
	for _, id := range s.ids {
		if v := s.invs[id]; v.write && !v.stored {
			v.buildKey = partitionKey(s.layout, s.part, v.firstAt, v.firstSeq)
			fresh = append(fresh, v)
		}
	}
	if err := uniqueKeys(ctx, tx, fresh); err != nil {
		return err
	}
	for _, id := range s.ids {
		if v := s.invs[id]; v.write {
			s.collect(w, v)
		}
	}
	if len(w.newInv.id)+len(w.oldInv.id)+len(w.progress.id) == 0 {
		return nil
	}
	b := &pgx.Batch{}
	// Reads come first: a pipeline cannot wait for its own results.
	if len(w.finIDs) > 0 {
		if err := fold(ctx, tx, b, w.finalize, w.finIDs); err != nil {
			return err
		}
	}
	if err := s.cache.ensurePartitions(ctx, tx, w.weeks); err != nil {
		return err
	}
	// Before the pipeline: its rollup statement counts the tests.
	if err := w.copyNew(ctx, tx); err != nil {
		if noPartition(err) {
			// Dropped by the retention of another process since this
			// process made it: forget the partitions known, and retry.
			return fmt.Errorf("%w (%v)", errStale, err)
		}
		return stale(fmt.Errorf("builds: write batch: %w", err), s.rowsKnown)
	}
	after := make(map[invKey]known, len(w.newInv.id)+len(w.oldInv.id))
	var empty rollupKeys
	w.queue(b, after, &empty)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return stale(fmt.Errorf("builds: write batch: %w", err), s.rowsKnown)
	}
	if len(empty.project) > 0 {
		if _, err := tx.Exec(ctx, sqlDropEmptyRollups, empty.project, empty.hour); err != nil {
			return fmt.Errorf("builds: drop empty rollups: %w", err)
		}
	}
	s.remember(after)
	return nil
}

// addWeek records that the batch writes rows of build key's week, whose
// partitions it makes if missing.
func (w *writes) addWeek(key int64) {
	if wk := keyWeek(key); !slices.Contains(w.weeks, wk) {
		w.weeks = append(w.weeks, wk)
	}
}

// collect adds what the batch writes of invocation v to w.
func (s *state) collect(w *writes, v *inv) {
	id := v.key
	switch {
	case v.progressOnly():
		w.progress.add(v)
	case v.stored:
		w.oldInv.add(v)
	default:
		w.addWeek(v.buildKey)
		w.newInv.add(v)
	}
	at := w.place(v)
	slices.Sort(v.targetOrder)
	for _, l := range v.targetOrder {
		switch t := v.targets[l]; {
		case s.targetExists[rowKey{id, l}]:
			w.oldTgt[at].add(v, t, &w.kinds)
		case t.known:
			w.newTgt[at].add(v, t, &w.kinds)
			w.labels.add(id.project, l, t.id)
			v.newTargets = append(v.newTargets, l)
			// else: only a failed action names the label, and it is not a
			// target of this build (a dependency's action): no row.
		}
	}
	slices.Sort(v.testOrder)
	for _, l := range v.testOrder {
		if s.testExists[rowKey{id, l}] {
			w.oldTst[at].add(v, v.tests[l])
		} else {
			w.newTst[at].add(v, v.tests[l])
			w.labels.add(id.project, l, v.tests[l].id)
			v.newTests = append(v.newTests, l)
		}
	}
	if v.metrics != nil {
		w.met.add(v)
	}
	if v.hasCriticalPath {
		w.critical.build = append(w.critical.build, v.buildKey)
		w.critical.ms = append(w.critical.ms, int32(min(v.criticalPathMs, math.MaxInt32)))
		w.critical.steps = append(w.critical.steps, nullText(v.criticalPathSteps))
	}
	w.once.add(v)

	abandoned := v.storedStatus == "abandoned" && !v.hasExit && v.result == ""
	final := v.storedDone || v.done || abandoned
	hasOut := len(v.stdout) > 0 || len(v.stderr) > 0
	switch {
	case final && (hasOut || (v.done && !v.storedDone)):
		w.finalize[id] = v
		w.finIDs = append(w.finIDs, id)
	case hasOut:
		w.chunks.add(id, v)
	}

	if v.hasExit || v.result != "" || (v.storedStatus != "" && v.storedStatus != "running") {
		w.reconcIDs = append(w.reconcIDs, id)
	}
}

// queue adds the writes to b. The invocations' statements read back what
// the cache keeps of the rows they merge into (after), and every UPDATE
// must find each row it names: a row missing is errStale.
func (w *writes) queue(b *pgx.Batch, after map[invKey]known, empty *rollupKeys) {
	readBack := func(rows pgx.Rows) error {
		var k invKey
		var c known
		_, err := pgx.ForEachRow(rows, []any{&k.project, &k.id, &c.seq, &c.status, &c.done, &c.buildKey}, func() error {
			after[k] = c
			return nil
		})
		return err
	}
	update := func(sql string, n int, args func() []any) {
		if n > 0 {
			b.Queue(sql, args()...).Exec(func(ct pgconn.CommandTag) error { return found(ct.RowsAffected(), n) })
		}
	}
	if n := len(w.newInv.id); n > 0 {
		b.Queue(sqlInsertInvocations, w.newInv.args()...).Query(readBack)
	}
	if n := len(w.oldInv.id); n > 0 {
		b.Queue(sqlUpdateInvocations, w.oldInv.args()...).Query(func(rows pgx.Rows) error {
			if err := readBack(rows); err != nil {
				return err
			}
			return found(rows.CommandTag().RowsAffected(), n)
		})
	}
	update(sqlUpdateProgress, len(w.progress.id), w.progress.args)
	// test_daily counts the rows of finished builds (testhistory.go):
	// those updated in place are taken away before and added after, those
	// COPYed into them (copyNew) added, the builds that finish counted
	// whole as their rows move.
	updated, updatedLabels := pairsOutside(w.oldTst[placeFinished].key, w.oldTst[placeFinished].label, w.finish)
	copied, copiedLabels := pairsOutside(w.newTst[placeFinished].key, w.newTst[placeFinished].label, w.finish)
	if len(updated) > 0 {
		b.Queue(sqlCountRows, []int64(nil), updated, updatedLabels, -1)
	}
	for p := range places {
		update(fmt.Sprintf(sqlUpdateTargets, targetTables[p]), len(w.oldTgt[p].key), w.oldTgt[p].args)
		update(fmt.Sprintf(sqlUpdateTests, testTables[p]), len(w.oldTst[p].key), w.oldTst[p].args)
	}
	if len(updated) > 0 || len(copied) > 0 {
		b.Queue(sqlCountRows, []int64(nil), append(updated, copied...), append(updatedLabels, copiedLabels...), 1)
	}
	if len(w.finish) > 0 {
		// After the updates: they name the running rows.
		queueFinish(b, w.finish)
	}
	if len(w.labels.id) > 0 {
		b.Queue(sqlInsertLabels, w.labels.project, w.labels.id, w.labels.label)
	}
	if len(w.kinds.id) > 0 {
		b.Queue(sqlInsertKinds, w.kinds.id, w.kinds.kind)
	}
	if len(w.met.build) > 0 {
		b.Queue(sqlMetrics, w.met.args()...)
	}
	if len(w.critical.build) > 0 {
		b.Queue(sqlCriticalPath, w.critical.build, w.critical.ms, w.critical.steps)
	}
	w.once.queue(b)
	// After the metadata: the flags find builds by their commit. A build
	// whose metadata comes after its end has its commit's flags set then
	// (w.once.meta.build), so that where batches fall changes nothing.
	queueFlags(b, w.finish, updated, copied, w.once.meta.build)
	// Rollups read invocations and tests, so they come after them.
	if len(w.reconcIDs) > 0 {
		projects, ids := splitKeys(w.reconcIDs)
		b.Queue(sqlReconcile, projects, ids).Query(empty.collect)
	}
}

// copyNew COPYs the batch's new target, test and output chunk rows. Chunks
// are new by construction: first_seq is above the invocation's stored
// last_sequence.
func (w *writes) copyNew(ctx context.Context, tx pgx.Tx) error {
	type copied struct {
		table   string
		columns []string
		n       int
		row     func(i int) []any
		order   []int // rows in this order; nil: as they are
	}
	targetColumns := []string{"build_key", "label_id", "kind_id", "success", "failure_reason",
		"failure_rank", "tags", "failed"}
	testColumns := []string{"build_key", "label_id", "status", "has_summary", "attempts", "run_count",
		"shard_count", "total_run_count", "results", "duration_ms", "num_cached"}
	var cs []copied
	for p := range places {
		// A finished build's rows go in sorted, as sqlFinishTargets moves
		// them: one run at the end of the primary key.
		var to, so []int
		if p == placeFinished {
			to, so = keyOrder(w.newTgt[p].key, w.newTgt[p].label), keyOrder(w.newTst[p].key, w.newTst[p].label)
		}
		cs = append(cs, copied{targetTables[p], targetColumns, len(w.newTgt[p].key), w.newTgt[p].row, to},
			copied{testTables[p], testColumns, len(w.newTst[p].key), w.newTst[p].row, so})
	}
	cs = append(cs, copied{"build_output_chunks", []string{"project", "invocation_id", "first_seq", "stdout", "stderr"},
		len(w.chunks.inv), w.chunks.row, nil})
	for _, c := range cs {
		if c.n == 0 {
			continue
		}
		i := 0
		n, err := tx.CopyFrom(ctx, pgx.Identifier{c.table}, c.columns, pgx.CopyFromFunc(func() ([]any, error) {
			if i == c.n {
				return nil, nil
			}
			i++
			if c.order != nil {
				return c.row(c.order[i-1]), nil
			}
			return c.row(i - 1), nil
		}))
		if err != nil {
			return fmt.Errorf("copy %s: %w", c.table, err)
		}
		if n != int64(c.n) {
			return fmt.Errorf("copy %s: %d rows of %d", c.table, n, c.n)
		}
	}
	return nil
}

// sqlUniqueKeys returns the keys new builds take: the one made of the
// first message (buildKey), unless a stored build or an earlier one of the
// batch has it. That happens only when the stream's sequences start again
// (a stream deleted and made anew while the tables stay): such a build gets
// a key of the same day from build_keys_unsequenced (migration 016), which
// a replay would not give it again.
const sqlUniqueKeys = `
select case when exists (select 1 from invocations i where i.build_key = u.k)
                 or row_number() over (partition by u.k order by u.n) > 1
            then (u.k >> 47 << 47) | ((1::bigint << 46) + (1::bigint << 45) + nextval('build_keys_unsequenced'))
            else u.k end
from unnest($1::int8[]) with ordinality as u(k, n)
order by u.n`

// uniqueKeys makes the keys of the batch's new builds unique
// (sqlUniqueKeys), in one round trip.
func uniqueKeys(ctx context.Context, tx pgx.Tx, fresh []*inv) error {
	if len(fresh) == 0 {
		return nil
	}
	ks := make([]int64, len(fresh))
	for i, v := range fresh {
		ks[i] = v.buildKey
	}
	rows, err := tx.Query(ctx, sqlUniqueKeys, ks)
	if err != nil {
		return fmt.Errorf("builds: build keys: %w", err)
	}
	got, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || len(got) != len(ks) {
		return fmt.Errorf("builds: build keys: %d of %d (%v)", len(got), len(ks), err)
	}
	for i, v := range fresh {
		v.buildKey = got[i]
	}
	return nil
}

// noPartition reports an insert that found no partition for its build key.
func noPartition(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && pe.Code == "23514" && strings.Contains(pe.Message, "no partition")
}

// found checks that an UPDATE met every row it named.
func found(rows int64, want int) error {
	if rows != int64(want) {
		return fmt.Errorf("%w: an update met %d rows of %d", errStale, rows, want)
	}
	return nil
}

// reconcile runs the rollup reconciliation alone (for Sweep).
func reconcile(ctx context.Context, tx pgx.Tx, keys []invKey) error {
	projects, ids := splitKeys(keys)
	rows, err := tx.Query(ctx, sqlReconcile, projects, ids)
	if err != nil {
		return err
	}
	var empty rollupKeys
	if err := empty.collect(rows); err != nil {
		return err
	}
	if len(empty.project) > 0 {
		_, err = tx.Exec(ctx, sqlDropEmptyRollups, empty.project, empty.hour)
	}
	return err
}

// rollupKeys collects the rollup rows that a reconciliation left empty.
type rollupKeys struct {
	project []string
	hour    []pgtype.Timestamptz
}

func (k *rollupKeys) collect(rows pgx.Rows) error {
	var (
		project string
		hour    pgtype.Timestamptz
		builds  int64
	)
	_, err := pgx.ForEachRow(rows, []any{&project, &hour, &builds}, func() error {
		if builds == 0 {
			k.project = append(k.project, project)
			k.hour = append(k.hour, hour)
		}
		return nil
	})
	return err
}

// Column builders: one slice per unnest() argument.

type invCols struct {
	id, buildID, project, command, patterns, user, host, workspace, version []string
	startedAt, finishedAt                                                   []pgtype.Timestamptz
	exitCode                                                                []pgtype.Int4
	exitName, result                                                        []string
	firstAt, lastAt                                                         []pgtype.Timestamptz
	lastSeq, count                                                          []int64
	done                                                                    []bool
	buildKey                                                                []int64
}

func (c *invCols) add(v *inv) {
	c.id = append(c.id, v.key.id)
	c.buildID = append(c.buildID, v.buildID)
	c.project = append(c.project, v.key.project)
	c.command = append(c.command, v.command)
	c.patterns = append(c.patterns, joinList(v.patterns))
	c.user = append(c.user, v.user)
	c.host = append(c.host, v.host)
	c.workspace = append(c.workspace, v.workspace)
	c.version = append(c.version, v.version)
	c.startedAt = append(c.startedAt, pgtype.Timestamptz{Time: v.startedAt, Valid: !v.startedAt.IsZero()})
	c.finishedAt = append(c.finishedAt, pgtype.Timestamptz{Time: v.finishedAt, Valid: !v.finishedAt.IsZero()})
	c.exitCode = append(c.exitCode, pgtype.Int4{Int32: v.exitCode, Valid: v.hasExit})
	c.exitName = append(c.exitName, v.exitName)
	c.result = append(c.result, v.result)
	c.firstAt = append(c.firstAt, pgtype.Timestamptz{Time: v.firstAt, Valid: true})
	c.lastAt = append(c.lastAt, pgtype.Timestamptz{Time: v.lastAt, Valid: true})
	c.lastSeq = append(c.lastSeq, max(v.maxSeq, v.storedSeq))
	c.count = append(c.count, v.count)
	c.done = append(c.done, v.done)
	c.buildKey = append(c.buildKey, v.buildKey) // 0 for a stored build: the update keeps its own
}

func (c *invCols) args() []any {
	return []any{c.id, c.buildID, c.project, c.command, c.patterns, c.user, c.host, c.workspace,
		c.version, c.startedAt, c.finishedAt, c.exitCode, c.exitName, c.result, c.firstAt, c.lastAt,
		c.lastSeq, c.count, c.done, c.buildKey}
}

type progressCols struct {
	id, project, buildID      []string
	firstAt, lastAt           []pgtype.Timestamptz
	lastSeq, count, storedSeq []int64
}

func (c *progressCols) add(v *inv) {
	c.id = append(c.id, v.key.id)
	c.project = append(c.project, v.key.project)
	c.buildID = append(c.buildID, v.buildID)
	c.firstAt = append(c.firstAt, pgtype.Timestamptz{Time: v.firstAt, Valid: true})
	c.lastAt = append(c.lastAt, pgtype.Timestamptz{Time: v.lastAt, Valid: true})
	c.lastSeq = append(c.lastSeq, max(v.maxSeq, v.storedSeq))
	c.count = append(c.count, v.count)
	c.storedSeq = append(c.storedSeq, v.storedSeq)
}

func (c *progressCols) args() []any {
	return []any{c.id, c.project, c.buildID, c.firstAt, c.lastAt, c.lastSeq, c.count, c.storedSeq}
}

type targetCols struct {
	key, label   []int64
	kind         []pgtype.Int4 // kindID; null: Bazel did not say
	reason, tags []string
	success      []pgtype.Bool
	rank         []int16
	hasTags      []bool
}

func (c *targetCols) add(v *inv, t *target, kinds *kindCols) {
	c.key = append(c.key, v.buildKey)
	c.label = append(c.label, t.id)
	c.kind = append(c.kind, kinds.add(t.kind))
	c.success = append(c.success, pgtype.Bool{Bool: t.success > 0, Valid: t.success != 0})
	c.reason = append(c.reason, t.reason)
	c.rank = append(c.rank, t.rank)
	c.hasTags = append(c.hasTags, t.hasTags)
	c.tags = append(c.tags, joinList(t.tags))
}

// row is target i as sqlUpdateTargets' targetRows makes it of the arrays:
// empty kind and reason are null, and tags are null unless an event set
// them, else the list as string_to_array splits the joined one; failed as
// sqlUpdateTargets sets it.
func (c *targetCols) row(i int) []any {
	var kind, reason, tags, failed any
	if c.success[i].Valid && !c.success[i].Bool {
		failed = true
	}
	if c.kind[i].Valid {
		kind = c.kind[i].Int32
	}
	if c.reason[i] != "" {
		reason = c.reason[i]
	}
	if c.hasTags[i] {
		tags = splitList(c.tags[i])
	}
	return []any{c.key[i], c.label[i], kind, c.success[i], reason, c.rank[i], tags, failed}
}

func (c *targetCols) args() []any {
	return []any{c.key, c.label, c.kind, c.success, c.reason, c.rank, c.hasTags, c.tags}
}

type testCols struct {
	key, label                                                  []int64
	status                                                      []string
	hasSummary                                                  []bool
	attempts, runCount, shardCount, totalRuns, results, nCached []int32
	duration                                                    []int64
}

func (c *testCols) add(v *inv, t *test) {
	c.key = append(c.key, v.buildKey)
	c.label = append(c.label, t.id)
	c.status = append(c.status, t.status)
	c.hasSummary = append(c.hasSummary, t.hasSummary)
	c.attempts = append(c.attempts, t.attempts)
	c.runCount = append(c.runCount, t.runCount)
	c.shardCount = append(c.shardCount, t.shardCount)
	c.totalRuns = append(c.totalRuns, t.totalRunCount)
	c.results = append(c.results, t.results)
	c.duration = append(c.duration, t.durationMs)
	c.nCached = append(c.nCached, t.numCached)
}

func (c *testCols) row(i int) []any {
	return []any{c.key[i], c.label[i], c.status[i], c.hasSummary[i], c.attempts[i], c.runCount[i],
		c.shardCount[i], c.totalRuns[i], c.results[i], c.duration[i], c.nCached[i]}
}

func (c *testCols) args() []any {
	return []any{c.key, c.label, c.status, c.hasSummary, c.attempts, c.runCount, c.shardCount,
		c.totalRuns, c.results, c.duration, c.nCached}
}

// kindCols are the kinds of the batch's targets, once each, for
// build_kinds.
type kindCols struct {
	id   []int32
	kind []string
}

// add records kind and returns its id (null for no kind).
func (c *kindCols) add(kind string) pgtype.Int4 {
	if kind == "" {
		return pgtype.Int4{}
	}
	id := kindID(kind)
	if !slices.Contains(c.id, id) {
		c.id, c.kind = append(c.id, id), append(c.kind, kind)
	}
	return pgtype.Int4{Int32: id, Valid: true}
}

// labelCols are the labels of the batch's new rows, once each.
type labelCols struct {
	seen           map[[2]string]bool
	project, label []string
	id             []int64
}

func (c *labelCols) add(project, label string, id int64) {
	k := [2]string{project, label}
	if c.seen[k] {
		return
	}
	if c.seen == nil {
		c.seen = make(map[[2]string]bool)
	}
	c.seen[k] = true
	c.project = append(c.project, project)
	c.label = append(c.label, label)
	c.id = append(c.id, id)
}

type metricCols struct {
	build []int64
	cols  [14][]int64
}

func (c *metricCols) add(v *inv) {
	m := v.metrics
	a, mem, tg, pk, tm := m.GetActionSummary(), m.GetMemoryMetrics(), m.GetTargetMetrics(), m.GetPackageMetrics(), m.GetTimingMetrics()
	c.build = append(c.build, v.buildKey)
	for i, x := range [14]int64{
		a.GetActionsCreated(), a.GetActionsExecuted(),
		int64(a.GetActionCacheStatistics().GetHits()), int64(a.GetActionCacheStatistics().GetMisses()),
		a.GetRemoteCacheHits(), tm.GetCpuTimeInMs(), tm.GetWallTimeInMs(),
		tm.GetAnalysisPhaseTimeInMs(), tm.GetExecutionPhaseTimeInMs(),
		mem.GetUsedHeapSizePostBuild(), mem.GetPeakPostGcHeapSize(), pk.GetPackagesLoaded(),
		tg.GetTargetsLoaded(), tg.GetTargetsConfigured(),
	} {
		c.cols[i] = append(c.cols[i], x)
	}
}

func (c *metricCols) args() []any {
	args := []any{c.build}
	for i := range c.cols {
		args = append(args, c.cols[i])
	}
	return args
}

// criticalCols are the builds whose BuildToolLogs named a critical path.
type criticalCols struct {
	build []int64
	ms    []int32
	steps []*string // null: Bazel listed none
}

type chunkCols struct {
	project, inv   []string
	seq            []int64
	stdout, stderr [][]byte
}

func (c *chunkCols) row(i int) []any {
	return []any{c.project[i], c.inv[i], c.seq[i], c.stdout[i], c.stderr[i]}
}

func (c *chunkCols) add(k invKey, v *inv) {
	c.project = append(c.project, k.project)
	c.inv = append(c.inv, k.id)
	c.seq = append(c.seq, v.outSeq)
	c.stdout = append(c.stdout, compressChunk(v.stdout))
	c.stderr = append(c.stderr, compressChunk(v.stderr))
}

// nullText is s, or null when empty.
func nullText(s string) *string {
	if s == "" {
		return nil
	}
	return &s
}
