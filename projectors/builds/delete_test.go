package builds

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/internal/testenv"
)

// DeleteBuilds forgets a build: its rows and its count in the rollups, and
// nothing of another project's build of the same id; a build whose rollup
// row had already gone by the rollup retention leaves no negative row.
func TestDeleteBuildsForgetsThemInTheRollups(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	synthBuild(s, "acme", "inv-a", 20, true)
	synthBuild(s, "beta", "inv-a", 20, true)
	s.advance(3 * time.Hour)
	synthBuild(s, "acme", "inv-b", 20, true)
	applyAll(t, pool, p, s.msgs, 40)
	del := func(ids ...string) int {
		t.Helper()
		var n int
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) (err error) { n, err = DeleteBuilds(ctx, tx, "acme", ids); return err })
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	if n := del("inv-a"); n != 1 {
		t.Fatalf("deleted %d builds", n)
	}
	if n := rowsOf(t, pool, Key{"acme", "inv-a"}); n != 0 {
		t.Fatalf("acme/inv-a keeps %d rows", n)
	}
	if rows, builds := rollupBuilds(t, pool, "acme"); rows != 1 || builds != 1 {
		t.Fatalf("acme's rollups: %d rows counting %d builds, want inv-b's only", rows, builds)
	}
	if n := rowsOf(t, pool, Key{"beta", "inv-a"}); n == 0 {
		t.Fatal("beta/inv-a deleted with acme's")
	}
	if _, builds := rollupBuilds(t, pool, "beta"); builds != 1 {
		t.Fatalf("beta's rollups count %d builds", builds)
	}
	// inv-b's hour gone by the rollup retention, then inv-b deleted.
	if _, err := pool.Exec(ctx, "delete from hourly_rollups where project = 'acme'"); err != nil {
		t.Fatal(err)
	}
	del("inv-b")
	if rows, builds := rollupBuilds(t, pool, "acme"); rows != 0 {
		t.Fatalf("acme's rollups after forgetting a build whose row had gone: %d rows counting %d", rows, builds)
	}
}
