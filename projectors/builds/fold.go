package builds

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
)

// OutputPageBytes is the size of a page of console output: each stream of a
// build is cut every OutputPageBytes bytes of its uncompressed output (the
// last page holds the rest), and each page is one zstd frame made with the
// canonical encoder. The cut depends only on the bytes, so live and replay
// store identical pages. Changing it changes every page: it needs a
// migration that folds the stored output again.
const OutputPageBytes = 64 << 10

// Stream numbers of build_output_pages.stream.
const (
	StreamStdout int16 = 1
	StreamStderr int16 = 2
)

// Bounds of one fold's memory, whatever the size of the build's output: it
// reads the scratch chunks foldGroup at a time and writes pages once
// foldPages of them are made.
const (
	foldGroup = 8
	foldPages = 16
)

// sqlLastPages reads, for each build and stream, the number and size of its
// last page, and the page itself when it is not full (a late event appends
// to it). Full pages are not read.
const sqlLastPages = `
select u.project, u.id, s.stream, p.page, p.bytes, p.data
from unnest($1::text[], $2::text[]) as u(project, id)
cross join (values (1::int2), (2::int2)) as s(stream)
cross join lateral (
    select o.page, o.bytes, case when o.bytes < $3 then o.data end as data
    from build_output_pages o
    where o.invocation_id = u.id and o.project = u.project and o.stream = s.stream
    order by o.page desc limit 1) p`

// sqlLegacyOutput reads the output rows folded before migration 012 (one
// frame per stream), which a late event of their build moves into pages.
const sqlLegacyOutput = `
select o.project, o.invocation_id, o.stdout, o.stderr
from unnest($1::text[], $2::text[]) as u(project, id)
join build_output o on o.invocation_id = u.id and o.project = u.project`

const sqlChunksAfter = `
select first_seq, stdout, stderr from build_output_chunks
where invocation_id = $1 and project = $2 and first_seq > $3
order by first_seq limit $4`

const sqlPutPages = `
insert into build_output_pages as o (invocation_id, project, stream, page, bytes, data)
select * from unnest($1::text[], $2::text[], $3::int2[], $4::int4[], $5::int4[], $6::bytea[])
on conflict (invocation_id, project, stream, page) do update set bytes = excluded.bytes, data = excluded.data`

const sqlDropLegacyOutput = `
delete from build_output o
using unnest($1::text[], $2::text[]) as u(project, id)
where o.invocation_id = u.id and o.project = u.project`

// pageRows are pages to write, as sqlPutPages' arguments.
type pageRows struct {
	inv, project []string
	stream       []int16
	page, bytes  []int32
	data         [][]byte
}

func (r *pageRows) add(k invKey, stream int16, page int32, src []byte) {
	r.inv = append(r.inv, k.id)
	r.project = append(r.project, k.project)
	r.stream = append(r.stream, stream)
	r.page = append(r.page, page)
	r.bytes = append(r.bytes, int32(len(src)))
	r.data = append(r.data, compress(src))
}

func (r *pageRows) args() []any {
	return []any{r.inv, r.project, r.stream, r.page, r.bytes, r.data}
}

// pageWriter cuts one stream of one build into pages.
type pageWriter struct {
	key    invKey
	stream int16
	page   int32  // the page buf holds
	buf    []byte // its bytes so far
	dirty  bool   // buf differs from the stored page
	out    *pageRows
}

func (w *pageWriter) write(p []byte) {
	for len(p) > 0 {
		if w.buf == nil {
			w.buf = make([]byte, 0, OutputPageBytes)
		}
		n := min(len(p), OutputPageBytes-len(w.buf))
		w.buf = append(w.buf, p[:n]...)
		w.dirty = true
		p = p[n:]
		if len(w.buf) == OutputPageBytes {
			w.out.add(w.key, w.stream, w.page, w.buf)
			w.page, w.buf, w.dirty = w.page+1, w.buf[:0], false
		}
	}
}

// flush emits the last, partial page if it changed.
func (w *pageWriter) flush() {
	if w.dirty && len(w.buf) > 0 {
		w.out.add(w.key, w.stream, w.page, w.buf)
	}
	w.dirty = false
}

// lastPage is what sqlLastPages says of one stream.
type lastPage struct {
	page  int32
	bytes int32
	data  []byte
}

// fold appends the output of the given invocations (what the tables hold:
// scratch chunks, and for a build that was folded before, its last page;
// then the batch's own) to their pages, deletes the chunks, and queues the
// last writes in b. It holds at most foldGroup chunks and foldPages pages
// of one build at a time. ids is sorted.
func fold(ctx context.Context, tx pgx.Tx, b *pgx.Batch, fin map[invKey]*inv, ids []invKey) error {
	last := map[invKey]*[2]lastPage{}
	legacy := map[invKey][2][]byte{}
	var storedIDs []invKey
	for _, id := range ids {
		if fin[id].stored {
			storedIDs = append(storedIDs, id)
		}
	}
	if len(storedIDs) > 0 {
		projects, invs := splitKeys(storedIDs)
		rb := &pgx.Batch{}
		var (
			k      invKey
			stream int16
			lp     lastPage
			o, e   []byte
		)
		rb.Queue(sqlLastPages, projects, invs, OutputPageBytes).Query(func(rows pgx.Rows) error {
			_, err := pgx.ForEachRow(rows, []any{&k.project, &k.id, &stream, &lp.page, &lp.bytes, &lp.data}, func() error {
				l := last[k]
				if l == nil {
					l = &[2]lastPage{{page: -1}, {page: -1}}
					last[k] = l
				}
				l[stream-1] = lastPage{lp.page, lp.bytes, append([]byte(nil), lp.data...)}
				return nil
			})
			return err
		})
		rb.Queue(sqlLegacyOutput, projects, invs).Query(func(rows pgx.Rows) error {
			_, err := pgx.ForEachRow(rows, []any{&k.project, &k.id, &o, &e}, func() error {
				legacy[k] = [2][]byte{append([]byte(nil), o...), append([]byte(nil), e...)}
				return nil
			})
			return err
		})
		if err := tx.SendBatch(ctx, rb).Close(); err != nil {
			return fmt.Errorf("builds: read output: %w", err)
		}
	}
	var (
		out              pageRows
		dropChunks, drop []invKey
		dec              decompressor
	)
	flush := func() error {
		if len(out.inv) == 0 {
			return nil
		}
		_, err := tx.Exec(ctx, sqlPutPages, out.args()...)
		out = pageRows{}
		return err
	}
	for _, id := range ids {
		v := fin[id]
		ws := [2]*pageWriter{{key: id, stream: StreamStdout, out: &out}, {key: id, stream: StreamStderr, out: &out}}
		if l := last[id]; l != nil {
			for i, p := range l {
				switch {
				case p.page < 0:
				case p.bytes < OutputPageBytes:
					buf, err := dec.appendTo(make([]byte, 0, OutputPageBytes), p.data)
					if err != nil {
						return fmt.Errorf("builds: invocation %s of project %s: page %d of stream %d: %w", id.id, id.project, p.page, i+1, err)
					}
					ws[i].page, ws[i].buf = p.page, buf
				default:
					ws[i].page = p.page + 1
				}
			}
		}
		if l, ok := legacy[id]; ok {
			drop = append(drop, id)
			for i, frame := range l {
				whole, err := dec.appendTo(nil, frame)
				if err != nil {
					return fmt.Errorf("builds: invocation %s of project %s: stored output: %w", id.id, id.project, err)
				}
				ws[i].write(whole)
			}
		}
		if v.stored {
			n, err := foldChunks(ctx, tx, id, &dec, ws, flush)
			if err != nil {
				return fmt.Errorf("builds: invocation %s of project %s: fold output: %w", id.id, id.project, err)
			}
			if n > 0 {
				dropChunks = append(dropChunks, id)
			}
		}
		ws[0].write(v.stdout)
		ws[1].write(v.stderr)
		ws[0].flush()
		ws[1].flush()
		if len(out.inv) >= foldPages {
			if err := flush(); err != nil {
				return fmt.Errorf("builds: write output: %w", err)
			}
		}
	}
	if len(out.inv) > 0 {
		b.Queue(sqlPutPages, out.args()...)
	}
	if len(dropChunks) > 0 {
		projects, invs := splitKeys(dropChunks)
		b.Queue(sqlDropChunks, projects, invs)
	}
	if len(drop) > 0 {
		projects, invs := splitKeys(drop)
		b.Queue(sqlDropLegacyOutput, projects, invs)
	}
	return nil
}

// foldChunks feeds a build's scratch chunks, in order, to its page writers,
// writing pages (flush) as they fill; it returns how many it read.
func foldChunks(ctx context.Context, tx pgx.Tx, id invKey, dec *decompressor, ws [2]*pageWriter, flush func() error) (int, error) {
	type chunk struct{ stdout, stderr []byte }
	after, total := int64(-1), 0
	for {
		rows, err := tx.Query(ctx, sqlChunksAfter, id.id, id.project, after, foldGroup)
		if err != nil {
			return total, err
		}
		var group []chunk
		var c chunk
		_, err = pgx.ForEachRow(rows, []any{&after, &c.stdout, &c.stderr}, func() error {
			group = append(group, c) // pgx scans each bytea into a new slice
			return nil
		})
		if err != nil {
			return total, err
		}
		total += len(group)
		for _, c := range group {
			for i, frame := range [2][]byte{c.stdout, c.stderr} {
				if len(frame) == 0 {
					continue
				}
				plain, err := dec.decode(frame)
				if err != nil {
					return total, fmt.Errorf("chunk before %d: %w", after, err)
				}
				ws[i].write(plain)
			}
			if len(ws[0].out.inv) >= foldPages {
				if err := flush(); err != nil {
					return total, err
				}
			}
		}
		if len(group) < foldGroup {
			return total, nil
		}
	}
}
