package archive

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/schemas/envelope"
)

// VerifyOptions choose the builds Verify reads.
type VerifyOptions struct {
	// Project and ID, when set, restrict it to one project, one id.
	Project, ID string
	// Progress, when set, is called after each build with the builds
	// checked so far and the total.
	Progress func(done, total int)
}

// Finding is the verdict on one archived build.
type Finding struct {
	Project    string `json:"project"`
	Invocation string `json:"invocation"`
	Key        string `json:"key"`
	Events     int64  `json:"events"`
	// InStream is how many of its messages the stream still holds and
	// were compared one by one.
	InStream int64 `json:"in_stream"`
	// Error is what is wrong; empty: the build is good.
	Error string `json:"error,omitempty"`
}

// Summary counts what Verify found.
type Summary struct {
	Builds int `json:"builds"`
	Bad    int `json:"bad"`
}

// Verify reads back every archived build that opts select and checks it:
// the object decodes whole (trailer, checksum) to what archived_builds
// recorded; event by event (sequence, stored time, subject, every header,
// data) against the stream while the stream still holds the build's
// messages; and against the projection (its tool events, counted as the
// projector counts them, and its last tool sequence equal the
// invocations row's). It records each verdict in archived_builds and
// calls report with it. An error is returned only when the database
// fails; a bucket or stream failure is the build's finding.
func Verify(ctx context.Context, pool *pgxpool.Pool, store BuildStore, src Source, opts VerifyOptions, report func(Finding)) (Summary, error) {
	rows, err := pool.Query(ctx, `
select a.project, a.invocation_id, a.object_key, a.events, a.first_seq, a.last_seq,
       coalesce(i.event_count, -1), coalesce(i.last_sequence, -1)
from archived_builds a
left join invocations i on i.id = a.invocation_id and i.project = a.project
where a.object_key <> '' and ($1 = '' or a.project = $1) and ($2 = '' or a.invocation_id = $2)
order by a.project collate "C", a.invocation_id collate "C"`, opts.Project, opts.ID)
	if err != nil {
		return Summary{}, fmt.Errorf("archive: verify: %w", err)
	}
	type row struct {
		Finding
		first, last, count, lastTool int64
	}
	all, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (x row, err error) {
		return x, r.Scan(&x.Project, &x.Invocation, &x.Key, &x.Events, &x.first, &x.last, &x.count, &x.lastTool)
	})
	if err != nil {
		return Summary{}, fmt.Errorf("archive: verify: %w", err)
	}
	dicts := NewDicts(store)
	var sum Summary
	for i, x := range all {
		f := x.Finding
		want := Stats{Messages: uint64(x.Events), FirstSeq: uint64(x.first), LastSeq: uint64(x.last)}
		f.InStream, err = verifyOne(ctx, store, dicts, src, f, want, x.count, x.lastTool)
		var verr *string
		if err != nil {
			f.Error = err.Error()
			verr = &f.Error
			sum.Bad++
		}
		sum.Builds++
		if _, err := pool.Exec(ctx, `update archived_builds set verified_at = now(), verify_error = $3
where invocation_id = $1 and project = $2`, f.Invocation, f.Project, verr); err != nil {
			return sum, fmt.Errorf("archive: record verdict on %s of project %s: %w", f.Invocation, f.Project, err)
		}
		report(f)
		if opts.Progress != nil {
			opts.Progress(i+1, len(all))
		}
	}
	return sum, nil
}

// verifyOne checks one object against the stream and the projection.
func verifyOne(ctx context.Context, store BuildStore, dicts *Dicts, src Source, f Finding, want Stats, count, lastTool int64) (inStream int64, err error) {
	rc, err := store.NewReader(ctx, f.Key)
	if err != nil {
		return 0, err
	}
	defer rc.Close()
	r, err := NewReader(rc, dicts.Loader(ctx))
	if err != nil {
		return 0, err
	}
	defer r.Close()
	var (
		tools, maxTool int64
		next           *Message // the next archived message not yet compared
		started        bool     // the stream held one of the archive's messages
	)
	advance := func() error {
		m, err := r.Next()
		if err == io.EOF {
			next = nil
			return nil
		}
		if err != nil {
			return err
		}
		if m.Header(envelope.Kind) == envelope.KindTool {
			if s, _ := strconv.ParseInt(m.Header(envelope.Sequence), 10, 64); s > maxTool {
				maxTool, tools = s, tools+1
			}
		}
		next = m
		return nil
	}
	if err := advance(); err != nil {
		return 0, err
	}
	errStop := errors.New("stop")
	err = read(ctx, src, src.Subject(f.Project, f.Invocation), func(sm *Message) error {
		if sm.Sequence > want.LastSeq {
			return errStop // late events, after the object: the archiver rewrites it
		}
		// Archived messages below the stream's first are gone from the
		// stream (its age limit); one missing after that is a difference.
		for next != nil && next.Sequence < sm.Sequence {
			if started {
				return fmt.Errorf("message %d is in the archive, not in the stream", next.Sequence)
			}
			if err := advance(); err != nil {
				return err
			}
		}
		if next == nil || next.Sequence != sm.Sequence {
			return fmt.Errorf("message %d of the stream is not in the archive", sm.Sequence)
		}
		if d := differ(next, sm); d != "" {
			return fmt.Errorf("message %d differs from the stream's: %s", sm.Sequence, d)
		}
		started, inStream = true, inStream+1
		return advance()
	})
	if err != nil && !errors.Is(err, errStop) {
		return inStream, err
	}
	for next != nil {
		if started {
			return inStream, fmt.Errorf("message %d is in the archive, not in the stream", next.Sequence)
		}
		if err := advance(); err != nil {
			return inStream, err
		}
	}
	got := r.Stats()
	got.RawBytes, got.Checksum = 0, 0
	if got != want {
		return inStream, fmt.Errorf("the object holds %d messages (%d-%d), archived_builds records %d (%d-%d)",
			got.Messages, got.FirstSeq, got.LastSeq, want.Messages, want.FirstSeq, want.LastSeq)
	}
	switch {
	case count < 0:
		return inStream, errors.New("the projection has no such build")
	case tools != count || maxTool != lastTool:
		return inStream, fmt.Errorf("the object holds %d tool events up to sequence %d, the projection %d up to %d", tools, maxTool, count, lastTool)
	}
	return inStream, nil
}

// differ says how two messages differ ("" when they do not).
func differ(a, b *Message) string {
	switch {
	case a.SubjectName != b.SubjectName:
		return fmt.Sprintf("subject %q, stream %q", a.SubjectName, b.SubjectName)
	case !a.Stored.Equal(b.Stored):
		return fmt.Sprintf("stored at %s, stream %s", a.Stored.Format(time.RFC3339Nano), b.Stored.Format(time.RFC3339Nano))
	case !bytes.Equal(a.Payload, b.Payload):
		return fmt.Sprintf("data of %d bytes, stream %d", len(a.Payload), len(b.Payload))
	case !maps.EqualFunc(a.Headers, b.Headers, slices.Equal[[]string]):
		return fmt.Sprintf("headers %v, stream %v", a.Headers, b.Headers)
	}
	return ""
}
