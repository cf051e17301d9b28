package archive

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// BuildID names one build: its project and invocation id.
type BuildID struct{ Project, ID string }

// StreamTail is what the BES stream still holds when a replay starts: its
// first message (sequence and storage time; FirstSeq above LastSeq when it
// is empty) and its last sequence.
type StreamTail struct {
	FirstSeq  uint64
	FirstTime time.Time
	LastSeq   uint64
}

// empty reports whether the stream holds no message.
func (t StreamTail) empty() bool { return t.FirstSeq == 0 || t.FirstSeq > t.LastSeq }

// ReplayOptions shape a replay of the builds projection from the archive
// and the stream.
type ReplayOptions struct {
	// RawKept is how long raw events are kept (RETENTION_RAW_DAYS): a
	// build not in the archive whose first event is older than that had
	// them removed on purpose, and keeps its rows as they are. 0: raw
	// events are kept for ever, so every such build is a gap.
	RawKept time.Duration
	// Now is the wall clock RawKept counts back from (zero: time.Now).
	Now time.Time
	// Batch is how many archived messages go to the projector at a time
	// (0: 1,000, the runner's default batch).
	Batch int
	// Progress, when set, is called after each archived build with the
	// builds read so far and their total.
	Progress func(done, total int)
	// Layout and Partition: with partitioned build events, the plan is
	// the replay of partition Partition alone (its stream is tail's, its
	// builds those Layout puts there); the other partitions' builds are
	// neither reset nor read.
	Layout    subjects.BESLayout
	Partition int
}

// owns reports whether a build is the replay's.
func (o ReplayOptions) owns(project, id string) bool {
	return !o.Layout.Partitioned() || o.Layout.Partition(project, id) == o.Partition
}

// Gap is a build the replay cannot rebuild and must not lose: its rows
// are there, its raw events are within retention, the stream has lost
// some of them and the archive does not have it.
type Gap struct {
	Project, ID  string
	FirstEventAt time.Time
}

// ReplayPlanned is what a replay will do, known before it empties
// anything.
type ReplayPlanned struct {
	// Archived builds are read from the archive before the stream.
	Archived int
	// Kept builds had their raw events removed by retention: their rows
	// stay as they were.
	Kept int
	// Gaps, when any, make the replay refuse (ErrGap).
	Gaps []Gap
}

// ErrGap: the stream has lost messages of builds the archive lacks.
var ErrGap = errors.New("the BES stream has lost events of builds the archive does not hold")

// retentionSlack: a build whose first event is within this of the raw
// retention's end counts as past it. The server that expires messages and
// the replay's host may disagree on the time, and JetStream removes expired
// messages a little after their age: a build at the edge of retention
// must not make a replay refuse.
const retentionSlack = time.Hour

// maxGapsNamed bounds the builds an ErrGap names.
const maxGapsNamed = 10

// PlanReplay looks at the projection, the archive's records and what the
// stream still holds, and returns the plan of a replay that yields the
// rows of the live run for every build whose raw events are retained,
// keeps the rows of those whose raw events are gone, and never loses a
// build: when the stream has lost events of a build the archive lacks,
// it returns ErrGap naming them, before anything is emptied. reset empties
// the projection but for the builds it is given (the builds projector's
// ResetExcept); in its transaction the plan's Reset also forgets which
// builds' console output moved into their objects, since the replay folds
// it into pages again (Archiver.MoveOutputs moves it once more).
func PlanReplay(ctx context.Context, pool *pgxpool.Pool, store BuildStore, tail StreamTail,
	reset func(context.Context, pgx.Tx, []BuildID) error, opts ReplayOptions) (projection.ReplayPlan, ReplayPlanned, error) {
	if opts.Now.IsZero() {
		opts.Now = time.Now()
	}
	if opts.Batch <= 0 {
		opts.Batch = 1000
	}
	var planned ReplayPlanned
	kept, gaps, err := notInArchive(ctx, pool, tail, opts)
	if err != nil {
		return projection.ReplayPlan{}, planned, err
	}
	kept = slices.DeleteFunc(kept, func(b BuildID) bool { return !opts.owns(b.Project, b.ID) })
	gaps = slices.DeleteFunc(gaps, func(g Gap) bool { return !opts.owns(g.Project, g.ID) })
	planned.Kept, planned.Gaps = len(kept), gaps
	if len(gaps) > 0 {
		return projection.ReplayPlan{}, planned, gapError(gaps)
	}
	objs, err := archivedObjects(ctx, pool)
	if err != nil {
		return projection.ReplayPlan{}, planned, err
	}
	objs = slices.DeleteFunc(objs, func(o archivedObject) bool { return !opts.owns(o.project, o.id) })
	planned.Archived = len(objs)
	if err := checkObjects(ctx, store, objs); err != nil {
		return projection.ReplayPlan{}, planned, err
	}
	skip := map[string]uint64{}
	for _, o := range objs {
		if !tail.empty() && o.lastSeq >= tail.FirstSeq {
			skip[opts.Layout.Subject(o.project, o.id)] = o.lastSeq
		}
	}
	for _, k := range kept {
		skip[opts.Layout.Subject(k.Project, k.ID)] = math.MaxUint64
	}
	plan := projection.ReplayPlan{
		Reset: func(ctx context.Context, tx pgx.Tx) error {
			if err := reset(ctx, tx, kept); err != nil {
				return err
			}
			// The replay folds every archived build's console output into
			// pages again: what moved into the objects is in PostgreSQL
			// once more, until the archiver moves it again (output.go).
			if opts.Layout.Partitioned() {
				return forgetMovedOutput(ctx, tx, objs)
			}
			_, err := tx.Exec(ctx, `update archived_builds set output_seq = null, output_stdout_bytes = null,
    output_stderr_bytes = null, output_error = null
where output_seq is not null or output_error is not null`)
			return err
		},
		Prelude: func(ctx context.Context, apply func([]projection.Message) error) error {
			return prelude(ctx, store, objs, opts, apply)
		},
		Skip: func(m projection.Message) bool {
			upTo, ok := skip[m.Subject()]
			return ok && m.Seq() <= upTo
		},
	}
	return plan, planned, nil
}

// forgetMovedOutput is the plan's forgetting of moved console output for
// a partition's replay: of its own archived builds alone.
func forgetMovedOutput(ctx context.Context, tx pgx.Tx, objs []archivedObject) error {
	projects, ids := make([]string, len(objs)), make([]string, len(objs))
	for i, o := range objs {
		projects[i], ids[i] = o.project, o.id
	}
	_, err := tx.Exec(ctx, `update archived_builds a set output_seq = null, output_stdout_bytes = null,
    output_stderr_bytes = null, output_error = null
from unnest($1::text[], $2::text[]) as b(project, id)
where a.project = b.project and a.invocation_id = b.id and (a.output_seq is not null or a.output_error is not null)`, projects, ids)
	return err
}

// notInArchive sorts the builds with rows that the archive does not hold
// and whose first event the stream no longer has: kept (raw events past
// retention) or gaps.
func notInArchive(ctx context.Context, pool *pgxpool.Pool, tail StreamTail, opts ReplayOptions) (kept []BuildID, gaps []Gap, err error) {
	// An empty stream holds nothing of any build.
	before := tail.FirstTime
	if tail.empty() {
		before = time.Date(9999, 1, 1, 0, 0, 0, 0, time.UTC)
	}
	rows, err := pool.Query(ctx, `
select i.project, i.id, i.first_event_at, a.raw_expired_at is not null from invocations i
left join archived_builds a on a.invocation_id = i.id and a.project = i.project
where (i.first_event_at < $1 or a.raw_expired_at is not null)
  and (a.invocation_id is null or a.object_key = '')`, before)
	if err != nil {
		return nil, nil, fmt.Errorf("archive: the builds the stream no longer holds: %w", err)
	}
	defer rows.Close()
	cutoff := time.Time{}
	if opts.RawKept > 0 {
		cutoff = opts.Now.Add(-opts.RawKept + retentionSlack)
	}
	for rows.Next() {
		var g Gap
		var expired bool // the raw retention removed its events (RawExpirer)
		if err := rows.Scan(&g.Project, &g.ID, &g.FirstEventAt, &expired); err != nil {
			return nil, nil, err
		}
		if expired || !cutoff.IsZero() && g.FirstEventAt.Before(cutoff) {
			kept = append(kept, BuildID{Project: g.Project, ID: g.ID})
		} else {
			gaps = append(gaps, g)
		}
	}
	return kept, gaps, rows.Err()
}

func gapError(gaps []Gap) error {
	var b strings.Builder
	for i, g := range gaps[:min(len(gaps), maxGapsNamed)] {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "%s/%s (first event %s)", g.Project, g.ID, g.FirstEventAt.UTC().Format(time.RFC3339))
	}
	if len(gaps) > maxGapsNamed {
		fmt.Fprintf(&b, " and %d more", len(gaps)-maxGapsNamed)
	}
	return fmt.Errorf("%w: %d builds: %s; nothing was emptied: archive them (while the stream has them), or restore the archive's objects", ErrGap, len(gaps), b.String())
}

// archivedObject is one archived build's record.
type archivedObject struct {
	project, id, key  string
	firstSeq, lastSeq uint64
}

func archivedObjects(ctx context.Context, pool *pgxpool.Pool) ([]archivedObject, error) {
	rows, err := pool.Query(ctx, `
select project, invocation_id, object_key, first_seq, last_seq from archived_builds
where object_key <> '' order by first_seq, project, invocation_id`)
	if err != nil {
		return nil, fmt.Errorf("archive: the archived builds: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (archivedObject, error) {
		var o archivedObject
		var first, last int64
		err := r.Scan(&o.project, &o.id, &o.key, &first, &last)
		o.firstSeq, o.lastSeq = uint64(first), uint64(last)
		return o, err
	})
}

// checkObjects makes sure, before anything is emptied, that every
// object is in the bucket and its dictionary can be loaded: reading its
// header is enough for both.
func checkObjects(ctx context.Context, store BuildStore, objs []archivedObject) error {
	dicts := NewDicts(store)
	for _, o := range objs {
		rc, err := store.NewReader(ctx, o.key)
		if err != nil {
			return fmt.Errorf("archive: build %s/%s (%s): %w; nothing was emptied", o.project, o.id, o.key, err)
		}
		r, err := NewReader(rc, dicts.Loader(ctx))
		if err == nil {
			r.Close()
		}
		rc.Close()
		if err != nil {
			return fmt.Errorf("archive: build %s/%s (%s): %w; nothing was emptied", o.project, o.id, o.key, err)
		}
	}
	return nil
}

// prelude reads the archived builds in order and hands their messages to
// apply in batches.
func prelude(ctx context.Context, store BuildStore, objs []archivedObject, opts ReplayOptions, apply func([]projection.Message) error) error {
	dicts := NewDicts(store)
	batch := make([]projection.Message, 0, opts.Batch)
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		err := apply(batch)
		batch = make([]projection.Message, 0, opts.Batch)
		return err
	}
	for i, o := range objs {
		err := readObject(ctx, store, dicts, o.key, func(m *Message) error {
			batch = append(batch, m)
			if len(batch) == opts.Batch {
				return flush()
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("archive: build %s/%s (%s): %w", o.project, o.id, o.key, err)
		}
		if opts.Progress != nil {
			opts.Progress(i+1, len(objs))
		}
	}
	return flush()
}

// readObject calls fn with each message of the object at key.
func readObject(ctx context.Context, store BuildStore, dicts *Dicts, key string, fn func(*Message) error) error {
	rc, err := store.NewReader(ctx, key)
	if err != nil {
		return err
	}
	defer rc.Close()
	r, err := NewReader(rc, dicts.Loader(ctx))
	if err != nil {
		return err
	}
	defer r.Close()
	for {
		m, err := r.Next()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := fn(m); err != nil {
			return err
		}
	}
}
