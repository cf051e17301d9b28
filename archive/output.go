package archive

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/streams/projection"
)

// Console output. A finished build's output is folded from its progress
// events, so once its object holds every event the projector applied of
// it, PostgreSQL's copy (build_output_pages) is a second one. The archiver
// moves it: it hands the object's messages to the builds projection's
// side (OutputMover: projectors/builds MoveOutput), which folds them as the
// projector does and, when the output is byte for byte and page for page
// what the rows hold, deletes the rows in the transaction that records the
// move here (archived_builds.output_seq and its sizes, migration 018). The
// console and `builds show` then read it from the object
// (builds.OutputReader, through Objects). A re-archived build keeps what it
// moved (its new object starts with the same messages, or it is not
// written) and moves the output of its later events too; a replay
// (PlanReplay) folds the output into pages again and forgets the move, so
// that the archiver moves it again; the raw retention brings the output
// back into pages before it deletes an object (RawExpirer), since rows
// outlive raw events.

// OutputBuild is one archived build whose console output may move, and
// what of it has moved already (Through 0: nothing): the output of its
// object's messages up to stream sequence Through, Moved bytes per stream
// (stdout, stderr).
type OutputBuild struct {
	Project, ID string
	// LastSeq is the stream sequence of the object's last message.
	LastSeq uint64
	Through uint64
	Moved   [2]int64
}

// OutputMoved is what a move did: Moved (the rows are deleted; Bytes is
// the whole output's size), Pending (nothing yet: the projector has not
// caught up with the object, or the output is not folded yet), or Differs
// (why not: the output stays in PostgreSQL).
type OutputMoved struct {
	Moved, Pending bool
	Bytes          [2]int64
	Differs        string
}

// Messages walks one object's messages in stream order; it ends early
// with fn's error.
type Messages func(fn func(projection.Message) error) error

// OutputMover is the builds projection's side of moving console output
// (projectors/builds MoveOutput and RestoreOutput, adapted by cmd/millrace:
// this package does not import the projector). Both work in tx, which
// holds the build's lock, and read the object through msgs.
type OutputMover interface {
	// MoveOutput deletes the build's output rows if the object's
	// messages fold to them.
	MoveOutput(ctx context.Context, tx pgx.Tx, b OutputBuild, msgs Messages) (OutputMoved, error)
	// RestoreOutput writes the output the build moved back into rows.
	RestoreOutput(ctx context.Context, tx pgx.Tx, b OutputBuild, msgs Messages) error
}

// Objects reads build objects from the bucket, with the dictionaries they
// name: how the console and `builds show` read the console output of
// archived builds (it is a projectors/builds Archive). Safe for concurrent
// use.
type Objects struct {
	store BuildStore
	dicts *Dicts
}

// NewObjects reads objects from store.
func NewObjects(store BuildStore) *Objects { return &Objects{store: store, dicts: NewDicts(store)} }

// Messages calls fn with each message of the object at key as it decodes
// them, and returns fn's error as it is. A missing object is
// bucket.ErrNotFound naming its key, a missing dictionary ErrDictMissing
// naming its id and key; an object that does not decode whole is
// ErrCorrupt.
func (o *Objects) Messages(ctx context.Context, key string, fn func(projection.Message) error) error {
	var fnErr error
	err := readObject(ctx, o.store, o.dicts, key, func(m *Message) error {
		fnErr = fn(m)
		return fnErr
	})
	if fnErr != nil {
		return fnErr
	}
	return err
}

// objectMessages walks the object at key for a mover, keeping the error
// of the object's read apart from the mover's own.
func (a *Archiver) objectMessages(ctx context.Context, key string, readErr *error) Messages {
	return func(fn func(projection.Message) error) error {
		var fnErr error
		err := readObject(ctx, a.store, a.dicts, key, func(m *Message) error {
			fnErr = fn(m)
			return fnErr
		})
		if fnErr == nil && err != nil {
			*readErr = err
		}
		return err
	}
}

// readReason classifies a failed read of an object: the object's fault
// (check: logged, the build tried again next pass) or the bucket's (the
// archiver pauses).
func readReason(err error) string {
	if errors.Is(err, ErrCorrupt) || errors.Is(err, ErrDictMissing) || errors.Is(err, bucket.ErrNotFound) {
		return ReasonCheck
	}
	return ReasonBucket
}

// sqlOutputDue finds archived builds whose console output may move: a
// good object, output not moved or moved before a re-archive, the
// projector past the object's last message (the position that orders
// the build's events, archived_builds.position: its partition's, or
// ProjectorDurable for a build archived before partitions) and no event
// of the build newer than the object; oldest first, on
// archived_builds_output_idx.
const sqlOutputDue = `
select a.project, a.invocation_id from archived_builds a
join invocations i on i.id = a.invocation_id and i.project = a.project
where a.object_key <> '' and a.verify_error is null and a.output_error is null and a.raw_expired_at is null
  and (a.output_seq is null or a.output_seq < a.last_seq)
  and a.last_seq <= (select coalesce(max(stream_seq), 0) from consumer_positions where consumer = coalesce(a.position, $2))
  and i.last_event_at <= a.last_event_at
order by a.last_seq
limit $1`

// MoveOutputs moves the console output of at most Batch archived builds
// into their objects and returns how many it moved or found to differ
// (a full batch: there may be more). Without an OutputMover it does
// nothing. A failure of the bucket or the database ends it with its
// reason; an object that does not read is counted and logged (check), and
// the build tried again next pass.
func (a *Archiver) MoveOutputs(ctx context.Context) (int, string, error) {
	if a.out == nil {
		return 0, "", nil
	}
	rows, err := a.pool.Query(ctx, sqlOutputDue, a.cfg.Batch, ProjectorDurable)
	if err != nil {
		a.m.failures.WithLabelValues(ReasonDatabase).Inc()
		return 0, ReasonDatabase, fmt.Errorf("archive: builds whose output may move: %w", err)
	}
	builds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (u untrimmed, err error) {
		return u, r.Scan(&u.project, &u.id)
	})
	if err != nil {
		a.m.failures.WithLabelValues(ReasonDatabase).Inc()
		return 0, ReasonDatabase, fmt.Errorf("archive: builds whose output may move: %w", err)
	}
	done := 0
	for _, b := range builds {
		changed, reason, err := a.moveOutput(ctx, b)
		switch {
		case ctx.Err() != nil:
			return done, "", nil
		case reason == ReasonBucket || reason == ReasonDatabase:
			a.m.failures.WithLabelValues(reason).Inc()
			return done, reason, err
		case err != nil:
			a.m.failures.WithLabelValues(reason).Inc()
			a.cfg.Logger.Warn("console output of an archived build not moved; trying again next pass", "project", b.project, "invocation", b.id, "reason", reason, "err", err)
		case changed:
			done++
		}
	}
	return done, "", nil
}

// MoveAllOutputs moves output (MoveOutputs) until a batch moves none,
// and returns how many builds' output it moved or found to differ: what
// `replay builds` does at its end, so that it ends where the live run was.
func (a *Archiver) MoveAllOutputs(ctx context.Context) (int, error) {
	total := 0
	for {
		n, _, err := a.MoveOutputs(ctx)
		if total += n; err != nil || n == 0 {
			return total, err
		}
	}
}

// moveOutput moves one build's output, under the build's lock, and
// records the outcome in its archived_builds row in the same transaction.
func (a *Archiver) moveOutput(ctx context.Context, b untrimmed) (changed bool, reason string, err error) {
	tx, err := a.pool.Begin(ctx)
	if err != nil {
		return false, ReasonDatabase, fmt.Errorf("archive: move output of %s in project %s: %w", b.id, b.project, err)
	}
	defer tx.Rollback(ctx)
	p, err := lockBuild(ctx, tx, b.project, b.id)
	if err != nil {
		return false, ReasonDatabase, err
	}
	// Under the lock, the row may have changed since the look.
	if !p.found || p.key == "" || p.verifyFailed || p.outputFailed || p.rawExpired || (p.outputSeq != nil && *p.outputSeq >= p.lastSeq) {
		return false, "", nil
	}
	ob := OutputBuild{Project: b.project, ID: b.id, LastSeq: uint64(p.lastSeq)}
	if p.outputSeq != nil {
		ob.Through, ob.Moved = uint64(*p.outputSeq), p.outputBytes
	}
	var readErr error
	res, err := a.out.MoveOutput(ctx, tx, ob, a.objectMessages(ctx, p.key, &readErr))
	switch {
	case readErr != nil:
		return false, readReason(readErr), fmt.Errorf("archive: move output of %s in project %s: %w", b.id, b.project, err)
	case err != nil:
		return false, ReasonDatabase, err
	case res.Pending || !res.Moved && res.Differs == "":
		return false, "", nil
	case res.Moved:
		_, err = tx.Exec(ctx, `update archived_builds set output_seq = last_seq, output_stdout_bytes = $3, output_stderr_bytes = $4
where invocation_id = $1 and project = $2`, b.id, b.project, res.Bytes[0], res.Bytes[1])
	default:
		_, err = tx.Exec(ctx, `update archived_builds set output_error = $3 where invocation_id = $1 and project = $2`,
			b.id, b.project, res.Differs)
	}
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		return false, ReasonDatabase, fmt.Errorf("archive: record the output of %s in project %s: %w", b.id, b.project, err)
	}
	if res.Moved {
		a.m.outputMoved.Inc()
		a.cfg.Logger.Debug("console output moved into the archive", "project", b.project, "invocation", b.id)
	} else {
		a.m.failures.WithLabelValues(ReasonOutput).Inc()
		a.cfg.Logger.Warn("console output of an archived build stays in PostgreSQL: the object's differs", "project", b.project, "invocation", b.id, "reason", res.Differs)
	}
	return true, "", nil
}

// restoreOutput brings a build's moved output back into PostgreSQL, under
// the build's lock, and marks its raw events as being expired
// (raw_expired_at), so that no archiver moves it again before the object
// goes.
func restoreOutput(ctx context.Context, tx pgx.Tx, out OutputMover, objects *Objects, project, id string) error {
	p, err := lockBuild(ctx, tx, project, id)
	if err != nil || !p.found || p.key == "" {
		return err
	}
	if p.outputSeq != nil {
		if out == nil {
			return fmt.Errorf("archive: the console output of %s in project %s is in its object %s, and nothing can bring it back before the object goes", id, project, p.key)
		}
		ob := OutputBuild{Project: project, ID: id, LastSeq: uint64(p.lastSeq), Through: uint64(*p.outputSeq), Moved: p.outputBytes}
		msgs := func(fn func(projection.Message) error) error { return objects.Messages(ctx, p.key, fn) }
		if err := out.RestoreOutput(ctx, tx, ob, msgs); err != nil {
			return fmt.Errorf("archive: restore the output of %s in project %s from %s: %w", id, project, p.key, err)
		}
	}
	_, err = tx.Exec(ctx, `update archived_builds set output_seq = null, output_stdout_bytes = null, output_stderr_bytes = null,
    raw_expired_at = coalesce(raw_expired_at, now()) where invocation_id = $1 and project = $2`, id, project)
	return err
}
