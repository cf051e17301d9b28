package builds

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// Search's page sizes.
const (
	DefaultSearchRows = 50
	MaxSearchRows     = 200
)

// Statuses are the values of invocations.status, which SearchQuery.Status
// may name.
var Statuses = []string{"running", "succeeded", "failed", "abandoned"}

// TestStatuses are the values of a test's status (Bazel's TestStatus
// names), which PageQuery.Status may name.
var TestStatuses = []string{"PASSED", "FLAKY", "FAILED", "TIMEOUT", "INCOMPLETE", "REMOTE_FAILURE",
	"FAILED_TO_BUILD", "TOOL_HALTED_BEFORE_TESTING", "NO_STATUS"}

// The metadata keys a build's branch and commit are read from, first
// found first: what CI systems pass as --build_metadata, then the
// workspace status keys of a --workspace_status_command.
var (
	branchKeys = []string{"BRANCH", "BUILD_SCM_BRANCH", "STABLE_GIT_BRANCH"}
	commitKeys = []string{"COMMIT_SHA", "BUILD_SCM_REVISION", "STABLE_GIT_COMMIT"}
)

// SearchQuery selects builds for a list. Every field set narrows the
// list; the zero value lists every build, newest first.
type SearchQuery struct {
	// Projects are the projects the reader may see; nil: every project
	// (the caller decides who may see what).
	Projects []string
	Project  string
	Status   string // one of Statuses
	Command  string // build, test, run, ...
	User     string
	Host     string
	Branch   string // a value of one of branchKeys
	Commit   string // a value of one of commitKeys
	// From and To bound the build's first event: From <= it < To.
	From, To time.Time
	// Text is an invocation id, or the start of one, or part of a target
	// pattern the command named.
	Text string
	// Before is the Next of the previous page: builds older than it.
	Before string
	// Limit is the most builds returned: 0 means DefaultSearchRows, and
	// more than MaxSearchRows is MaxSearchRows.
	Limit int
}

// SearchPage is a page of builds, newest first, and the cursor of the next
// page ("": this is the last).
type SearchPage struct {
	Builds []Summary `json:"builds"`
	Next   string    `json:"next"`
}

// Validate reports a query Search would refuse, naming the field.
func (q SearchQuery) Validate() error {
	if q.Status != "" && !slices.Contains(Statuses, q.Status) {
		return fmt.Errorf("status %q is none of %s", q.Status, strings.Join(Statuses, ", "))
	}
	if q.Limit < 0 {
		return fmt.Errorf("limit %d is negative", q.Limit)
	}
	if !q.From.IsZero() && !q.To.IsZero() && !q.From.Before(q.To) {
		return fmt.Errorf("from %s is not before to %s", q.From.Format(time.RFC3339), q.To.Format(time.RFC3339))
	}
	if _, err := parseCursor(q.Before); err != nil {
		return err
	}
	return nil
}

// A cursor is the build key of the last build of a page, in decimal: the
// list is in build key order, which is the order of the builds' first
// events (migration 016), and keys are unique, so the next page is the
// keys below it whatever was added since.
func parseCursor(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("cursor %q is not one a page of builds gave", s)
	}
	return n, nil
}

// sqlSearchColumns are a Summary's columns of invocation i: its branch and
// commit from its metadata, its failed targets counted on the partial
// index of failed targets, its tests from what it counts in the rollups
// once finished (counted_tests_*), else counted.
const sqlSearchColumns = `i.build_key, i.id, i.project, i.status, coalesce(i.command, ''), coalesce(i.exit_code_name, ''),
    i.patterns, coalesce(i.user_name, ''), coalesce(i.host, ''), i.started_at, i.duration_ms,
    coalesce((select m.value from build_metadata m where m.build_key = i.build_key and m.key = any($1)
              order by array_position($1, m.key), m.source limit 1), ''),
    coalesce((select m.value from build_metadata m where m.build_key = i.build_key and m.key = any($2)
              order by array_position($2, m.key), m.source limit 1), ''),
    (select count(*) from all_targets t where t.build_key = i.build_key and t.failed),
    coalesce(i.counted_tests_passed, n.passed), coalesce(i.counted_tests_failed, n.failed),
    coalesce(i.counted_tests_flaky, n.flaky)`

// sqlSearchTests counts the tests of a build not counted yet (running):
// the condition on i alone gates the scan (a one-time filter).
const sqlSearchTests = `cross join lateral (
    select count(*) filter (where t.status = 'PASSED') as passed,
           count(*) filter (where t.status not in ('PASSED', 'FLAKY', 'NO_STATUS')) as failed,
           count(*) filter (where t.status = 'FLAKY') as flaky
    from all_tests t where i.counted_status is null and t.build_key = i.build_key) n`

// Search returns a page of the builds q selects, newest first. The list
// walks invocations in build key order (by project on
// invocations_project_key_idx, migration 022) and filters as it goes;
// branch and commit are found through build_metadata_lookup.
func Search(ctx context.Context, db Querier, q SearchQuery) (SearchPage, error) {
	if err := q.Validate(); err != nil {
		return SearchPage{}, err
	}
	limit := q.Limit
	switch {
	case limit == 0:
		limit = DefaultSearchRows
	case limit > MaxSearchRows:
		limit = MaxSearchRows
	}
	args := []any{branchKeys, commitKeys}
	arg := func(v any) string {
		args = append(args, v)
		return "$" + strconv.Itoa(len(args))
	}
	var where []string
	if q.Projects != nil {
		where = append(where, `i.project collate "C" = any(`+arg(q.Projects)+"::text[])")
	}
	for _, f := range []struct{ col, v string }{
		// collate "C": invocations_project_key_idx (migration 022).
		{`i.project collate "C"`, q.Project}, {"i.status", q.Status}, {"i.command", q.Command}, {"i.user_name", q.User}, {"i.host", q.Host},
	} {
		if f.v != "" {
			where = append(where, f.col+" = "+arg(f.v))
		}
	}
	for _, f := range []struct {
		keys []string
		v    string
	}{{branchKeys, q.Branch}, {commitKeys, q.Commit}} {
		if f.v != "" {
			// The builds of a value, on build_metadata_lookup's (key,
			// value, project) (migration 022); not correlated with i, which
			// PostgreSQL would run once per build.
			where = append(where, "i.build_key in (select m.build_key from build_metadata m where m.key = any("+
				arg(f.keys)+") and m.value = "+arg(f.v)+")")
		}
	}
	if !q.From.IsZero() {
		// The key's high bits are the day of the first event: a bound on
		// the index, then the exact time.
		where = append(where, "i.build_key >= "+arg(dayKey(q.From))+" and i.first_event_at >= "+arg(q.From))
	}
	if !q.To.IsZero() {
		where = append(where, "i.build_key < "+arg(dayKey(q.To.Add(24*time.Hour)))+" and i.first_event_at < "+arg(q.To))
	}
	if q.Text != "" {
		like := likeEscape(q.Text)
		where = append(where, "(i.id like "+arg(like+"%")+" or array_to_string(i.patterns, E'\\n') like "+arg("%"+like+"%")+")")
	}
	if before, _ := parseCursor(q.Before); before > 0 {
		where = append(where, "i.build_key < "+arg(before))
	}
	sql := "select " + sqlSearchColumns + " from invocations i " + sqlSearchTests
	if len(where) > 0 {
		sql += " where " + strings.Join(where, " and ")
	}
	sql += " order by i.build_key desc limit " + arg(limit+1)
	rows, err := db.Query(ctx, sql, args...)
	if err != nil {
		return SearchPage{}, fmt.Errorf("builds: search: %w", err)
	}
	var keys []int64
	list, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Summary, error) {
		b, key, err := scanSummary(r)
		keys = append(keys, key)
		return b, err
	})
	if err != nil {
		return SearchPage{}, fmt.Errorf("builds: search: %w", err)
	}
	page := SearchPage{Builds: list}
	if len(list) > limit {
		page.Builds = list[:limit]
		page.Next = strconv.FormatInt(keys[limit-1], 10)
	}
	if page.Builds == nil {
		page.Builds = []Summary{}
	}
	return page, nil
}

// scanSummary reads a row of sqlSearchColumns: the Summary and the build key.
func scanSummary(r pgx.Row) (Summary, int64, error) {
	var (
		b   Summary
		key int64
	)
	err := r.Scan(&key, &b.ID, &b.Project, &b.Status, &b.Command, &b.ExitName, &b.Patterns, &b.User, &b.Host,
		&b.Started, &b.DurationMs, &b.Branch, &b.Commit, &b.TargetsFailed, &b.TestsPassed, &b.TestsFailed, &b.TestsFlaky)
	if b.Started != nil {
		*b.Started = b.Started.UTC()
	}
	return b, key, err
}

// SummaryOf returns the Summary of one build, the row Search lists it
// with (a build page's counts), or ErrNotFound.
func SummaryOf(ctx context.Context, db Querier, project, invocationID string) (Summary, error) {
	b, _, err := scanSummary(db.QueryRow(ctx, "select "+sqlSearchColumns+" from invocations i "+sqlSearchTests+
		" where i.id = $3 and i.project = $4", branchKeys, commitKeys, invocationID, project))
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return b, ErrNotFound
	case err != nil:
		return b, fmt.Errorf("builds: summary of %s in project %s: %w", invocationID, project, err)
	}
	return b, nil
}

// dayKey is the least build key of t's UTC day (buildKey's high bits).
func dayKey(t time.Time) int64 { return buildKey(t, 0) }

// likeEscape makes s match itself in a LIKE pattern.
func likeEscape(s string) string {
	return strings.NewReplacer(`\`, `\\`, `%`, `\%`, `_`, `\_`).Replace(s)
}
