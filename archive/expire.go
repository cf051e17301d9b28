package archive

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/bucket"
)

// Deleter removes an object from the bucket (*bucket.Bucket): an object
// that is not there is bucket.ErrNotFound.
type Deleter interface {
	Delete(ctx context.Context, key string) error
}

// RawExpirer removes the raw events of archived builds past their
// project's raw retention: what the BES stream still holds of them, then
// the object. The build's archived_builds row stays, with no object and
// raw_expired_at set: the archiver never archives the build again (a late
// event stays in the stream until its age limit), and a replay keeps its
// rows as those of a build whose raw events are gone (PlanReplay), however
// recent its first event. The row leaves with the build's rows, when its
// rows retention deletes them. A build whose console output has moved
// into its object gets it back into PostgreSQL first (output.go), since
// its rows stay. It is the builds retention's builds.RawExpirer.
type RawExpirer struct {
	pool    *pgxpool.Pool
	store   Deleter
	trim    Trimmer     // nil: the stream is left to its age limit
	out     OutputMover // nil: a build whose output moved is refused
	objects *Objects
}

// NewRawExpirer returns a RawExpirer of the objects in store, trimming
// the stream with trim (nil: not at all).
func NewRawExpirer(pool *pgxpool.Pool, store Deleter, trim Trimmer) *RawExpirer {
	return &RawExpirer{pool: pool, store: store, trim: trim}
}

// RestoreOutputWith makes the expirer bring moved console output back
// into PostgreSQL through out, reading the objects of store, and returns
// it.
func (r *RawExpirer) RestoreOutputWith(out OutputMover, store BuildStore) *RawExpirer {
	r.out, r.objects = out, NewObjects(store)
	return r
}

// ExpireRaw removes the raw events of at most n of project's archived
// builds whose last event is before before, oldest first (their console
// output, if it moved, back into PostgreSQL first), and returns how
// many. A failure of the bucket or the stream ends it with the error (the
// retention pauses); what it removed of a build before stays removed, and
// the next pass finishes it.
func (r *RawExpirer) ExpireRaw(ctx context.Context, project string, before time.Time, n int) (int, error) {
	rows, err := r.pool.Query(ctx, `select invocation_id, object_key, last_seq from archived_builds
		where project = $1 and object_key <> '' and last_event_at < $2
		order by last_event_at limit $3`, project, before, n)
	if err != nil {
		return 0, fmt.Errorf("archive: builds past raw retention: %w", err)
	}
	type due struct {
		id, key string
		last    int64
	}
	builds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (d due, err error) {
		return d, r.Scan(&d.id, &d.key, &d.last)
	})
	if err != nil {
		return 0, fmt.Errorf("archive: builds past raw retention: %w", err)
	}
	for i, b := range builds {
		// The output first, in its own transaction: a failure after it
		// leaves the output in PostgreSQL and the object, which the next
		// pass deletes.
		if err := pgx.BeginFunc(ctx, r.pool, func(tx pgx.Tx) error {
			return restoreOutput(ctx, tx, r.out, r.objects, project, b.id)
		}); err != nil {
			return i, fmt.Errorf("archive: raw retention of %s/%s: %w", project, b.id, err)
		}
		if r.trim != nil {
			if _, err := r.trim.Trim(ctx, r.trim.Subject(project, b.id), uint64(b.last)); err != nil {
				return i, fmt.Errorf("archive: raw retention of %s/%s: %w", project, b.id, err)
			}
		}
		if err := r.store.Delete(ctx, b.key); err != nil && !errors.Is(err, bucket.ErrNotFound) {
			return i, fmt.Errorf("archive: raw retention of %s/%s: %w", project, b.id, err)
		}
		// Only the object just deleted: a re-archive meanwhile wrote another.
		if _, err := r.pool.Exec(ctx, `update archived_builds set object_key = '', raw_expired_at = now(),
			trimmed_seq = greatest(coalesce(trimmed_seq, 0), last_seq)
			where invocation_id = $1 and project = $2 and object_key = $3`, b.id, project, b.key); err != nil {
			return i, fmt.Errorf("archive: raw retention of %s/%s: %w", project, b.id, err)
		}
	}
	return len(builds), nil
}
