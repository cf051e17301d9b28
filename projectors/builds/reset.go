package builds

import (
	"context"
	"fmt"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
)

// Key names one build: its project and invocation id.
type Key struct{ Project, ID string }

// Reset empties the projection so that a replay can build it again from
// the stream (projection.Resetter). TRUNCATE takes an exclusive lock, so
// readers wait for the replay's first commit rather than see half a table.
func (p *Projector) Reset(ctx context.Context, tx pgx.Tx) error {
	return p.ResetExcept(ctx, tx, nil)
}

// rowTables are the tables with a row set per build, and the column that
// names the build: its invocation id (with a project column beside it), or
// build_key for the tables partitioned by it (partitions.go);
// hourly_rollups is not one of them, nor build_argv (the argument arrays
// that build_command_lines rows name, shared by builds: emptied with them,
// or kept as far as kept rows name them).
var rowTables = map[string]string{
	"invocations": "id", "targets": "build_key", "tests": "build_key", "build_metrics": "build_key",
	"targets_running": "build_key", "tests_running": "build_key",
	"build_output": "invocation_id", "build_output_pages": "invocation_id", "build_output_chunks": "invocation_id",
	"build_metadata": "build_key", "build_command_lines": "build_key", "build_failures": "build_key",
	"target_causes": "build_key",
}

// byBuildKey reports whether table names its builds by build_key.
func byBuildKey(table string) bool { return rowTables[table] == "build_key" }

// ResetExcept empties the projection but for the builds in keep, whose raw
// events are gone (a replay could not build them again). The rollups are
// not emptied: what each emptied build counted (its counted_* columns) is
// taken away from them, so that they keep what builds without rows count
// (rollups outlive the rows they summarise, see RETENTION_DAYS), and the
// replay counts the rebuilt ones again. A rollup thus keeps any error the
// rows it was counted from no longer show: those rows are gone.
func (p *Projector) ResetExcept(ctx context.Context, tx pgx.Tx, keep []Key) error {
	p.cache.forget()
	reset := p.resetExcept
	if p.layout.Partitioned() {
		reset = p.resetPartition
	}
	if err := reset(ctx, tx, keep); err != nil {
		return fmt.Errorf("builds: reset: %w", err)
	}
	return nil
}

func (p *Projector) resetExcept(ctx context.Context, tx pgx.Tx, keep []Key) error {
	tables := make([]string, 0, len(rowTables))
	for t := range rowTables {
		tables = append(tables, t)
	}
	_, err := tx.Exec(ctx, `create temporary table builds_keep (project text, id text, build_key bigint, primary key (project, id)) on commit drop`)
	if err != nil {
		return err
	}
	if len(keep) > 0 {
		rows := make([][]any, len(keep))
		for i, k := range keep {
			rows[i] = []any{k.Project, k.ID}
		}
		if _, err := tx.CopyFrom(ctx, pgx.Identifier{"builds_keep"}, []string{"project", "id"}, pgx.CopyFromRows(rows)); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `update builds_keep k set build_key = i.build_key
			from invocations i where i.id = k.id and i.project = k.project`); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `create index on builds_keep (build_key)`); err != nil {
			return err
		}
	}
	if _, err := tx.Exec(ctx, sqlUncount); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "delete from hourly_rollups where builds = 0"); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, sqlUncountTests); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, "delete from test_daily where runs <= 0"); err != nil {
		return err
	}
	if len(keep) == 0 {
		_, err := tx.Exec(ctx, "truncate "+strings.Join(append(tables, "build_argv"), ", "))
		return err
	}
	for _, t := range tables {
		sql := fmt.Sprintf(`delete from %s t where not exists (select 1 from builds_keep k where k.project = t.project and k.id = t.%s)`, t, rowTables[t])
		if byBuildKey(t) {
			sql = fmt.Sprintf(`delete from %s t where not exists (select 1 from builds_keep k where k.build_key = t.build_key)`, t)
		}
		if _, err := tx.Exec(ctx, sql); err != nil {
			return err
		}
	}
	_, err = tx.Exec(ctx, `delete from build_argv a where not exists (
		select 1 from build_command_lines c where c.project = a.project and c.argv_hash = a.hash)`)
	return err
}

// sqlUncount takes away from hourly_rollups what every invocation not in
// builds_keep counts there.
var sqlUncount = `
with delta as (
    select counted_project as project, counted_hour as hour, -1 as sign, counted_status as status,
           counted_duration_ms as duration_ms, counted_tests_passed as passed,
           counted_tests_failed as failed, counted_tests_flaky as flaky,
           coalesce(counted_cache_hits, 0) as hits, coalesce(counted_cache_misses, 0) as misses
    from invocations i
    where counted_status is not null
      and not exists (select 1 from builds_keep k where k.project = i.project and k.id = i.id)
)
` + sqlRollupDelta

// resetPartition is ResetExcept for a partition's projector: it deletes
// its own builds but those in keep, each as DeleteBuilds would (their
// rows, and what they count in the rollups and the test history) but for
// its archived_builds row, which the replay reads. It names the builds it
// deletes rather than those it keeps, as resetExcept does: the other
// partitions' runners go on meanwhile, and a build one of them adds after
// this reset read the table must stay.
func (p *Projector) resetPartition(ctx context.Context, tx pgx.Tx, keep []Key) error {
	kept := make(map[invKey]bool, len(keep))
	for _, k := range keep {
		kept[invKey{k.Project, k.ID}] = true
	}
	rows, err := tx.Query(ctx, `select project, id from invocations`)
	if err != nil {
		return err
	}
	mine := map[string][]string{}
	var k invKey
	_, err = pgx.ForEachRow(rows, []any{&k.project, &k.id}, func() error {
		if p.owns(k) && !kept[k] {
			mine[k.project] = append(mine[k.project], k.id)
		}
		return nil
	})
	if err != nil {
		return err
	}
	const batch = 1000
	for project, ids := range mine {
		for chunk := range slices.Chunk(ids, batch) {
			if err := forget(ctx, tx, project, chunk); err != nil {
				return err
			}
		}
	}
	return nil
}
