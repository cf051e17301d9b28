package builds

import (
	"bytes"
	"cmp"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"hash"
	"math"
	"slices"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/streams/projection"
)

// Console output in the archive. Once a finished build's archive object
// holds every event the projector applied of it, and the output those
// events fold to is what build_output_pages (or build_output) holds, the
// archiver deletes those rows (MoveOutput) and records in archived_builds
// what the object holds instead (migrations/018_archived_output.sql):
// output_seq, the object's messages up to it fold to the output, and its
// size per stream. A late event of the build is folded by the projector as
// usual: with no pages left it starts at page 0, so the build's pages are
// then the output after the object's, a fragment the reads place after it,
// until the archiver archives the build again and moves the fragment too.
// The raw retention brings the output back into pages before it deletes
// the object (RestoreOutput), since rows outlive raw events.
//
// The reads fold the object's messages as the projector folds them
// (outputFold) and cut them at the same offsets, so a page read from the
// archive is byte for byte the page PostgreSQL held.

// Archive reads the raw messages of archived builds: archive.Objects over
// the bucket (--bucket-url), which cmd/millrace gives the console and
// `builds show`. This package does not import the archive, so that the
// projector needs no bucket.
type Archive interface {
	// Messages calls fn with each message of the object at key, in stream
	// order, as it decodes them (a build of any size costs a message of
	// memory), and ends early with fn's error. A missing object or
	// dictionary is an error that names it.
	Messages(ctx context.Context, key string, fn func(projection.Message) error) error
}

// ErrNoArchive: the build's console output has moved into its archive
// object, and the reader was given no Archive to read it from.
var ErrNoArchive = errors.New("no archive to read it from (the bucket, --bucket-url)")

// errStop ends a walk of an object's messages early.
var errStop = errors.New("builds: enough of the object read")

// outputFold gives the console output each message adds to one build, as
// the projector folds it: messages it would dead-letter, of another build,
// or lifecycle ones add none; a tool event whose sequence is at or below
// the highest one applied is a resend (state.apply); a progress event adds
// its stdout and stderr.
type outputFold struct {
	key    invKey
	maxSeq int64 // the highest tool sequence folded
}

func (f *outputFold) output(m projection.Message) (stdout, stderr []byte) {
	ev, keep, err := decodeMessage(m)
	if err != nil || !keep || ev.key() != f.key || !ev.kind.tool() || ev.sequence <= f.maxSeq {
		return nil, nil
	}
	f.maxSeq = ev.sequence
	if ev.kind != kindBazel || ev.bazel.payload != payProgress {
		return nil, nil
	}
	return ev.bazel.stdout, ev.bazel.stderr
}

// Messages is a walk of one build's archived messages, in stream order:
// Archive.Messages of its object, or the archiver's read of it.
type Messages func(fn func(projection.Message) error) error

// walkArchived calls fn with the output each of the build's archived
// messages up to stream sequence through adds (none: not called), in
// order, and returns the highest tool sequence folded; fn ends the walk
// early with errStop.
func walkArchived(k invKey, msgs Messages, through uint64, fn func(seq uint64, stdout, stderr []byte) error) (int64, error) {
	f := outputFold{key: k}
	err := msgs(func(m projection.Message) error {
		if m.Seq() > through {
			return errStop
		}
		o, e := f.output(m)
		if len(o)+len(e) == 0 {
			return nil
		}
		return fn(m.Seq(), o, e)
	})
	if errors.Is(err, errStop) {
		err = nil
	}
	return f.maxSeq, err
}

// OutputMove is what MoveOutput did.
type OutputMove struct {
	// Moved: the build's output rows are deleted and the object holds its
	// output, Bytes per stream (stdout, stderr).
	Moved bool
	Bytes [2]int64
	// Pending: not yet, nothing changed; the projector has not applied
	// every event of the object, or has applied later ones, or the output
	// is still in scratch chunks. The build is looked at again later.
	Pending bool
	// Differs says why the object's output is not PostgreSQL's; nothing
	// changed, and the output stays in PostgreSQL.
	Differs string
}

// MoveOutput moves the console output of the build of project with the
// given invocation id from its rows into its archive object, whose
// messages msgs walks; lastSeq is the stream sequence of its last message.
// through and moved say what the object holds already (through 0: none):
// the output of its messages up to stream sequence through, moved bytes of
// each stream. It folds the messages as the projector does, then, in tx,
// with the projector's position locked (every batch locks it first, so no
// batch folds into the build's pages meanwhile), checks that the
// projector has applied the object's events and no later one, that the
// output of the messages up to through has moved's sizes and that of the
// later ones is what the build's pages (or its build_output row) hold,
// byte for byte and cut into the same pages; then it deletes those rows.
// The caller records what it returns (archived_builds), in tx.
func MoveOutput(ctx context.Context, tx pgx.Tx, consumer, project, invocationID string, through uint64, moved [2]int64, msgs Messages) (OutputMove, error) {
	k := invKey{project, invocationID}
	var (
		prefix [2]int64 // the output of the messages up to through
		after  [2]streamSum
	)
	maxSeq, err := walkArchived(k, msgs, math.MaxUint64, func(seq uint64, o, e []byte) error {
		for i, p := range [2][]byte{o, e} {
			if seq <= through {
				prefix[i] += int64(len(p))
			} else {
				after[i].write(p)
			}
		}
		return nil
	})
	if err != nil {
		return OutputMove{}, fmt.Errorf("builds: move output of %s in project %s: %w", invocationID, project, err)
	}
	if prefix != moved {
		return OutputMove{Differs: fmt.Sprintf("the object's messages up to %d fold to %d and %d bytes of output, %d and %d were moved",
			through, prefix[0], prefix[1], moved[0], moved[1])}, nil
	}
	pending, differs, err := lockOutput(ctx, tx, consumer, k, maxSeq)
	if err != nil || pending || differs != "" {
		return OutputMove{Pending: pending, Differs: differs}, err
	}
	var stored [2]streamSum
	if differs, err = storedOutput(ctx, tx, k, &stored); err != nil || differs != "" {
		return OutputMove{Differs: differs}, err
	}
	for i := range stored {
		if !stored[i].equal(&after[i]) {
			return OutputMove{Differs: fmt.Sprintf("stream %d: the object's output after message %d is %d bytes, PostgreSQL holds %d other bytes",
				i+1, through, after[i].n, stored[i].n)}, nil
		}
	}
	if _, err := tx.Exec(ctx, `delete from build_output_pages where invocation_id = $1 and project = $2`, k.id, k.project); err != nil {
		return OutputMove{}, fmt.Errorf("builds: move output of %s in project %s: %w", invocationID, project, err)
	}
	if _, err := tx.Exec(ctx, `delete from build_output where invocation_id = $1 and project = $2`, k.id, k.project); err != nil {
		return OutputMove{}, fmt.Errorf("builds: move output of %s in project %s: %w", invocationID, project, err)
	}
	return OutputMove{Moved: true, Bytes: [2]int64{prefix[0] + after[0].n, prefix[1] + after[1].n}}, nil
}

// lockOutput locks the projector's position (consumer's: the build's
// partition's, PositionOf) for tx, then says whether the build's output
// rows are what the projector folded of exactly the object's events
// (highest tool sequence maxSeq), all of it folded.
func lockOutput(ctx context.Context, tx pgx.Tx, consumer string, k invKey, maxSeq int64) (pending bool, differs string, err error) {
	// for share: archivers moving several builds do not wait for each
	// other, a batch (for update) waits for them and they for it.
	_, err = tx.Exec(ctx, `select 1 from consumer_positions where consumer = $1 for share`, consumer)
	if err != nil {
		return false, "", fmt.Errorf("builds: lock the projector's position: %w", err)
	}
	var (
		applied int64
		chunks  bool
	)
	err = tx.QueryRow(ctx, `select last_sequence, exists (select 1 from build_output_chunks c
		where c.invocation_id = i.id and c.project = i.project) from invocations i where id = $1 and project = $2`,
		k.id, k.project).Scan(&applied, &chunks)
	switch {
	case errors.Is(err, pgx.ErrNoRows):
		return false, "the build has no rows", nil
	case err != nil:
		return false, "", fmt.Errorf("builds: output of %s in project %s: %w", k.id, k.project, err)
	}
	// A later event applied (a re-archive takes it into the object) or
	// an event of the object not applied yet; chunks are not folded yet.
	return applied != maxSeq || chunks, "", nil
}

// storedOutput sums the build's output rows per stream, and says how they
// differ from pages the projector cuts now (a build_output row of before
// migration 012 over a page long).
func storedOutput(ctx context.Context, tx pgx.Tx, k invKey, sums *[2]streamSum) (differs string, err error) {
	rows, err := tx.Query(ctx, `select stream, page, bytes, data from build_output_pages
		where invocation_id = $1 and project = $2 order by stream, page`, k.id, k.project)
	if err != nil {
		return "", fmt.Errorf("builds: output of %s in project %s: %w", k.id, k.project, err)
	}
	var (
		dec    decompressor
		stream int16
		page   int32
		n      int32
		frame  []byte
		next   [2]int32
		short  [2]bool // a page shorter than a whole one was seen
		pages  int
	)
	_, err = pgx.ForEachRow(rows, []any{&stream, &page, &n, &frame}, func() error {
		pages++
		plain, err := dec.decode(frame)
		if err != nil {
			return fmt.Errorf("page %d of stream %d: %w", page, stream, err)
		}
		i := stream - 1
		if page != next[i] || short[i] || int(n) != len(plain) || n > OutputPageBytes || n == 0 {
			differs = fmt.Sprintf("stream %d: page %d (%d bytes) is not where the projector cuts pages", stream, page, len(plain))
		}
		next[i], short[i] = page+1, n < OutputPageBytes
		sums[i].write(plain)
		return nil
	})
	if err != nil || differs != "" || pages > 0 {
		if err != nil {
			err = fmt.Errorf("builds: output of %s in project %s: %w", k.id, k.project, err)
		}
		return differs, err
	}
	var o, e []byte
	err = tx.QueryRow(ctx, `select stdout, stderr from build_output where invocation_id = $1 and project = $2`, k.id, k.project).Scan(&o, &e)
	if errors.Is(err, pgx.ErrNoRows) {
		return "", nil
	}
	if err != nil {
		return "", fmt.Errorf("builds: output of %s in project %s: %w", k.id, k.project, err)
	}
	for i, frame := range [2][]byte{o, e} {
		plain, err := dec.decode(frame)
		if err != nil {
			return "", fmt.Errorf("builds: stored output of %s in project %s: %w", k.id, k.project, err)
		}
		if len(plain) > OutputPageBytes {
			return fmt.Sprintf("stream %d: one row of %d bytes from before pages", i+1, len(plain)), nil
		}
		sums[i].write(plain)
	}
	return "", nil
}

// streamSum is the length and SHA-256 of one stream's output.
type streamSum struct {
	n int64
	h hash.Hash
}

func (s *streamSum) write(p []byte) {
	if s.h == nil {
		s.h = sha256.New()
	}
	s.n += int64(len(p))
	s.h.Write(p)
}

func (s *streamSum) sum() []byte {
	if s.h == nil {
		s.h = sha256.New()
	}
	return s.h.Sum(nil)
}

func (s *streamSum) equal(o *streamSum) bool { return s.n == o.n && bytes.Equal(s.sum(), o.sum()) }

// RestoreOutput brings the console output of a build that MoveOutput moved
// back into pages, before its object goes (the raw retention deletes the
// object, the rows stay): the output of the object's messages up to
// through (moved bytes of each stream, checked) followed by the pages the
// build has now (a late event's fragment), cut into pages again, in tx
// with the projector's position locked as MoveOutput does. The caller
// records that the output is in PostgreSQL again (archived_builds), in tx.
func RestoreOutput(ctx context.Context, tx pgx.Tx, consumer, project, invocationID string, through uint64, moved [2]int64, msgs Messages) error {
	k := invKey{project, invocationID}
	var out pageRows
	ws := [2]*pageWriter{{key: k, stream: StreamStdout, out: &out}, {key: k, stream: StreamStderr, out: &out}}
	var got [2]int64
	if _, err := walkArchived(k, msgs, through, func(_ uint64, o, e []byte) error {
		for i, p := range [2][]byte{o, e} {
			ws[i].write(p)
			got[i] += int64(len(p))
		}
		return nil
	}); err != nil {
		return fmt.Errorf("builds: restore output of %s in project %s: %w", invocationID, project, err)
	}
	if got != moved {
		return fmt.Errorf("builds: restore output of %s in project %s: the object's messages up to %d fold to %d and %d bytes, %d and %d were moved",
			invocationID, project, through, got[0], got[1], moved[0], moved[1])
	}
	if _, err := tx.Exec(ctx, `select 1 from consumer_positions where consumer = $1 for share`, consumer); err != nil {
		return fmt.Errorf("builds: lock the projector's position: %w", err)
	}
	// The fragment's pages, read before they are replaced.
	rows, err := tx.Query(ctx, `delete from build_output_pages where invocation_id = $1 and project = $2
		returning stream, page, data`, k.id, k.project)
	if err != nil {
		return fmt.Errorf("builds: restore output of %s in project %s: %w", invocationID, project, err)
	}
	type page struct {
		stream int16
		page   int32
		data   []byte
	}
	var (
		frag []page
		pg   page
	)
	if _, err := pgx.ForEachRow(rows, []any{&pg.stream, &pg.page, &pg.data}, func() error {
		frag = append(frag, pg) // pgx scans each bytea into a new slice
		return nil
	}); err != nil {
		return fmt.Errorf("builds: restore output of %s in project %s: %w", invocationID, project, err)
	}
	slices.SortFunc(frag, func(a, b page) int { return cmp.Or(cmp.Compare(a.stream, b.stream), cmp.Compare(a.page, b.page)) })
	var dec decompressor
	for _, p := range frag {
		plain, err := dec.decode(p.data)
		if err != nil {
			return fmt.Errorf("builds: restore output of %s in project %s: page %d of stream %d: %w", invocationID, project, p.page, p.stream, err)
		}
		ws[p.stream-1].write(plain)
	}
	ws[0].flush()
	ws[1].flush()
	for len(out.inv) > 0 {
		n := min(len(out.inv), foldPages)
		part := pageRows{out.inv[:n], out.project[:n], out.stream[:n], out.page[:n], out.bytes[:n], out.data[:n]}
		if _, err := tx.Exec(ctx, sqlPutPages, part.args()...); err != nil {
			return fmt.Errorf("builds: restore output of %s in project %s: %w", invocationID, project, err)
		}
		out = pageRows{out.inv[n:], out.project[n:], out.stream[n:], out.page[n:], out.bytes[n:], out.data[n:]}
	}
	return nil
}
