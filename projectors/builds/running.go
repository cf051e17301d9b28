package builds

import (
	"cmp"
	"context"
	"slices"

	"github.com/jackc/pgx/v5"
)

// The target and test rows of a running build live in targets_running and
// tests_running; those of a finished build in targets and tests, written
// there once (migrations/020_builds_running.sql says why). The place of a
// build's rows follows from its invocation's status alone: running, or
// not. The batch that ends a build (its BuildFinished or attempt result)
// moves its rows, sorted by label id, in the statements after its updates
// (sqlFinishTargets); the sweep moves those of the builds it abandons. A
// build that begins and ends in one batch has its rows COPYed into targets
// and tests directly. Readers name the views all_targets and all_tests.

// A place is one of the two tables of targets (and of tests).
type place int

const (
	placeFinished place = iota // targets, tests
	placeRunning               // targets_running, tests_running
	places
)

var (
	targetTables = [places]string{"targets", "targets_running"}
	testTables   = [places]string{"tests", "tests_running"}
)

// place returns where v's stored rows are, which is where the batch's new
// rows of v go too, and queues the move of its running rows when the batch
// ends it.
// A build is running until an event gives its exit code or its attempt's
// result; an abandoned one is not (the sweep moved its rows), and stays
// not running whatever comes after.
func (w *writes) place(v *inv) place {
	wasRunning := !v.stored || v.storedStatus == "running"
	if !wasRunning {
		return placeFinished
	}
	ends := v.hasExit || v.result != ""
	switch {
	case !ends:
		return placeRunning
	case v.stored:
		// Its rows so far are running rows: the new ones join them, and
		// all move together, in one sorted run, into its week's partition,
		// which the batch makes should it be missing (ensurePartitions).
		w.finish = append(w.finish, v.buildKey)
		w.addWeek(v.buildKey)
		return placeRunning
	default:
		return placeFinished
	}
}

// sqlFinishTargets and sqlFinishTests move the rows of the builds $1 (build
// keys) from the running tables into targets and tests, in the primary
// key's order.
const sqlFinishTargets = `
with moved as (
    delete from targets_running t using unnest($1::int8[]) as u(build_key)
    where t.build_key = u.build_key
    returning t.build_key, t.label_id, t.failure_rank, t.success, t.failed, t.failure_reason, t.tags, t.kind_id)
insert into targets (build_key, label_id, failure_rank, success, failed, failure_reason, tags, kind_id)
select * from moved order by build_key, label_id`

const sqlFinishTests = `
with moved as (
    delete from tests_running t using unnest($1::int8[]) as u(build_key)
    where t.build_key = u.build_key
    returning t.build_key, t.label_id, t.duration_ms, t.attempts, t.run_count, t.shard_count,
              t.total_run_count, t.results, t.num_cached, t.has_summary, t.status)
insert into tests (build_key, label_id, duration_ms, attempts, run_count, shard_count, total_run_count,
    results, num_cached, has_summary, status)
select * from moved order by build_key, label_id`

// finishRunning moves the rows of the builds keys out of the running
// tables (for the sweep).
func finishRunning(ctx context.Context, tx pgx.Tx, keys []int64) error {
	if len(keys) == 0 {
		return nil
	}
	b := &pgx.Batch{}
	queueFinish(b, keys)
	queueFlags(b, keys)
	return tx.SendBatch(ctx, b).Close()
}

// queueFinish adds to b the move of the builds keys' running rows, and
// what their tests rows count to test_daily (testhistory.go).
func queueFinish(b *pgx.Batch, keys []int64) {
	b.Queue(sqlFinishTargets, keys)
	b.Queue(sqlFinishTests, keys)
	b.Queue(sqlCountRows, keys, []int64(nil), []int64(nil), 1)
}

// keyOrder returns the indexes of rows (build key, label id) in the
// primary key's order.
func keyOrder(keys, labels []int64) []int {
	order := make([]int, len(keys))
	for i := range order {
		order[i] = i
	}
	slices.SortFunc(order, func(a, b int) int {
		return cmp.Or(cmp.Compare(keys[a], keys[b]), cmp.Compare(labels[a], labels[b]))
	})
	return order
}
