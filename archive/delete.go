package archive

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/bucket"
)

// Eraser erases the raw events of project's build id, or with id "" of
// every build of project, and returns how many messages it erased:
// streams.BuildEvents.Erase, a secure delete that overwrites their bytes.
type Eraser func(ctx context.Context, project, id string) (uint64, error)

// Deleted is what Delete removed.
type Deleted struct {
	Builds   int    `json:"builds"`   // with rows
	Messages uint64 `json:"messages"` // of the BES stream
	Objects  int    `json:"objects"`  // of the archive
}

// RowDeleter deletes the rows of project's build id, or with id "" of
// every build of project, with what they counted in the rollups, and
// returns how many builds had rows; progress hears the count as it grows
// (builds.DeleteRows: this package does not import the projector).
type RowDeleter func(ctx context.Context, pool *pgxpool.Pool, project, id string, progress func(deleted int)) (int, error)

// Delete deletes, on request, project's build id, or with id "" every
// build of project: first its raw events (the stream's messages, erased,
// then the archive's objects), then its rows with what they counted in the
// rollups (deleteRows), so that a failure
// midway leaves nothing a replay could bring back, and running it again
// finishes it. No other project's data is touched. progress, when set,
// hears each step.
func Delete(ctx context.Context, pool *pgxpool.Pool, store Deleter, erase Eraser, deleteRows RowDeleter, project, id string, progress func(string)) (Deleted, error) {
	var d Deleted
	say := func(format string, a ...any) {
		if progress != nil {
			progress(fmt.Sprintf(format, a...))
		}
	}
	what := "project " + project
	if id != "" {
		what = "build " + project + "/" + id
	}
	var err error
	if d.Messages, err = erase(ctx, project, id); err != nil {
		return d, fmt.Errorf("archive: delete: erase the raw events of %s: %w", what, err)
	}
	say("erased %d messages of %s", d.Messages, what)
	rows, err := pool.Query(ctx, `select object_key from archived_builds
		where project = $1 and ($2 = '' or invocation_id = $2) and object_key <> ''`, project, id)
	if err != nil {
		return d, fmt.Errorf("archive: delete: %w", err)
	}
	keys, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return d, fmt.Errorf("archive: delete: %w", err)
	}
	for _, k := range keys {
		if err := store.Delete(ctx, k); err != nil && !errors.Is(err, bucket.ErrNotFound) {
			return d, fmt.Errorf("archive: delete: %w", err)
		}
		if d.Objects++; d.Objects%100 == 0 {
			say("deleted %d of %d archive objects", d.Objects, len(keys))
		}
	}
	say("deleted %d archive objects", d.Objects)
	d.Builds, err = deleteRows(ctx, pool, project, id, func(n int) { say("deleted the rows of %d builds", n) })
	return d, err
}
