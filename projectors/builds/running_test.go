package builds

import (
	"context"
	"maps"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/testenv"
)

// placedRows counts the rows of project's build inv in each of tables.
func placedRows(t *testing.T, pool *pgxpool.Pool, project, inv string, tables ...string) []int64 {
	t.Helper()
	out := make([]int64, len(tables))
	for i, table := range tables {
		err := pool.QueryRow(context.Background(), `select count(*) from `+table+` where build_key =
			(select build_key from invocations where project = $1 and id = $2)`, project, inv).Scan(&out[i])
		if err != nil {
			t.Fatal(err)
		}
	}
	return out
}

var placeTables = []string{"targets_running", "tests_running", "targets", "tests"}

// A running build's rows are in the running tables, where the reads find
// them; the batch that ends the build moves them, sorted by the primary
// key, into targets and tests; and the tables end as they do when the
// whole build comes in one batch (its rows written there directly).
func TestRunningBuildsRowsMoveWhenTheyEnd(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	running := newStream(t0)
	synthBuild(running, "acme", "inv-run", 40, false)
	whole := newStream(t0)
	synthBuild(whole, "acme", "inv-run", 40, true)
	// The unfinished build is the finished one's first events (the same
	// builder calls; their bytes may differ in the order of a protobuf map).
	msgs, cut := whole.msgs, len(running.msgs)
	if cut >= len(msgs) || msgs[cut-1].subject != running.msgs[cut-1].subject {
		t.Fatalf("the unfinished build (%d events) is not the beginning of the finished one (%d)", cut, len(msgs))
	}

	applyAll(t, pool, p, msgs, len(msgs))
	want := digest(t, pool)
	if got := placedRows(t, pool, "acme", "inv-run", placeTables...); !slices.Equal(got, []int64{0, 0, 40, 4}) {
		t.Fatalf("a build in one batch: rows (running targets, tests; targets, tests) %v, want [0 0 40 4]", got)
	}

	truncate(t, pool)
	applyAll(t, pool, p, msgs[:cut], 7)
	if got := placedRows(t, pool, "acme", "inv-run", placeTables...); !slices.Equal(got, []int64{40, 4, 0, 0}) {
		t.Fatalf("a running build: rows %v, want [40 4 0 0]", got)
	}
	c, err := CountRows(ctx, pool, "acme", "inv-run")
	if err != nil || c.Targets != 40 || c.Tests != 4 {
		t.Fatalf("counts of a running build: %+v (%v), want 40 targets and 4 tests", c, err)
	}
	page, err := Targets(ctx, pool, "acme", "inv-run", PageQuery{Limit: 5})
	if err != nil || len(page) != 5 || page[0].Label != "//pkg00:gen_000" {
		t.Fatalf("a page of a running build's targets: %v (%v)", page, err)
	}
	b, err := Show(ctx, pool, "acme", "inv-run")
	if err != nil || len(b.Targets) != 40 || len(b.Tests) != 4 {
		t.Fatalf("show of a running build: %v", err)
	}

	applyAll(t, pool, p, msgs[cut:], 3)
	if got := placedRows(t, pool, "acme", "inv-run", placeTables...); !slices.Equal(got, []int64{0, 0, 40, 4}) {
		t.Fatalf("a finished build: rows %v, want [0 0 40 4]", got)
	}
	// One sorted run: the heap holds the rows in the key's order.
	rows, err := pool.Query(ctx, `select label_id from targets order by ctid`)
	if err != nil {
		t.Fatal(err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
	if err != nil || !slices.IsSorted(ids) {
		t.Errorf("the finished build's targets, as written: sorted %v (%v)", slices.IsSorted(ids), err)
	}
	if got := digest(t, pool); !maps.Equal(got, want) {
		t.Errorf("the build in batches: digest\n got %v\nwant %v", got, want)
	}
}

// The sweep moves the rows of the builds it abandons, and a late event
// of an abandoned build writes to targets.
func TestAbandonedBuildsRowsMove(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := newProjector(t, Config{})
	s := newStream(t0)
	b := synthBuild(s, "acme", "inv-gone", 30, false)
	applyAll(t, pool, p, s.msgs, 10)
	if got := placedRows(t, pool, "acme", "inv-gone", placeTables...); !slices.Equal(got, []int64{30, 3, 0, 0}) {
		t.Fatalf("a running build: rows %v, want [30 3 0 0]", got)
	}
	sweep(t, pool, p, s.now.Add(24*time.Hour))
	if got := placedRows(t, pool, "acme", "inv-gone", placeTables...); !slices.Equal(got, []int64{0, 0, 30, 3}) {
		t.Fatalf("an abandoned build: rows %v, want [0 0 30 3]", got)
	}
	n := len(s.msgs)
	b.tool(configuredEv("//late:new", "genrule rule"))
	b.tool(completedEv("//pkg00:gen_000", false, "late failure"))
	applyAll(t, pool, p, s.msgs[n:], 10)
	if got := placedRows(t, pool, "acme", "inv-gone", placeTables...); !slices.Equal(got, []int64{0, 0, 31, 3}) {
		t.Fatalf("an abandoned build after late events: rows %v, want [0 0 31 3]", got)
	}
	var failed bool
	if err := pool.QueryRow(context.Background(), `select failed from targets where label_id = build_label_id('//pkg00:gen_000')`).Scan(&failed); err != nil || !failed {
		t.Fatalf("the late completion of an abandoned build's target: failed %v (%v), want true", failed, err)
	}
}

// A target whose own action failed keeps no copy of the action's message:
// its row has no reason text, and reads give the action's.
func TestOwnActionReasonKeptOnce(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	synthBuild(s, "acme", "inv-own", 40, true)
	applyAll(t, pool, p, s.msgs, 50)
	var texts int
	if err := pool.QueryRow(ctx, `select count(*) from all_targets where failure_reason is not null`).Scan(&texts); err != nil || texts != 0 {
		t.Fatalf("%d target rows keep a failure reason (%v), want 0: their actions' messages are in build_failures", texts, err)
	}
	b, err := Show(ctx, pool, "acme", "inv-own")
	if err != nil {
		t.Fatal(err)
	}
	var failed []string
	for _, tg := range b.Targets {
		if tg.Success {
			continue
		}
		want := "Executing genrule " + tg.Label + " failed: (Exit 1): bash failed: error executing command"
		if tg.FailureReason == nil || *tg.FailureReason != want {
			t.Errorf("%s: failure reason %v, want its action's message %q", tg.Label, tg.FailureReason, want)
		}
		failed = append(failed, tg.Label)
	}
	if len(failed) != 2 {
		t.Fatalf("failed targets %v, want the two genrules whose actions failed", failed)
	}
	page, err := Targets(ctx, pool, "acme", "inv-own", PageQuery{Failed: true})
	if err != nil || len(page) != 2 || page[0].FailureReason == nil || *page[0].FailureReason != *b.Targets[16].FailureReason {
		t.Fatalf("a page of failed targets: %+v (%v)", page, err)
	}
}

// A target's own action that no event has reported yet gives it no
// reason; a reported one gives its message, or what is known of it.
func TestOwnActionReasonOfAnUnreportedAction(t *testing.T) {
	for _, c := range []struct{ causes, want string }{
		{`[{"kind": "action", "label": "//a:b", "primary_output": "o", "configuration": "c"}]`, "<nil>"},
		{`[{"kind": "action", "label": "//a:b", "mnemonic": "Genrule", "exit_code": 2}]`, "Genrule failed: exit code 2"},
		{`[{"kind": "action", "label": "//a:b", "message": "boom"}]`, "boom"},
		{`[{"kind": "action", "label": "//dep:x", "message": "boom"}]`, "<nil>"},
	} {
		tg := Target{Label: "//a:b"}
		if err := tg.setCauses([]byte(c.causes)); err != nil {
			t.Fatal(err)
		}
		got := "<nil>"
		if tg.FailureReason != nil {
			got = *tg.FailureReason
		}
		if got != c.want {
			t.Errorf("causes %s: reason %q, want %q", c.causes, got, c.want)
		}
	}
}
