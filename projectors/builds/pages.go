package builds

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strconv"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/subjects"
)

// Paged reads: a build of a million events has hundreds of thousands of
// targets and tens of megabytes of output, so a reader asks for a page at a
// time. Each read is one query on an index of the build's rows: targets and
// tests by keyset (the rows after the last label shown, in label order),
// output by page number. Label order is the database's collation, the order
// of the primary key (byte order on a C or C.UTF-8 database, which is what
// `millrace dev` makes); Show and WriteJSON sort by byte order everywhere.

// Bounds of a page of targets or tests.
const (
	DefaultPageRows = 100
	MaxPageRows     = 1000
)

// PageQuery selects one page of a build's targets or tests.
type PageQuery struct {
	// After is the last label of the previous page; "" asks for the first.
	After string
	// Limit is the most rows returned: 0 means DefaultPageRows, and more
	// than MaxPageRows is MaxPageRows.
	Limit int
	// Failed (targets only) keeps only the targets that failed.
	Failed bool
	// Status (tests only) keeps only the tests with this TestStatus name.
	Status string
	// NotPassed (tests only) keeps only the tests whose status is not
	// PASSED (failed, flaky, timed out, ...): a build page's failures.
	NotPassed bool
}

func (p PageQuery) limit() int {
	switch {
	case p.Limit <= 0:
		return DefaultPageRows
	case p.Limit > MaxPageRows:
		return MaxPageRows
	}
	return p.Limit
}

// The queries of the paged reads, in label order (bytewise, collate "C").
// A row names its label by id; the text is in build_labels. How a page is
// read depends on the build's size (pageOf): a build of up to smallBuild
// rows has them read whole, joined with their labels and sorted (the
// primary key's range of the build, then build_labels' primary key); a
// larger one is read by walking the project's labels in order
// (build_labels_label_idx) a chunk at a time and probing the partition's
// primary key for each chunk's ids, so a page costs the same however
// large the build. PostgreSQL would choose between the two itself from
// its statistics, but right after a big build lands (build_labels not yet
// vacuumed, its index-only scans costed as heap reads) it sorts the
// whole build for every page: 1.3 s a page at 200,000 targets. Failed
// targets and tests of a status but PASSED are few, and read from the
// partial indexes targets_failed_idx and tests_status_idx
// (migrations/016_builds_compact.sql), whose predicates the queries
// repeat. Each query names its index in the plan
// (TestPagedReadsUseTheIndex). %[1]s is the table read: a finished
// build's (targets, tests), or both tables' view for a running build
// (pageOf).
var (
	targetColumns = kindColumn("t") + `, coalesce(t.success, false), t.failure_reason`
	testColumns   = `t.status, t.attempts, t.shard_count, t.duration_ms, t.cached`

	sqlTargetsSorted = `select l.label, ` + targetColumns + `
from %[1]s t join build_labels l on l.project = $2 and l.id = t.label_id
where t.build_key = $1 and l.label collate "C" > $3 order by l.label collate "C" limit $4`
	sqlFailedTargetsPage = `select l.label, ` + targetColumns + `
from %[1]s t join build_labels l on l.project = $2 and l.id = t.label_id
where t.build_key = $1 and t.failed and l.label collate "C" > $3 order by l.label collate "C" limit $4`
	sqlTestsSorted = `select l.label, ` + testColumns + `
from %[1]s t join build_labels l on l.project = $2 and l.id = t.label_id
where t.build_key = $1 and l.label collate "C" > $3 and ($5 = '' or t.status = $5)
order by l.label collate "C" limit $4`
	sqlTestsNotPassedPage = `select l.label, ` + testColumns + `
from %[1]s t join build_labels l on l.project = $2 and l.id = t.label_id
where t.build_key = $1 and ($5 = '' or t.status = $5) and t.status <> 'PASSED' and l.label collate "C" > $3
order by l.label collate "C" limit $4`

	// The walk of a large build: a chunk of the project's labels in
	// order, then the build's rows of those ids ($3: a status, or ''),
	// each probed by the primary key: the LIMIT keeps the subquery a
	// loop over the ids (a plain join may be planned as a scan of the
	// partition when one build fills it).
	sqlLabelChunk = `select id, label from build_labels
where project = $1 and label collate "C" > $2 order by label collate "C" limit $3`
	sqlTargetsOfLabels = `select t.* from unnest($2::int8[]) u(id) cross join lateral
    (select t.label_id::text, ` + targetColumns + ` from %[1]s t where t.build_key = $1 and t.label_id = u.id limit 1) t`
	sqlTestsOfLabels = `select t.* from unnest($2::int8[]) u(id) cross join lateral
    (select t.label_id::text, ` + testColumns + ` from %[1]s t
     where t.build_key = $1 and t.label_id = u.id and ($3 = '' or t.status = $3) limit 1) t`

	// sqlSmallBuild counts a build's rows up to one past smallBuild.
	sqlSmallBuild = `select count(*) from (select from %s where build_key = $1 limit $2) x`
)

// smallBuild is the most rows of a build read whole for a page.
const smallBuild = 5000

// Targets returns one page of the targets of the build of project with the
// given invocation id, in label order: all of them, or with q.Failed those
// whose completion failed (success false; a target still being built is
// not among them). An unknown build has no targets. A failed target comes
// with its root causes (one more query for the page's failed targets).
func Targets(ctx context.Context, db Querier, project, invocationID string, q PageQuery) ([]Target, error) {
	scan := func(rows pgx.Rows, label *string) (Target, error) {
		t := Target{}
		err := rows.Scan(label, &t.Kind, &t.Success, &t.FailureReason)
		return t, err
	}
	sorted, walk := sqlTargetsSorted, sqlTargetsOfLabels
	if q.Failed {
		sorted, walk = sqlFailedTargetsPage, ""
	}
	out, err := pageOf(ctx, db, "targets", project, invocationID, q, "", sorted, walk, scan)
	if err != nil {
		return nil, fmt.Errorf("builds: targets of %s in project %s: %w", invocationID, project, err)
	}
	ts := make([]Target, len(out))
	for i, r := range out {
		r.v.Label = r.label
		ts[i] = r.v
	}
	if err := pageCauses(ctx, db, project, invocationID, ts); err != nil {
		return nil, fmt.Errorf("builds: root causes of %s in project %s: %w", invocationID, project, err)
	}
	return ts, nil
}

// Tests returns one page of the tests of the build, in label order: all of
// them, or with q.Status those with that status (PASSED, FAILED, FLAKY, ...).
func Tests(ctx context.Context, db Querier, project, invocationID string, q PageQuery) ([]Test, error) {
	scan := func(rows pgx.Rows, label *string) (Test, error) {
		t := Test{}
		err := rows.Scan(label, &t.Status, &t.Attempts, &t.Shards, &t.DurationMs, &t.Cached)
		return t, err
	}
	sorted, walk := sqlTestsSorted, sqlTestsOfLabels
	if q.NotPassed && q.Status == "PASSED" {
		return []Test{}, nil
	}
	if q.NotPassed || q.Status != "" && q.Status != "PASSED" {
		sorted, walk = sqlTestsNotPassedPage, ""
	}
	out, err := pageOf(ctx, db, "tests", project, invocationID, q, q.Status, sorted, walk, scan)
	if err != nil {
		return nil, fmt.Errorf("builds: tests of %s in project %s: %w", invocationID, project, err)
	}
	ts := make([]Test, len(out))
	for i, r := range out {
		r.v.Label = r.label
		ts[i] = r.v
	}
	return ts, nil
}

// labeled is a row of a page and its label.
type labeled[T any] struct {
	label string
	v     T
}

// pageOf reads a page of a build's rows of table in label order: with the
// sorted query (args: build key, project, after, limit, and for tests the
// status) when walk
// is "" or the build has at most smallBuild rows, else by walking the
// project's labels and probing with walk (args: build key, ids, and for
// tests the status).
// scan reads a row's columns after its first (the label, or its id in a
// walk).
func pageOf[T any](ctx context.Context, db Querier, table, project, invocationID string, q PageQuery, status,
	sorted, walk string, scan func(pgx.Rows, *string) (T, error)) ([]labeled[T], error) {
	var (
		key     int64
		running bool
	)
	switch err := db.QueryRow(ctx, `select build_key, status = 'running' from invocations where id = $1 and project = $2`,
		invocationID, project).Scan(&key, &running); {
	case errors.Is(err, pgx.ErrNoRows):
		return nil, nil
	case err != nil:
		return nil, err
	}
	// A finished build's rows are in table, and stay there; a running
	// one's in the running table until the batch that ends it moves them,
	// maybe between two of these queries: both, through the view
	// (running.go).
	from := table
	if running {
		from = "all_" + table
	}
	sorted = fmt.Sprintf(sorted, from)
	if walk != "" {
		walk = fmt.Sprintf(walk, from)
	}
	limit := q.limit()
	if walk != "" {
		var n int
		if err := db.QueryRow(ctx, fmt.Sprintf(sqlSmallBuild, from), key, smallBuild+1).Scan(&n); err != nil {
			return nil, err
		}
		if n > smallBuild {
			args := []any{key}
			if table == "tests" {
				args = append(args, status)
			}
			return walkLabels(ctx, db, project, q.After, limit, walk, args, scan)
		}
	}
	args := []any{key, project, q.After, limit}
	if table == "tests" {
		args = append(args, status)
	}
	rows, err := db.Query(ctx, sorted, args...)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	var out []labeled[T]
	for rows.Next() {
		var l labeled[T]
		if l.v, err = scan(rows, &l.label); err != nil {
			return nil, err
		}
		out = append(out, l)
	}
	return out, rows.Err()
}

// walkLabels reads a page of a large build: the project's labels after
// `after` in order, 4 pages' worth at a time, each chunk's rows of the
// build found by their ids (probe's arguments: args[0], the build key, the
// ids, then the rest of args), until the page is full or the labels end.
func walkLabels[T any](ctx context.Context, db Querier, project, after string, limit int,
	probe string, args []any, scan func(pgx.Rows, *string) (T, error)) ([]labeled[T], error) {
	chunk := 4 * limit
	var out []labeled[T]
	for len(out) < limit {
		rows, err := db.Query(ctx, sqlLabelChunk, project, after, chunk)
		if err != nil {
			return nil, err
		}
		var (
			ids    []int64
			labels []string
		)
		var id int64
		var label string
		if _, err := pgx.ForEachRow(rows, []any{&id, &label}, func() error {
			ids, labels = append(ids, id), append(labels, label)
			return nil
		}); err != nil {
			return nil, err
		}
		if len(ids) == 0 {
			break
		}
		rows, err = db.Query(ctx, probe, append([]any{args[0], ids}, args[1:]...)...)
		if err != nil {
			return nil, err
		}
		found := make(map[int64]T, len(ids))
		for rows.Next() {
			var idText string
			v, err := scan(rows, &idText)
			if err != nil {
				rows.Close()
				return nil, err
			}
			n, err := strconv.ParseInt(idText, 10, 64)
			if err != nil {
				rows.Close()
				return nil, err
			}
			found[n] = v
		}
		rows.Close()
		if err := rows.Err(); err != nil {
			return nil, err
		}
		for i, id := range ids {
			if v, ok := found[id]; ok && len(out) < limit {
				out = append(out, labeled[T]{labels[i], v})
			}
		}
		if len(ids) < chunk {
			break
		}
		after = labels[len(labels)-1]
	}
	return out, nil
}

// Head is Show's Build without its targets and tests (empty lists): for a
// reader that pages through them.
func Head(ctx context.Context, db Querier, project, invocationID string) (*Build, error) {
	return show(ctx, db, project, invocationID, false)
}

// Counts are how many rows a build has.
type Counts struct {
	Targets, TargetsNotSucceeded, Tests int64
}

// CountRows counts the build's targets (and those that did not succeed:
// failed, or never completed) and tests, with one scan of each primary
// key's entries of the build.
func CountRows(ctx context.Context, db Querier, project, invocationID string) (Counts, error) {
	var c Counts
	err := db.QueryRow(ctx, `select
		(select count(*) from all_targets where build_key = `+sqlBuildKey+`),
		(select count(*) from all_targets where build_key = `+sqlBuildKey+` and success is not true),
		(select count(*) from all_tests where build_key = `+sqlBuildKey+`)`, invocationID, project).Scan(
		&c.Targets, &c.TargetsNotSucceeded, &c.Tests)
	if err != nil {
		return c, fmt.Errorf("builds: counts of %s in project %s: %w", invocationID, project, err)
	}
	return c, nil
}

// WriteJSON writes the build of project with the given invocation id as
// `builds show --json` prints it (Show's Build, indented by two spaces, a
// newline after it), without holding its targets and tests: they are read
// by one query each and written row by row as they come, so a build of a
// million events takes the memory of one row. It returns ErrNotFound for
// an unknown build, before writing anything.
func WriteJSON(ctx context.Context, db Querier, w io.Writer, project, invocationID string) error {
	b, err := show(ctx, db, project, invocationID, false)
	if err != nil {
		return err
	}
	head, err := json.MarshalIndent(b, "", "  ")
	if err != nil {
		return err
	}
	// The rows go where Marshal wrote the two empty lists.
	const targets, tests = `"targets": [],`, `"tests": [],`
	i, j := bytes.Index(head, []byte("\n  "+targets)), bytes.Index(head, []byte("\n  "+tests))
	if i < 0 || j < i {
		return fmt.Errorf("builds: json of %s: no lists of targets and tests", invocationID)
	}
	i, j = i+len("\n  "+targets)-3, j+len("\n  "+tests)-3 // at each "[]"
	bw := &errWriter{w: w}
	bw.write(head[:i])
	if err := writeRows(ctx, db, bw, sqlAllTargets, invocationID, project,
		func(rows pgx.Rows) (any, error) {
			var (
				t      Target
				causes []byte
			)
			if err := rows.Scan(&t.Label, &t.Kind, &t.Success, &t.FailureReason, &causes); err != nil {
				return t, err
			}
			return t, t.setCauses(causes)
		}); err != nil {
		return fmt.Errorf("builds: json of %s targets: %w", invocationID, err)
	}
	bw.write(head[i+2 : j])
	if err := writeRows(ctx, db, bw, sqlAllTests, invocationID, project,
		func(rows pgx.Rows) (any, error) {
			var t Test
			err := rows.Scan(&t.Label, &t.Status, &t.Attempts, &t.Shards, &t.DurationMs, &t.Cached)
			return t, err
		}); err != nil {
		return fmt.Errorf("builds: json of %s tests: %w", invocationID, err)
	}
	bw.write(head[j+2:])
	bw.write([]byte("\n"))
	return bw.err
}

// writeRows writes the rows of one query as the elements of a JSON list at
// the second level of an indented document: "[]" when there are none.
func writeRows(ctx context.Context, db Querier, w *errWriter, sql, id, project string, scan func(pgx.Rows) (any, error)) error {
	rows, err := db.Query(ctx, sql, id, project)
	if err != nil {
		return err
	}
	defer rows.Close()
	n := 0
	for rows.Next() && w.err == nil {
		v, err := scan(rows)
		if err != nil {
			return err
		}
		b, err := json.MarshalIndent(v, "    ", "  ")
		if err != nil {
			return err
		}
		if n == 0 {
			w.write([]byte("[\n    "))
		} else {
			w.write([]byte(",\n    "))
		}
		w.write(b)
		n++
	}
	if err := rows.Err(); err != nil {
		return err
	}
	if n == 0 {
		w.write([]byte("[]"))
	} else {
		w.write([]byte("\n  ]"))
	}
	return w.err
}

// errWriter keeps the first error of a run of writes.
type errWriter struct {
	w   io.Writer
	err error
}

func (e *errWriter) write(b []byte) {
	if e.err == nil {
		_, e.err = e.w.Write(b)
	}
}

// Positions is the sum of the builds projector's positions, of every
// partition: it changes whenever one of them moves (a page of builds
// reads again when it does).
func Positions(ctx context.Context, db Querier) (uint64, error) {
	var sum int64
	err := db.QueryRow(ctx, `select coalesce(sum(stream_seq), 0)::int8 from consumer_positions
		where consumer = $1 or consumer like $1 || '\_%'`, ConsumerName).Scan(&sum)
	if err != nil {
		return 0, fmt.Errorf("builds: the projector's positions: %w", err)
	}
	return uint64(sum), nil
}

// PositionOf names the position that orders a build's events: the builds
// projector's (ConsumerName), or with partitioned build events its
// partition's (subjects.BESLayout.Durable).
func PositionOf(l subjects.BESLayout, project, invocation string) string {
	return l.Durable(ConsumerName, l.Partition(project, invocation))
}

// Position is the highest BES stream sequence the projector (consumer's
// position: PositionOf) has applied
// (0: none yet). Read in the snapshot that a page reads a build's rows in
// (a repeatable-read transaction), it is where the stream goes on from
// what the page shows: a live page follows the build's subject from the
// next sequence, and sees every event once.
func Position(ctx context.Context, db Querier, consumer string) (uint64, error) {
	var seq int64
	err := db.QueryRow(ctx, `select stream_seq from consumer_positions where consumer = $1`, consumer).Scan(&seq)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("builds: the projector's position: %w", err)
	}
	return uint64(seq), nil
}

// StatusOf is a build's status (one of Statuses), or ErrNotFound: what a
// live page checks while Bazel is quiet, to learn that the build ended or
// was abandoned.
func StatusOf(ctx context.Context, db Querier, project, invocationID string) (string, error) {
	var status string
	err := db.QueryRow(ctx, `select status from invocations where id = $1 and project = $2`, invocationID, project).Scan(&status)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", ErrNotFound
	}
	if err != nil {
		return "", fmt.Errorf("builds: status of %s in project %s: %w", invocationID, project, err)
	}
	return status, nil
}
