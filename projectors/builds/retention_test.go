package builds

import (
	"context"
	"strings"
	"testing"

	"github.com/millrace/millrace/internal/testenv"
)

func nDays(n int) *int { return &n }

// A project's overrides replace the defaults part by part, 0 takes a part
// back to the default, and every project with builds or an override is
// listed with its effective values.
func TestRetentionOverridesPerProject(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	synthBuild(s, "acme", "inv-a", 10, true)
	synthBuild(s, "beta", "inv-b", 10, true)
	applyAll(t, pool, p, s.msgs, 50)
	def := Retention{RawDays: 30, RowsDays: 90, RollupDays: 0}

	got, err := SetRetention(ctx, pool, def, "acme", RetentionSet{RawDays: nDays(7), RowsDays: nDays(14)})
	if err != nil {
		t.Fatal(err)
	}
	if want := (Retention{7, 14, 0}); got.Retention != want || got.Override != (Retention{7, 14, 0}) {
		t.Fatalf("acme after set: %+v, want effective %+v", got, want)
	}
	if _, err := SetRetention(ctx, pool, def, "gamma", RetentionSet{RollupDays: nDays(400)}); err != nil {
		t.Fatal(err)
	}
	ps, err := ListRetention(ctx, pool, def)
	if err != nil {
		t.Fatal(err)
	}
	want := []ProjectRetention{
		{Project: "acme", Retention: Retention{7, 14, 0}, Override: Retention{7, 14, 0}},
		{Project: "beta", Retention: def},
		{Project: "gamma", Retention: Retention{30, 90, 400}, Override: Retention{RollupDays: 400}},
	}
	if len(ps) != len(want) {
		t.Fatalf("projects: %+v, want %+v", ps, want)
	}
	for i := range want {
		if ps[i] != want[i] {
			t.Errorf("project %d: %+v, want %+v", i, ps[i], want[i])
		}
	}

	// 0 goes back to the default; a project with no override left has no row.
	if got, err = SetRetention(ctx, pool, def, "acme", RetentionSet{RowsDays: nDays(0)}); err != nil || got.Retention != (Retention{7, 90, 0}) {
		t.Fatalf("acme rows back to the default: %+v, %v", got, err)
	}
	if _, err = SetRetention(ctx, pool, def, "gamma", RetentionSet{RollupDays: nDays(0)}); err != nil {
		t.Fatal(err)
	}
	var n int
	if err := pool.QueryRow(ctx, "select count(*) from project_retention where project = 'gamma'").Scan(&n); err != nil || n != 0 {
		t.Fatalf("gamma's row after clearing its last override: %d rows, %v", n, err)
	}
	if got, err := SetOrListRetention(ctx, pool, def, "nobody", RetentionSet{}); err != nil || got[0].Retention != def {
		t.Fatalf("a project without builds: %+v, want the defaults", got)
	}
}

// Raw events may not outlive rows, nor rows the rollups: a set that would
// break the order is refused with a message that says so and changes
// nothing, bad values are refused, and a default changed after an override
// makes CheckRetention (what a deleting process runs at start) fail naming
// the project.
func TestRetentionRefusesRawOutlivingRows(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	def := Retention{RawDays: 30, RowsDays: 90}

	_, err := SetRetention(ctx, pool, def, "acme", RetentionSet{RowsDays: nDays(10)})
	if err == nil || !strings.Contains(err.Error(), "raw events kept 30 days outlive the rows kept 10 days") {
		t.Fatalf("rows shorter than raw: %v", err)
	}
	_, err = SetRetention(ctx, pool, def, "acme", RetentionSet{RawDays: nDays(120)})
	if err == nil || !strings.Contains(err.Error(), `project "acme": raw events kept 120 days outlive the rows kept 90 days`) {
		t.Fatalf("raw longer than rows: %v", err)
	}
	_, err = SetRetention(ctx, pool, Retention{RawDays: 30, RowsDays: 90, RollupDays: 365}, "acme", RetentionSet{RowsDays: nDays(400)})
	if err == nil || !strings.Contains(err.Error(), "rows kept 400 days outlive the rollups kept 365 days") {
		t.Fatalf("rows longer than rollups: %v", err)
	}
	_, err = SetRetention(ctx, pool, def, "acme", RetentionSet{RawDays: nDays(-1)})
	if err == nil || !strings.Contains(err.Error(), "--raw-days -1 is negative") {
		t.Fatalf("negative days: %v", err)
	}
	var n int
	if err := pool.QueryRow(ctx, "select count(*) from project_retention").Scan(&n); err != nil || n != 0 {
		t.Fatalf("refused sets wrote %d rows (%v)", n, err)
	}

	// Both at once may move together.
	if _, err := SetRetention(ctx, pool, def, "acme", RetentionSet{RawDays: nDays(3), RowsDays: nDays(10)}); err != nil {
		t.Fatal(err)
	}
	if err := CheckRetention(ctx, pool, def, 0); err != nil {
		t.Fatalf("check of a good setting: %v", err)
	}
	// Without a bucket, the stream keeps acme's raw events 30 days, past its 10 days of rows.
	err = CheckRetention(ctx, pool, def, 30)
	if err == nil || !strings.Contains(err.Error(), `project "acme"'s retention: raw events kept 30 days outlive the rows kept 10 days: the rows retention must be at least the raw one (or 0, for ever) (without a bucket`) {
		t.Fatalf("check without the archive's retention: %v", err)
	}
	err = CheckRetention(ctx, pool, Retention{RawDays: 5, RowsDays: 7, RollupDays: 8}, 0)
	if err == nil || !strings.Contains(err.Error(), `project "acme"'s retention: rows kept 10 days outlive the rollups kept 8 days`) {
		t.Fatalf("check after the rollup default fell under acme's rows: %v", err)
	}
	if _, err := (RetentionConfig{RowsDays: 7}).Defaults(30); err == nil || !strings.Contains(err.Error(), "the default retention: raw events kept 30 days outlive the rows kept 7 days") {
		t.Fatalf("defaults out of order: %v", err)
	}
	if _, err := (RetentionConfig{RowsDays: -1}).Defaults(30); err == nil || !strings.Contains(err.Error(), "--retention-days ($RETENTION_DAYS) -1 is negative") {
		t.Fatalf("negative default: %v", err)
	}
}
