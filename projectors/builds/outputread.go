package builds

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/streams/projection"
)

// The reads of a build's console output: its sizes, a page, the whole.
// The output is in PostgreSQL (build_output_pages, or a build_output row
// of before migration 012) until the archiver moves it into the build's
// archive object (outputarchive.go); each read finds out where it is in
// the statement that reads the rows, so that it sees one state of a build
// whose output the archiver is moving.

// The queries of the output reads (build_output_pages' primary key,
// TestPagedReadsUseTheIndex). The archived_builds row is the build's
// only when its output has moved (output_seq set); then the build's pages
// are the output of its later events, placed after the archived bytes.
const (
	sqlOutputPages = `select page, data from build_output_pages
where invocation_id = $1 and project = $2 and stream = $3 and page between $4 and $5 order by page`
	sqlOutputSize = `
select a.output_seq is not null, coalesce(a.output_stdout_bytes, 0), coalesce(a.output_stderr_bytes, 0), p.stream, p.pages, p.bytes
from (select) one
left join archived_builds a on a.invocation_id = $1 and a.project = $2 and a.output_seq is not null
left join (select stream, count(*)::int4 as pages, sum(bytes)::int8 as bytes from build_output_pages
    where invocation_id = $1 and project = $2 group by stream) p on true`
	// Page $4 of stream $3, pages of $5 bytes: in PostgreSQL, page $4;
	// moved, the bytes after the archived ones' that it holds.
	sqlOutputPage = `
select a.object_key, a.output_seq, a.bytes, p.page, p.data
from (select) one
left join lateral (select object_key, output_seq,
        case when $3::int2 = 1 then output_stdout_bytes else output_stderr_bytes end as bytes
    from archived_builds where invocation_id = $1 and project = $2 and output_seq is not null) a on true
left join build_output_pages p on p.invocation_id = $1 and p.project = $2 and p.stream = $3
    and p.page between (case when a.bytes is null then $4::int8 else greatest(0, $4::int8 * $5 - a.bytes) / $5 end)
                   and (case when a.bytes is null then $4::int8 when ($4::int8 + 1) * $5 <= a.bytes then -1
                             else (($4::int8 + 1) * $5 - a.bytes - 1) / $5 end)
order by p.page`
	sqlOutputAll = `
select a.object_key, a.output_seq, coalesce(a.output_stdout_bytes, 0), coalesce(a.output_stderr_bytes, 0), p.stream, p.page, p.data
from (select) one
left join archived_builds a on a.invocation_id = $1 and a.project = $2 and a.output_seq is not null
left join build_output_pages p on p.invocation_id = $1 and p.project = $2
order by p.stream, p.page`
)

// OutputSize is how much folded console output a build has, per stream.
type OutputSize struct {
	StdoutBytes, StderrBytes int64
	StdoutPages, StderrPages int32
}

// OutputReader reads builds' console output from PostgreSQL and, for a
// build whose output has moved into its archive object, from Archive.
type OutputReader struct {
	DB Querier
	// Archive reads archived builds' objects; nil: the output of a build
	// whose output has moved is an error (ErrNoArchive).
	Archive Archive
}

// OutputSizes returns the size of the build's folded output
// (OutputReader.Sizes, which reads PostgreSQL alone).
func OutputSizes(ctx context.Context, db Querier, project, invocationID string) (OutputSize, error) {
	return OutputReader{DB: db}.Sizes(ctx, project, invocationID)
}

// Sizes returns the size of the build's folded output: pages of
// OutputPageBytes (the last one shorter). A build still running has none
// yet (Output reads its scratch chunks too). It needs no archive: what
// moved is recorded with its size.
func (r OutputReader) Sizes(ctx context.Context, project, invocationID string) (OutputSize, error) {
	var s OutputSize
	rows, err := r.DB.Query(ctx, sqlOutputSize, invocationID, project)
	if err != nil {
		return s, fmt.Errorf("builds: output size of %s in project %s: %w", invocationID, project, err)
	}
	var (
		moved    bool
		archived [2]int64
		stream   *int16
		pages    *int32
		n        *int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&moved, &archived[0], &archived[1], &stream, &pages, &n}, func() error {
		switch {
		case stream == nil:
		case *stream == StreamStdout:
			s.StdoutPages, s.StdoutBytes = *pages, *n
		default:
			s.StderrPages, s.StderrBytes = *pages, *n
		}
		return nil
	}); err != nil {
		return s, fmt.Errorf("builds: output size of %s in project %s: %w", invocationID, project, err)
	}
	if moved { // the archived bytes, then the pages' after them
		s.StdoutBytes += archived[0]
		s.StderrBytes += archived[1]
		s.StdoutPages, s.StderrPages = pagesOf(s.StdoutBytes), pagesOf(s.StderrBytes)
		return s, nil
	}
	if s.StdoutPages == 0 && s.StderrPages == 0 {
		err := r.DB.QueryRow(ctx, `select stdout_bytes, stderr_bytes from build_output where invocation_id = $1 and project = $2`,
			invocationID, project).Scan(&s.StdoutBytes, &s.StderrBytes)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
		case err != nil:
			return s, fmt.Errorf("builds: output size of %s in project %s: %w", invocationID, project, err)
		default: // folded before pages: one page per stream
			s.StdoutPages, s.StderrPages = 1, 1
		}
	}
	return s, nil
}

func pagesOf(n int64) int32 { return int32((n + OutputPageBytes - 1) / OutputPageBytes) }

// OutputPage returns page n (from 0) of one stream of the build's folded
// output (OutputReader.Page without an archive).
func OutputPage(ctx context.Context, db Querier, project, invocationID string, stream int16, n int32) ([]byte, error) {
	return OutputReader{DB: db}.Page(ctx, project, invocationID, stream, n)
}

// Page returns page n (from 0) of one stream (StreamStdout or
// StreamStderr) of the build's folded output, or ErrNotFound. Of a build
// whose output has moved, it reads the object's messages until it has the
// page's bytes (so page n costs decoding the build up to it, and the
// memory of a message and the page), then the pages of later events.
func (r OutputReader) Page(ctx context.Context, project, invocationID string, stream int16, n int32) ([]byte, error) {
	k := invKey{project, invocationID}
	rows, err := r.DB.Query(ctx, sqlOutputPage, invocationID, project, stream, n, OutputPageBytes)
	if err != nil {
		return nil, fmt.Errorf("builds: output of %s in project %s: %w", invocationID, project, err)
	}
	var (
		a        archivedAt
		archived *int64
		page     *int32
		frame    []byte
		frags    []fragPage
	)
	if _, err := pgx.ForEachRow(rows, []any{&a.key, &a.through, &archived, &page, &frame}, func() error {
		if page != nil {
			frags = append(frags, fragPage{*page, frame}) // pgx scans each bytea into a new slice
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("builds: output of %s in project %s: %w", invocationID, project, err)
	}
	var out []byte
	if a.through == nil {
		var dec decompressor
		switch {
		case len(frags) > 0:
			if out, err = dec.appendTo(nil, frags[0].data); err != nil {
				err = fmt.Errorf("page %d of stream %d: %w", n, stream, err)
			}
		case n == 0: // folded before pages?
			err = outputPages(ctx, r.DB, k, stream, 0, 0, func(_ int32, plain []byte) error {
				out = append([]byte{}, plain...)
				return nil
			})
		}
	} else {
		a.bytes[stream-1] = *archived
		out, err = r.archivedPage(ctx, k, a, stream, n, frags)
	}
	if err != nil {
		return nil, fmt.Errorf("builds: output of %s in project %s: %w", invocationID, project, err)
	}
	if len(out) == 0 {
		return nil, ErrNotFound
	}
	return out, nil
}

// archivedAt is where a build's moved output is: its object, the stream
// sequence of the last message whose output it holds, its size per stream.
type archivedAt struct {
	key     *string
	through *int64
	bytes   [2]int64
}

// fragPage is a page of the output of events after the archived ones.
type fragPage struct {
	page int32
	data []byte
}

// archivedPage cuts page n of stream out of the archived output and the
// pages after it (frags: those that hold any of the page's bytes).
func (r OutputReader) archivedPage(ctx context.Context, k invKey, a archivedAt, stream int16, n int32, frags []fragPage) ([]byte, error) {
	lo, hi, archived := int64(n)*OutputPageBytes, int64(n+1)*OutputPageBytes, a.bytes[stream-1]
	var out []byte
	if lo < archived {
		msgs, err := r.messages(ctx, a)
		if err != nil {
			return nil, err
		}
		want, pos := min(hi, archived), int64(0)
		if _, err := walkArchived(k, msgs, uint64(*a.through), func(_ uint64, o, e []byte) error {
			p := o
			if stream == StreamStderr {
				p = e
			}
			if end := pos + int64(len(p)); end > lo {
				out = append(out, p[max(lo-pos, 0):min(want-pos, int64(len(p)))]...)
			}
			if pos += int64(len(p)); pos >= want {
				return errStop
			}
			return nil
		}); err != nil {
			return nil, fmt.Errorf("archive object %s: %w", *a.key, err)
		}
		if pos < want {
			return nil, fmt.Errorf("archive object %s: its messages up to %d fold to %d bytes of stream %d, %d were moved into it",
				*a.key, *a.through, pos, stream, archived)
		}
	}
	var dec decompressor
	for _, f := range frags {
		plain, err := dec.decode(f.data)
		if err != nil {
			return nil, fmt.Errorf("page %d of stream %d after the archived output: %w", f.page, stream, err)
		}
		at := archived + int64(f.page)*OutputPageBytes // where the page's bytes are in the whole
		from, to := max(lo-at, 0), min(hi-at, int64(len(plain)))
		if from < to {
			out = append(out, plain[from:to]...)
		}
	}
	return out, nil
}

// messages walks the object a build's output moved into.
func (r OutputReader) messages(ctx context.Context, a archivedAt) (Messages, error) {
	if r.Archive == nil {
		return nil, fmt.Errorf("the output is in archive object %s: %w", *a.key, ErrNoArchive)
	}
	return func(fn func(m projection.Message) error) error { return r.Archive.Messages(ctx, *a.key, fn) }, nil
}

// Output returns the build's console output as Bazel printed it
// (WriteOutput into memory).
func (r OutputReader) Output(ctx context.Context, project, invocationID string) (stdout, stderr []byte, err error) {
	var o, e bytes.Buffer
	if err := r.WriteOutput(ctx, project, invocationID, &o, &e); err != nil {
		return nil, nil, err
	}
	return append([]byte{}, o.Bytes()...), append([]byte{}, e.Bytes()...), nil
}

// WriteOutput writes the console output of the build of project with the
// given invocation id as Bazel printed it (the progress events' stdout and
// stderr) to stdout and stderr, whether or not the build has finished, as
// it reads it: the archived output, then the pages, then the scratch
// chunks of a build still running. It returns ErrNotFound for an unknown
// build, before writing anything.
func (r OutputReader) WriteOutput(ctx context.Context, project, invocationID string, stdout, stderr io.Writer) error {
	var exists bool
	if err := r.DB.QueryRow(ctx, `select exists (select 1 from invocations where id = $1 and project = $2)`,
		invocationID, project).Scan(&exists); err != nil {
		return fmt.Errorf("builds: output %s of project %s: %w", invocationID, project, err)
	}
	if !exists {
		return ErrNotFound
	}
	if err := r.writeOutput(ctx, invKey{project, invocationID}, [2]io.Writer{stdout, stderr}); err != nil {
		return fmt.Errorf("builds: output %s of project %s: %w", invocationID, project, err)
	}
	return nil
}

// outputPages calls fn with pages from..to of one stream of a build's
// folded output in PostgreSQL, in order: build_output_pages, or for a
// build folded before migration 012 its one build_output row (page 0,
// whatever its size).
func outputPages(ctx context.Context, db Querier, k invKey, stream int16, from, to int32, fn func(page int32, plain []byte) error) error {
	rows, err := db.Query(ctx, sqlOutputPages, k.id, k.project, stream, from, to)
	if err != nil {
		return err
	}
	var (
		dec   decompressor
		page  int32
		frame []byte
		seen  bool
	)
	if _, err := pgx.ForEachRow(rows, []any{&page, &frame}, func() error {
		seen = true
		plain, err := dec.decode(frame)
		if err != nil {
			return fmt.Errorf("page %d of stream %d: %w", page, stream, err)
		}
		return fn(page, plain)
	}); err != nil || seen || from > 0 {
		return err
	}
	col := "stdout"
	if stream == StreamStderr {
		col = "stderr"
	}
	err = db.QueryRow(ctx, `select `+col+` from build_output where invocation_id = $1 and project = $2`, k.id, k.project).Scan(&frame)
	if errors.Is(err, pgx.ErrNoRows) {
		return nil
	}
	if err != nil {
		return err
	}
	plain, err := dec.decode(frame)
	if err != nil {
		return fmt.Errorf("stored output of stream %d: %w", stream, err)
	}
	if len(plain) == 0 {
		return nil
	}
	return fn(0, plain)
}

// readOutput is Output's body (OutputReader.writeOutput without an
// archive, into memory).
func readOutput(ctx context.Context, db Querier, k invKey) (stdout, stderr []byte, err error) {
	var o, e bytes.Buffer
	if err := (OutputReader{DB: db}).writeOutput(ctx, k, [2]io.Writer{&o, &e}); err != nil {
		return nil, nil, err
	}
	return append([]byte{}, o.Bytes()...), append([]byte{}, e.Bytes()...), nil
}

// writeOutput writes the build's folded output (from the archive and the
// pages after it, or from the pages, or from its row of before pages),
// then its scratch chunks, to w (stdout, stderr).
func (r OutputReader) writeOutput(ctx context.Context, k invKey, w [2]io.Writer) error {
	rows, err := r.DB.Query(ctx, sqlOutputAll, k.id, k.project)
	if err != nil {
		return err
	}
	var (
		a      archivedAt
		stream *int16
		page   *int32
		frame  []byte
		dec    decompressor
		frags  [2][]fragPage
		pages  int
	)
	// In PostgreSQL, the pages are written as they come; moved, they come
	// after the archived output and wait for it (the output of late
	// events: a few pages at most).
	_, err = pgx.ForEachRow(rows, []any{&a.key, &a.through, &a.bytes[0], &a.bytes[1], &stream, &page, &frame}, func() error {
		switch {
		case stream == nil:
		case a.through != nil:
			frags[*stream-1] = append(frags[*stream-1], fragPage{*page, frame})
		default:
			pages++
			plain, err := dec.decode(frame)
			if err != nil {
				return fmt.Errorf("page %d of stream %d: %w", *page, *stream, err)
			}
			_, err = w[*stream-1].Write(plain)
			return err
		}
		return nil
	})
	switch {
	case err != nil:
		return err
	case a.through != nil:
		if err := r.writeArchived(ctx, k, a, frags, w); err != nil {
			return err
		}
	case pages == 0: // folded before pages?
		for i, stream := range [2]int16{StreamStdout, StreamStderr} {
			if err := outputPages(ctx, r.DB, k, stream, 0, 0, func(_ int32, plain []byte) error {
				_, err := w[i].Write(plain)
				return err
			}); err != nil {
				return err
			}
		}
	}
	rows, err = r.DB.Query(ctx, `select stdout, stderr from build_output_chunks
		where invocation_id = $1 and project = $2 order by first_seq`, k.id, k.project)
	if err != nil {
		return err
	}
	var o, e []byte
	_, err = pgx.ForEachRow(rows, []any{&o, &e}, func() error {
		for i, frame := range [2][]byte{o, e} {
			if len(frame) == 0 {
				continue
			}
			plain, err := dec.decode(frame)
			if err != nil {
				return err
			}
			if _, err := w[i].Write(plain); err != nil {
				return err
			}
		}
		return nil
	})
	return err
}

// writeArchived writes a moved build's archived output, checked against
// the sizes recorded, then the pages of its later events.
func (r OutputReader) writeArchived(ctx context.Context, k invKey, a archivedAt, frags [2][]fragPage, w [2]io.Writer) error {
	msgs, err := r.messages(ctx, a)
	if err != nil {
		return err
	}
	var got [2]int64
	if _, err := walkArchived(k, msgs, uint64(*a.through), func(_ uint64, o, e []byte) error {
		for i, p := range [2][]byte{o, e} {
			if len(p) > 0 {
				got[i] += int64(len(p))
				if _, err := w[i].Write(p); err != nil {
					return err
				}
			}
		}
		return nil
	}); err != nil {
		return fmt.Errorf("archive object %s: %w", *a.key, err)
	}
	if got != a.bytes {
		return fmt.Errorf("archive object %s: its messages up to %d fold to %d and %d bytes of output, %d and %d were moved into it",
			*a.key, *a.through, got[0], got[1], a.bytes[0], a.bytes[1])
	}
	var dec decompressor
	for i, fs := range frags {
		for _, f := range fs {
			plain, err := dec.decode(f.data)
			if err != nil {
				return fmt.Errorf("page %d of stream %d after the archived output: %w", f.page, i+1, err)
			}
			if _, err := w[i].Write(plain); err != nil {
				return err
			}
		}
	}
	return nil
}
