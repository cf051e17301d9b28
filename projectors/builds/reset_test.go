package builds

import (
	"context"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/subjects"
)

// ResetExcept keeps the builds it is told to keep, rows and rollups, and
// takes away from the rollups only what the builds it empties counted: the
// count of a build whose rows were already gone (retention) survives, and
// applying the emptied builds again gives back the rollups of the live run.
func TestResetExceptKeepsBuildsAndRollupsOfRowsGone(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	synthBuild(s, "acme", "inv-a", 30, true)
	s.advance(2 * time.Hour)
	synthBuild(s, "acme", "inv-b", 30, true)
	s.advance(2 * time.Hour)
	synthBuild(s, "beta", "inv-c", 30, true)
	applyAll(t, pool, p, s.msgs, 50)
	live := digest(t, pool)
	// Retention deletes inv-c's rows; its rollup stays.
	deleteRows(t, pool, Key{"beta", "inv-c"})
	kept := digest(t, pool)
	if kept["hourly_rollups"] != live["hourly_rollups"] {
		t.Fatal("deleting rows changed the rollups")
	}

	resetExcept(t, pool, p, Key{"acme", "inv-a"})
	if ids := invocationIDs(t, pool); strings.Join(ids, ",") != "acme/inv-a" {
		t.Fatalf("after ResetExcept(inv-a): invocations %v", ids)
	}
	var hours []string
	rows, _ := pool.Query(ctx, "select project || ' ' || to_char(hour at time zone 'UTC', 'HH24') || ' ' || builds from hourly_rollups order by 1")
	hours, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	if len(hours) != 2 || !strings.HasPrefix(hours[0], "acme ") || !strings.HasPrefix(hours[1], "beta ") {
		t.Fatalf("rollups after ResetExcept: %v, want inv-a's hour and inv-c's (whose rows are gone)", hours)
	}
	// Applying inv-b again restores the live run's projection.
	applyAll(t, pool, p, messagesOf(s, "acme", "inv-b"), 50)
	if got := digest(t, pool); !equalDigests(got, kept) {
		t.Fatalf("after re-applying inv-b:\n got %v\nwant %v", got, kept)
	}

	// Reset empties every build's rows and keeps the count of inv-c.
	resetExcept(t, pool, p)
	if ids := invocationIDs(t, pool); len(ids) != 0 {
		t.Fatalf("after Reset: invocations %v", ids)
	}
	var builds int
	if err := pool.QueryRow(ctx, "select coalesce(sum(builds), 0) from hourly_rollups where project = 'beta'").Scan(&builds); err != nil || builds != 1 {
		t.Fatalf("beta's rollup after Reset counts %d builds (%v), want inv-c's 1", builds, err)
	}
	var others int
	if err := pool.QueryRow(ctx, "select count(*) from hourly_rollups where project <> 'beta'").Scan(&others); err != nil || others != 0 {
		t.Fatalf("%d rollup rows of emptied builds after Reset (%v)", others, err)
	}
}

func resetExcept(t *testing.T, pool *pgxpool.Pool, p *Projector, keep ...Key) {
	t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.ResetExcept(ctx, tx, keep) }); err != nil {
		t.Fatal(err)
	}
}

func deleteRows(t *testing.T, pool *pgxpool.Pool, k Key) {
	t.Helper()
	// The invocation last: the other tables find the build by its key.
	tables := slices.Sorted(maps.Keys(rowTables))
	tables = append(slices.DeleteFunc(tables, func(t string) bool { return t == "invocations" }), "invocations")
	for _, table := range tables {
		if _, err := pool.Exec(context.Background(), "delete from "+table+" where "+ofBuild(table), k.Project, k.ID); err != nil {
			t.Fatal(err)
		}
	}
}

func invocationIDs(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	rows, _ := pool.Query(context.Background(), "select project || '/' || id from invocations order by 1")
	ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func messagesOf(s *stream, project, inv string) []*msg {
	subj := subjects.BES(project, inv)
	var out []*msg
	for _, m := range s.msgs {
		if m.subject == subj {
			out = append(out, m)
		}
	}
	return out
}

func equalDigests(a, b map[string]string) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}
