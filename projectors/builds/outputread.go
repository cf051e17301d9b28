package builds

import (
	"context"
	"errors"
	"fmt"
	"math"

	"github.com/jackc/pgx/v5"
)

// The reads of a build's console output: its sizes, a page, the whole.

// The queries of the output reads (build_output_pages' primary key,
// TestPagedReadsUseTheIndex).
const (
	sqlOutputPages = `select page, data from build_output_pages
where invocation_id = $1 and project = $2 and stream = $3 and page between $4 and $5 order by page`
	sqlOutputSize = `select stream, count(*)::int4, sum(bytes)::int8 from build_output_pages
where invocation_id = $1 and project = $2 group by stream`
)

// OutputSize is how much folded console output a build has, per stream.
type OutputSize struct {
	StdoutBytes, StderrBytes int64
	StdoutPages, StderrPages int32
}

// OutputSizes returns the size of the build's folded output: pages of
// OutputPageBytes (the last one shorter). A build still running has none
// yet (Output reads its scratch chunks too).
func OutputSizes(ctx context.Context, db Querier, project, invocationID string) (OutputSize, error) {
	var s OutputSize
	rows, err := db.Query(ctx, sqlOutputSize, invocationID, project)
	if err != nil {
		return s, fmt.Errorf("builds: output size of %s in project %s: %w", invocationID, project, err)
	}
	var (
		stream int16
		pages  int32
		n      int64
	)
	if _, err := pgx.ForEachRow(rows, []any{&stream, &pages, &n}, func() error {
		if stream == StreamStdout {
			s.StdoutPages, s.StdoutBytes = pages, n
		} else {
			s.StderrPages, s.StderrBytes = pages, n
		}
		return nil
	}); err != nil {
		return s, fmt.Errorf("builds: output size of %s in project %s: %w", invocationID, project, err)
	}
	if s.StdoutPages == 0 && s.StderrPages == 0 {
		err := db.QueryRow(ctx, `select stdout_bytes, stderr_bytes from build_output where invocation_id = $1 and project = $2`,
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

// OutputPage returns page n (from 0) of one stream (StreamStdout or
// StreamStderr) of the build's folded output, or ErrNotFound.
func OutputPage(ctx context.Context, db Querier, project, invocationID string, stream int16, n int32) ([]byte, error) {
	var out []byte
	found := false
	err := outputPages(ctx, db, invKey{project, invocationID}, stream, n, n, func(_ int32, plain []byte) error {
		out, found = append([]byte{}, plain...), true
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("builds: output of %s in project %s: %w", invocationID, project, err)
	}
	if !found {
		return nil, ErrNotFound
	}
	return out, nil
}

// outputPages calls fn with pages from..to of one stream of a build's
// folded output, in order. It is the one place that knows where folded
// output lives: build_output_pages, or for a build folded before migration
// 012 its one build_output row (page 0, whatever its size).
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

// readOutput is Output's body: the folded pages of each stream, then the
// scratch chunks of a build still running.
func readOutput(ctx context.Context, db Querier, k invKey) (stdout, stderr []byte, err error) {
	stdout, stderr = []byte{}, []byte{}
	for _, s := range []struct {
		stream int16
		dst    *[]byte
	}{{StreamStdout, &stdout}, {StreamStderr, &stderr}} {
		if err := outputPages(ctx, db, k, s.stream, 0, math.MaxInt32, func(_ int32, plain []byte) error {
			*s.dst = append(*s.dst, plain...)
			return nil
		}); err != nil {
			return nil, nil, err
		}
	}
	rows, err := db.Query(ctx, `select stdout, stderr from build_output_chunks
		where invocation_id = $1 and project = $2 order by first_seq`, k.id, k.project)
	if err != nil {
		return nil, nil, err
	}
	var (
		dec  decompressor
		o, e []byte
	)
	_, err = pgx.ForEachRow(rows, []any{&o, &e}, func() error {
		var err error
		if stdout, err = dec.appendTo(stdout, o); err != nil {
			return err
		}
		stderr, err = dec.appendTo(stderr, e)
		return err
	})
	if err != nil {
		return nil, nil, err
	}
	return stdout, stderr, nil
}
