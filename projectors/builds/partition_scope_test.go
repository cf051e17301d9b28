package builds

import (
	"context"
	"fmt"
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

// invocationIn returns an invocation id of project in partition part.
func invocationIn(l subjects.BESLayout, project string, part int, prefix string) string {
	for i := 0; ; i++ {
		if id := fmt.Sprintf("%s-%d", prefix, i); l.Partition(project, id) == part {
			return id
		}
	}
}

// TestPartitionsShareTheTables: two partitions' projectors, each applying
// its own stream, write the rows one projector writes from both; a
// partition's sweep abandons only its own running builds; a partition's
// reset empties only its own builds, and what they counted in the
// rollups and test history, so that applying its stream again gives the
// whole projection back.
func TestPartitionsShareTheTables(t *testing.T) {
	l := subjects.BESLayout{Partitions: 2}
	streams := [2]*stream{newStream(t0), newStream(t0)}
	for part, s := range streams {
		synthBuild(s, "acme", invocationIn(l, "acme", part, "done"), 30, true)
		s.advance(time.Minute)
		synthBuild(s, "acme", invocationIn(l, "acme", part, "running"), 20, false)
	}
	base := newProjector(t, Config{})
	// The reference: the partitions applied the other way round, in other
	// batches. And one projector of every build: its build keys are
	// another layout's, so only what they do not name compares.
	whole, _ := testenv.Pool(t)
	applyAll(t, whole, base.ForPartition(l, 1), streams[1].msgs, 7)
	applyAll(t, whole, base.ForPartition(l, 0), streams[0].msgs, 13)
	single, _ := testenv.Pool(t)
	for _, s := range streams {
		applyAll(t, single, newProjector(t, Config{}), s.msgs, 25)
	}
	split, _ := testenv.Pool(t)
	parts := [2]*Projector{base.ForPartition(l, 0), base.ForPartition(l, 1)}
	for part, s := range streams {
		if got, want := parts[part].Name(), fmt.Sprintf("builds_%d", part); got != want {
			t.Fatalf("partition %d's consumer: %q, want %q", part, got, want)
		}
		applyAll(t, split, parts[part], s.msgs, 25)
	}
	if d, w := digest(t, split), digest(t, whole); !maps.Equal(d, w) {
		t.Fatalf("two partitions' rows depend on the order they were applied in:\n%v\n%v", d, w)
	}
	d, w := digest(t, split), digest(t, single)
	for _, table := range []string{"hourly_rollups", "test_daily", "build_output_pages"} {
		if d[table] != w[table] {
			t.Errorf("%s of two partitions differs from one projector's", table)
		}
	}
	var keys, distinct int
	if err := split.QueryRow(context.Background(), `select count(*), count(distinct build_key) from invocations`).Scan(&keys, &distinct); err != nil || distinct != 4 || keys != 4 {
		t.Fatalf("%d builds, %d build keys (%v): two partitions' builds that start at one sequence must not share a key", keys, distinct, err)
	}

	// Partition 0's sweep, a day on: its running build is abandoned,
	// partition 1's is not (partition 1's runner would hold it in its cache).
	later := t0.Add(24 * time.Hour)
	sweep(t, split, parts[0], later)
	if got := statuses(t, split); !slices.Equal(got, []string{
		"done/0 failed", "done/1 failed", "running/0 abandoned", "running/1 running"}) {
		t.Fatalf("after partition 0's sweep: %v", got)
	}
	sweep(t, split, parts[1], later)
	sweep(t, whole, base.ForPartition(l, 0), later)
	sweep(t, whole, base.ForPartition(l, 1), later)
	if d, w := digest(t, split), digest(t, whole); !maps.Equal(d, w) {
		t.Fatalf("after both sweeps the rows differ from one projector's:\n%v\n%v", d, w)
	}

	// Partition 1's reset leaves partition 0's builds and what they count;
	// its stream applied again gives every row back.
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, split, func(tx pgx.Tx) error { return parts[1].Reset(ctx, tx) }); err != nil {
		t.Fatal(err)
	}
	if got := statuses(t, split); !slices.Equal(got, []string{"done/0 failed", "running/0 abandoned"}) {
		t.Fatalf("after partition 1's reset: %v", got)
	}
	only0, _ := testenv.Pool(t)
	applyAll(t, only0, base.ForPartition(l, 0), streams[0].msgs, 25)
	sweep(t, only0, base.ForPartition(l, 0), later)
	if d, w := digest(t, split), digest(t, only0); !maps.Equal(d, w) {
		t.Fatalf("after partition 1's reset the rows differ from partition 0's alone:\n%v\n%v", d, w)
	}
	applyAll(t, split, parts[1], streams[1].msgs, 25)
	sweep(t, split, parts[1], later)
	if d, w := digest(t, split), digest(t, whole); !maps.Equal(d, w) {
		t.Fatalf("partition 1 replayed: the rows differ from one projector's:\n%v\n%v", d, w)
	}
}

// statuses are the builds' statuses as "<kind>/<partition> <status>".
func statuses(t *testing.T, pool *pgxpool.Pool) []string {
	t.Helper()
	l := subjects.BESLayout{Partitions: 2}
	rows, err := pool.Query(context.Background(), `select project, id, status from invocations`)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	var project, id, status string
	if _, err := pgx.ForEachRow(rows, []any{&project, &id, &status}, func() error {
		kind, _, _ := strings.Cut(id, "-")
		out = append(out, fmt.Sprintf("%s/%d %s", kind, l.Partition(project, id), status))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}
