package builds

import (
	"context"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/testenv"
)

// The projector names labels and failures by ids it computes itself; the
// migration and readers compute them in SQL. Both must agree, or a row
// written by one is not found by the other.
func TestIDsAgreeWithSQL(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	for _, l := range []string{"//a:b", "", "//pkg/ü:t 1", "@repo//x:y"} {
		var got int64
		if err := pool.QueryRow(ctx, `select build_label_id($1)`, l).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != labelID(l) {
			t.Errorf("build_label_id(%q) = %d, labelID %d", l, got, labelID(l))
		}
	}
	for _, kind := range []string{"genrule rule", "sh_test rule", "ü"} {
		var got int32
		if err := pool.QueryRow(ctx, `select build_kind_id($1)`, kind).Scan(&got); err != nil {
			t.Fatal(err)
		}
		if got != kindID(kind) {
			t.Errorf("build_kind_id(%q) = %d, kindID %d", kind, got, kindID(kind))
		}
	}
	k := causeKey{kind: causeAction, label: "//a:b", output: "bazel-out/k8/bin/a/b.txt", config: "aa3a58c4"}
	var got int64
	if err := pool.QueryRow(ctx, `select build_failure_id($1, $2, $3, $4)`, k.kind, k.label, k.output, k.config).Scan(&got); err != nil {
		t.Fatal(err)
	}
	if got != k.id() {
		t.Errorf("build_failure_id = %d, causeKey.id %d", got, k.id())
	}
}

// Build keys grow with the day of the first message and, within a day,
// with its stream sequence; the week of a key is its partition's.
func TestBuildKeysGrowWithTime(t *testing.T) {
	day := time.Date(2026, 12, 2, 10, 0, 0, 0, time.UTC)
	a, b := buildKey(day, 900), buildKey(day.Add(time.Hour), 901)
	c := buildKey(day.Add(24*time.Hour), 5)
	if !(a < b && b < c) {
		t.Fatalf("keys %d, %d, %d do not grow with time", a, b, c)
	}
	if w := keyWeek(a); !weekStart(w).After(day.Add(-7*24*time.Hour)) || weekStart(w).After(day) || weekStart(w+1).Before(day) {
		t.Fatalf("week %d starts %v, not the week of %v", w, weekStart(w), day)
	}
	if buildKey(time.Unix(-5, 0), 1) != 1 {
		t.Fatal("a time before 1970 is not day 0")
	}
}
