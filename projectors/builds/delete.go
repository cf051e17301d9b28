package builds

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// sqlForget takes away from hourly_rollups what project's builds $2
// count there, as a replay's reset does for the builds it empties
// (sqlUncount).
var sqlForget = `
with delta as (
    select counted_project as project, counted_hour as hour, -1 as sign, counted_status as status,
           counted_duration_ms as duration_ms, counted_tests_passed as passed,
           counted_tests_failed as failed, counted_tests_flaky as flaky,
           coalesce(counted_cache_hits, 0) as hits, coalesce(counted_cache_misses, 0) as misses
    from invocations
    where project = $1 and id = any($2) and counted_status is not null
)
` + sqlRollupDelta

// DeleteBuilds deletes project's builds ids on request, in tx: every row
// of each, its archived_builds row, and what it counted in hourly_rollups
// (a rollup row left counting no build, or less, goes), so that the rollups forget
// it, unlike the retention's deletes. It returns how many of ids had rows.
// Another project's builds of the same ids are untouched.
func DeleteBuilds(ctx context.Context, tx pgx.Tx, project string, ids []string) (int, error) {
	var n int
	if err := tx.QueryRow(ctx, `select count(*) from invocations where project = $1 and id = any($2)`, project, ids).Scan(&n); err != nil {
		return 0, fmt.Errorf("builds: delete: %w", err)
	}
	if err := forget(ctx, tx, project, ids, "archived_builds"); err != nil {
		return 0, fmt.Errorf("builds: delete: %w", err)
	}
	return n, nil
}

// forget deletes project's builds ids, their rows in the extra tables
// (by invocation_id) and what they count in the rollups and the test
// history.
func forget(ctx context.Context, tx pgx.Tx, project string, ids []string, extra ...string) error {
	if _, err := tx.Exec(ctx, sqlForget, project, ids); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, sqlForgetTests, project, ids); err != nil {
		return err
	}
	// Below zero: the build's rollup row had gone by its own retention (an
	// hour's row may go before the rows of a build that ran long), and the
	// subtraction made a row of nothing but the build taken away.
	if _, err := tx.Exec(ctx, `delete from hourly_rollups where project = $1 and builds <= 0`, project); err != nil {
		return err
	}
	if _, err := tx.Exec(ctx, `delete from test_daily where project = $1 and runs <= 0`, project); err != nil {
		return err
	}
	return deleteBuilds(ctx, tx, project, ids, extra...)
}

// DeleteRows deletes project's build id on request (DeleteBuilds), or
// with id "" every build of project (DeleteProject, 100 builds to a
// transaction), calling progress with the builds deleted so far.
func DeleteRows(ctx context.Context, pool *pgxpool.Pool, project, id string, progress func(deleted int)) (n int, err error) {
	if id == "" {
		return DeleteProject(ctx, pool, project, 100, progress)
	}
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) {
		n, err = DeleteBuilds(ctx, tx, project, []string{id})
		return err
	})
	return n, err
}

// DeleteProject deletes every build of project (DeleteBuilds), batch
// builds to a transaction, calling progress with the total after each
// batch; then what is left of it: rollup rows of builds whose rows were
// already gone, archived_builds rows without a build, command lines no
// build names, and its retention overrides. It returns how many builds it
// deleted.
func DeleteProject(ctx context.Context, pool *pgxpool.Pool, project string, batch int, progress func(deleted int)) (int, error) {
	total := 0
	for {
		n := 0
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, `select id from invocations where project = $1 limit $2 for update`, project, batch)
			if err != nil {
				return err
			}
			ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
			if err != nil || len(ids) == 0 {
				return err
			}
			n, err = DeleteBuilds(ctx, tx, project, ids)
			return err
		})
		if err != nil {
			return total, fmt.Errorf("builds: delete project %s: %w", project, err)
		}
		if n == 0 {
			break
		}
		total += n
		if progress != nil {
			progress(total)
		}
	}
	if err := collectProjectArgv(ctx, pool, project, batch); err != nil {
		return total, fmt.Errorf("builds: delete project %s: %w", project, err)
	}
	for _, t := range []string{"hourly_rollups", "archived_builds", "project_retention", "build_labels"} {
		if _, err := pool.Exec(ctx, "delete from "+t+" where project = $1", project); err != nil {
			return total, fmt.Errorf("builds: delete project %s: %w", project, err)
		}
	}
	return total, nil
}
