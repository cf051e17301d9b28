package builds

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrNotFound is returned by Show and Output for a build (project and
// invocation id) that the projection does not know.
var ErrNotFound = errors.New("builds: invocation not found")

// Querier is what the read side needs of a database handle; *pgxpool.Pool,
// *pgx.Conn and pgx.Tx all have it.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Build is the projection of one invocation, as `millrace builds show <id>
// --json` prints it. The JSON names are a contract (README.md and
// docs/design.md, "Contracts").
// A build is identified by Project and ID together: two projects may send
// the same invocation id.
type Build struct {
	ID     string `json:"id"`
	Status string `json:"status"` // running, succeeded, failed or abandoned
	// ExitCode and ExitCodeName are Bazel's (BuildFinished.exit_code); null
	// until Bazel reported them.
	ExitCode     *int32  `json:"exit_code"`
	ExitCodeName *string `json:"exit_code_name"`
	Project      string  `json:"project"`
	Command      *string `json:"command"`
	// Patterns are the target patterns of the command (empty before
	// Bazel sent them); BazelVersion is BuildStarted's build tool version.
	Patterns     []string   `json:"patterns"`
	BazelVersion *string    `json:"bazel_version"`
	StartedAt    *time.Time `json:"started_at"`
	FinishedAt   *time.Time `json:"finished_at"`
	DurationMs   *int64     `json:"duration_ms"`
	Targets      []Target   `json:"targets"` // sorted by label
	Tests        []Test     `json:"tests"`   // sorted by label
	Metrics      *Metrics   `json:"metrics"` // null until BuildMetrics came
	// User and Host are the workspace status keys BUILD_USER and BUILD_HOST.
	User *string `json:"user"`
	Host *string `json:"host"`
	// BuildMetadata are the --build_metadata entries (COMMIT_SHA, BRANCH,
	// ROLE, ...); WorkspaceStatus every workspace status key, sorted.
	BuildMetadata   map[string]string `json:"build_metadata"`
	WorkspaceStatus []StatusItem      `json:"workspace_status"`
	// CommandLine is the canonical command line (null until Bazel sent
	// it); CommandLines it and the options given explicitly, by source
	// and label. Both as the edge stored them: redacted.
	CommandLine  []string      `json:"command_line"`
	CommandLines []CommandLine `json:"command_lines"`
}

// Target is one target of a build.
type Target struct {
	Label   string `json:"label"`
	Kind    string `json:"kind"` // e.g. "genrule rule"; "" if Bazel did not say
	Success bool   `json:"success"`
	// FailureReason is the target's own failure (its failure detail, an
	// Aborted event or its failed action); null for a target that failed
	// only because a dependency did: RootCauses names what did.
	FailureReason *string `json:"failure_reason"`
	// RootCauses are what Bazel named as the causes of the target's
	// failure (the target itself when its own action failed); empty for a
	// target that did not fail.
	RootCauses []Cause `json:"root_causes"`
}

// Test is one test target's outcome.
type Test struct {
	Label string `json:"label"`
	// Status is Bazel's TestStatus name: PASSED, FLAKY, TIMEOUT, FAILED,
	// INCOMPLETE, REMOTE_FAILURE, FAILED_TO_BUILD,
	// TOOL_HALTED_BEFORE_TESTING or NO_STATUS.
	Status   string `json:"status"`
	Attempts int32  `json:"attempts"`
	// Shards is the test's shard count as Bazel reported it: 1 for a test
	// that is not sharded (0 before its summary came).
	Shards     int32 `json:"shards"`
	DurationMs int64 `json:"duration_ms"`
	Cached     bool  `json:"cached"`
}

// Metrics are Bazel's BuildMetrics of the invocation.
type Metrics struct {
	ActionsCreated        int64 `json:"actions_created"`
	ActionsExecuted       int64 `json:"actions_executed"`
	ActionCacheHits       int64 `json:"action_cache_hits"`
	ActionCacheMisses     int64 `json:"action_cache_misses"`
	RemoteCacheHits       int64 `json:"remote_cache_hits"`
	CPUTimeMs             int64 `json:"cpu_time_ms"`
	WallTimeMs            int64 `json:"wall_time_ms"`
	AnalysisPhaseMs       int64 `json:"analysis_phase_ms"`
	ExecutionPhaseMs      int64 `json:"execution_phase_ms"`
	UsedHeapSizePostBuild int64 `json:"used_heap_size_post_build"`
	PeakPostGCHeapSize    int64 `json:"peak_post_gc_heap_size"`
	PackagesLoaded        int64 `json:"packages_loaded"`
	TargetsLoaded         int64 `json:"targets_loaded"`
	TargetsConfigured     int64 `json:"targets_configured"`
	// CriticalPathMs is the critical path's length, from BuildToolLogs
	// (null where Bazel named none), CriticalPath its longest steps (at
	// most 5) in the path's order.
	CriticalPathMs *int64         `json:"critical_path_ms"`
	CriticalPath   []CriticalStep `json:"critical_path,omitempty"`
}

// CriticalStep is a step of the critical path: how long it took, and what
// Bazel called it (an action by its description, "Testing //a:b"; others
// as written, "runfiles for //a:b").
type CriticalStep struct {
	Ms   int64  `json:"ms"`
	What string `json:"what"`
}

// criticalSteps reads the steps as stored (parseCriticalPath).
func criticalSteps(s *string) []CriticalStep {
	if s == nil {
		return nil
	}
	var out []CriticalStep
	for line := range strings.Lines(*s) {
		ms, what, ok := strings.Cut(strings.TrimSuffix(line, "\n"), "\t")
		n, err := strconv.ParseInt(ms, 10, 64)
		if ok && err == nil {
			out = append(out, CriticalStep{Ms: n, What: what})
		}
	}
	return out
}

// Projects returns, sorted, the projects that hold a build with the given
// invocation id: none, one, or several when clients of different projects
// chose the same id (Bazel's --invocation_id).
func Projects(ctx context.Context, q Querier, invocationID string) ([]string, error) {
	rows, err := q.Query(ctx, `select project from invocations where id = $1 order by project collate "C"`, invocationID)
	if err != nil {
		return nil, fmt.Errorf("builds: projects of %s: %w", invocationID, err)
	}
	projects, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("builds: projects of %s: %w", invocationID, err)
	}
	return projects, nil
}

// Show returns the projection of the build of project with the given
// invocation id, or ErrNotFound. It holds the whole build: WriteJSON and
// the paged reads (pages.go) serve builds of any size.
func Show(ctx context.Context, q Querier, project, invocationID string) (*Build, error) {
	return show(ctx, q, project, invocationID, true)
}

// show is Show, with the targets and tests left empty unless rows.
func show(ctx context.Context, q Querier, project, invocationID string, rows bool) (*Build, error) {
	b := &Build{Targets: []Target{}, Tests: []Test{}}
	err := q.QueryRow(ctx, `
		select id, status, exit_code, exit_code_name, project, command, coalesce(patterns, '{}'), bazel_version,
		       started_at, finished_at, duration_ms, user_name, host
		from invocations where id = $1 and project = $2`, invocationID, project).Scan(
		&b.ID, &b.Status, &b.ExitCode, &b.ExitCodeName, &b.Project, &b.Command, &b.Patterns, &b.BazelVersion,
		&b.StartedAt, &b.FinishedAt, &b.DurationMs, &b.User, &b.Host)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("builds: show %s of project %s: %w", invocationID, project, err)
	}
	for _, t := range []*time.Time{b.StartedAt, b.FinishedAt} {
		if t != nil {
			*t = t.UTC()
		}
	}

	if rows {
		if err := showRows(ctx, q, b, project, invocationID); err != nil {
			return nil, err
		}
	}
	if err := b.readMetadata(ctx, q); err != nil {
		return nil, fmt.Errorf("builds: show %s of project %s: %w", invocationID, project, err)
	}

	var m Metrics
	var steps *string
	err = q.QueryRow(ctx, `
		select coalesce(actions_created, 0), coalesce(actions_executed, 0), coalesce(action_cache_hits, 0),
		       coalesce(action_cache_misses, 0), coalesce(remote_cache_hits, 0), coalesce(cpu_time_ms, 0),
		       coalesce(wall_time_ms, 0), coalesce(analysis_phase_ms, 0), coalesce(execution_phase_ms, 0),
		       coalesce(used_heap_size_post_build, 0), coalesce(peak_post_gc_heap_size, 0),
		       coalesce(packages_loaded, 0), coalesce(targets_loaded, 0), coalesce(targets_configured, 0),
		       critical_path_ms, critical_path
		from build_metrics where build_key = `+sqlBuildKey, invocationID, project).Scan(
		&m.ActionsCreated, &m.ActionsExecuted, &m.ActionCacheHits, &m.ActionCacheMisses,
		&m.RemoteCacheHits, &m.CPUTimeMs, &m.WallTimeMs, &m.AnalysisPhaseMs, &m.ExecutionPhaseMs,
		&m.UsedHeapSizePostBuild, &m.PeakPostGCHeapSize, &m.PackagesLoaded, &m.TargetsLoaded,
		&m.TargetsConfigured, &m.CriticalPathMs, &steps)
	switch {
	case err == nil:
		m.CriticalPath = criticalSteps(steps)
		b.Metrics = &m
	case !errors.Is(err, pgx.ErrNoRows):
		return nil, fmt.Errorf("builds: show %s metrics: %w", invocationID, err)
	}
	return b, nil
}

// sqlAllTargets reads every target of a build, with its root causes.
var sqlAllTargets = `select labels.label, ` + kindColumn("targets") + `, coalesce(success, false), failure_reason, ` + causesColumn + `
from all_targets targets join build_labels labels on labels.project = $2 and labels.id = targets.label_id
where targets.build_key = ` + sqlBuildKey + ` order by labels.label collate "C"`

// sqlAllTests reads every test of a build.
const sqlAllTests = `select l.label, t.status, t.attempts, t.shard_count, t.duration_ms, t.cached
from all_tests t join build_labels l on l.project = $2 and l.id = t.label_id
where t.build_key = ` + sqlBuildKey + ` order by l.label collate "C"`

// showRows reads all the build's targets and tests into b.
func showRows(ctx context.Context, q Querier, b *Build, project, invocationID string) error {
	rows, err := q.Query(ctx, sqlAllTargets, invocationID, project)
	if err != nil {
		return fmt.Errorf("builds: show %s targets: %w", invocationID, err)
	}
	var (
		t      Target
		causes []byte
	)
	if _, err := pgx.ForEachRow(rows, []any{&t.Label, &t.Kind, &t.Success, &t.FailureReason, &causes}, func() error {
		if err := t.setCauses(causes); err != nil {
			return err
		}
		b.Targets = append(b.Targets, t)
		return nil
	}); err != nil {
		return fmt.Errorf("builds: show %s targets: %w", invocationID, err)
	}

	rows, err = q.Query(ctx, sqlAllTests, invocationID, project)
	if err != nil {
		return fmt.Errorf("builds: show %s tests: %w", invocationID, err)
	}
	var ts Test
	if _, err := pgx.ForEachRow(rows, []any{&ts.Label, &ts.Status, &ts.Attempts, &ts.Shards, &ts.DurationMs, &ts.Cached}, func() error {
		b.Tests = append(b.Tests, ts)
		return nil
	}); err != nil {
		return fmt.Errorf("builds: show %s tests: %w", invocationID, err)
	}
	return nil
}

// Output returns the console output of the build of project with the given
// invocation id as Bazel printed it (the progress events' stdout and
// stderr, concatenated), whether or not the invocation has finished. It
// returns ErrNotFound for an unknown build.
func Output(ctx context.Context, q Querier, project, invocationID string) (stdout, stderr []byte, err error) {
	var exists bool
	if err := q.QueryRow(ctx, `select exists (select 1 from invocations where id = $1 and project = $2)`,
		invocationID, project).Scan(&exists); err != nil {
		return nil, nil, fmt.Errorf("builds: output %s of project %s: %w", invocationID, project, err)
	}
	if !exists {
		return nil, nil, ErrNotFound
	}
	stdout, stderr, err = readOutput(ctx, q, invKey{project, invocationID})
	if err != nil {
		return nil, nil, fmt.Errorf("builds: output %s of project %s: %w", invocationID, project, err)
	}
	return stdout, stderr, nil
}

// DigestTables are the tables that make up the projection, in the order
// Digest reports them. build_output_chunks (scratch whose rows depend on
// batch boundaries) and consumer_positions are not among them.
var DigestTables = []string{"invocations", "targets", "targets_running", "tests", "tests_running", "build_metrics", "build_output", "build_output_pages",
	"hourly_rollups", "build_metadata", "build_command_lines", "build_argv", "build_failures", "target_causes",
	"test_daily"}

var digestOrder = map[string]string{
	"invocations":         `id collate "C", project collate "C"`,
	"targets":             `build_key, label_id`,
	"tests":               `build_key, label_id`,
	"targets_running":     `build_key, label_id`,
	"tests_running":       `build_key, label_id`,
	"build_metrics":       `build_key`,
	"build_output":        `invocation_id collate "C", project collate "C"`,
	"build_output_pages":  `invocation_id collate "C", project collate "C", stream, page`,
	"hourly_rollups":      `project collate "C", hour`,
	"build_metadata":      `build_key, source collate "C", key collate "C"`,
	"build_command_lines": `build_key, source collate "C", label collate "C"`,
	"build_argv":          `project collate "C", hash`,
	"build_failures":      `build_key, id`,
	"target_causes":       `build_key, label_id, cause_id`,
	"test_daily":          `project collate "C", label_id, day`,
}

// Digest returns, per projection table, the md5 of all its rows (their text
// form, every column) in primary-key order. Two databases hold the same
// projection iff the digests are equal, which is how a replay is checked
// against the live run. Timestamps are rendered in the session's time zone:
// compare digests taken with the same TimeZone setting.
func Digest(ctx context.Context, q Querier) (map[string]string, error) {
	out := make(map[string]string, len(DigestTables))
	for _, table := range DigestTables {
		var sum string
		sql := fmt.Sprintf(`select md5(coalesce(string_agg(t::text, E'\n' order by %s), '')) from %s t`,
			digestOrder[table], table)
		if err := q.QueryRow(ctx, sql).Scan(&sum); err != nil {
			return nil, fmt.Errorf("builds: digest %s: %w", table, err)
		}
		out[table] = sum
	}
	return out, nil
}
