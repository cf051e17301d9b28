package builds

import (
	"context"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/bep"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
)

// fleet makes the messages of `builds` copies of the recorded Bazel build,
// each with its own invocation id, running `concurrent` at a time and
// interleaved as their events would arrive.
//
// The recorded build is quick and prints little (7 KB); with bigOutput each
// progress event is padded to about 900 bytes of Bazel-like progress lines,
// as in the 50-target build of docs/design.md, "Bazel as a client" (~125 KB
// of output over 141 events).
func fleet(tb testing.TB, prefix string, builds, concurrent int, bigOutput bool) []*msg {
	tmpl := fixtureMessages(tb)
	obes := make([]*buildpb.OrderedBuildEvent, len(tmpl))
	line := 0
	for i, m := range tmpl {
		obes[i] = new(buildpb.OrderedBuildEvent)
		if err := proto.Unmarshal(m.data, obes[i]); err != nil {
			tb.Fatal(err)
		}
		any := obes[i].GetEvent().GetBazelEvent()
		if !bigOutput || any == nil {
			continue
		}
		var be bep.BuildEvent
		if err := proto.Unmarshal(any.Value, &be); err != nil {
			tb.Fatal(err)
		}
		if p := be.GetProgress(); p != nil {
			var sb strings.Builder
			sb.WriteString(p.Stderr)
			for sb.Len() < 900 {
				line++
				fmt.Fprintf(&sb, "\r\x1b[1A\x1b[K[%d / %d] %d actions, %d running\n    Executing genrule //pkg%02d:genrule_ok_%03d; %ds linux-sandbox\n",
					line, 412, line%7+1, line%4+1, line%5, line%50, line%9)
			}
			p.Stderr = sb.String()
			any.Value, _ = proto.Marshal(&be)
		}
	}
	copyOf := func(n int) []*msg {
		inv := fmt.Sprintf("%s-%06d", prefix, n)
		out := make([]*msg, len(tmpl))
		for i, m := range tmpl {
			c := *m
			c.hdr = make(map[string]string, len(m.hdr))
			for k, v := range m.hdr {
				c.hdr[k] = v
			}
			if c.hdr[envelope.InvocationID] != "" {
				c.hdr[envelope.InvocationID] = inv
				obe := proto.Clone(obes[i]).(*buildpb.OrderedBuildEvent)
				obe.StreamId.InvocationId = inv
				c.data, _ = proto.Marshal(obe)
			}
			out[i] = &c
		}
		return out
	}
	var all []*msg
	for start := 0; start < builds; start += concurrent {
		var parts [][]*msg
		for n := start; n < min(start+concurrent, builds); n++ {
			parts = append(parts, copyOf(n))
		}
		all = append(all, interleave(t0, 1, parts...)...)
	}
	for i, m := range all {
		m.seq = uint64(i + 1)
	}
	return all
}

// cpuTime is this process's user+system CPU time.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// backendCPU reads a PostgreSQL backend's CPU time from /proc (the server
// runs on this machine in tests); ok is false where it cannot.
func backendCPU(pid uint32) (time.Duration, bool) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, false
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+2:])
	if len(f) < 13 {
		return 0, false
	}
	ut, _ := strconv.ParseInt(f[11], 10, 64)
	st, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(ut+st) * 10 * time.Millisecond, true // USER_HZ = 100
}

func walLSN(tb testing.TB, pool *pgxpool.Pool) int64 {
	var lsn int64
	if err := pool.QueryRow(context.Background(), `select pg_current_wal_lsn() - '0/0'::pg_lsn`).Scan(&lsn); err != nil {
		tb.Fatal(err)
	}
	return lsn
}

// BenchmarkApply projects copies of the recorded Bazel build in batches of
// 1000 through one connection and reports, per BES event: projector
// (this process) CPU, PostgreSQL backend CPU and WAL bytes. WAL is the
// whole server's, so other databases' activity on it inflates the figure.
//
//	go test ./projectors/builds -run '^$' -bench Apply -benchtime 3x
func BenchmarkApply(b *testing.B) {
	for _, c := range []struct {
		builds, concurrent int
		bigOutput          bool
	}{{40, 10, false}, {200, 200, false}, {40, 10, true}, {200, 200, true}} {
		b.Run(fmt.Sprintf("builds=%d/concurrent=%d/output=%s", c.builds, c.concurrent,
			map[bool]string{false: "recorded", true: "125KB"}[c.bigOutput]), func(b *testing.B) {
			pool, _ := testenv.Pool(b)
			ctx := context.Background()
			conn, err := pool.Acquire(ctx)
			if err != nil {
				b.Fatal(err)
			}
			defer conn.Release()
			pid := conn.Conn().PgConn().PID()
			p := newProjector(b, Config{})
			var events int
			var goCPU, pgCPU time.Duration
			var wal int64
			pgOK := true
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				msgs := fleet(b, fmt.Sprintf("b%d", i), c.builds, c.concurrent, c.bigOutput)
				batches := make([][]projection.Message, 0, len(msgs)/1000+1)
				for j := 0; j < len(msgs); j += 1000 {
					var batch []projection.Message
					for _, m := range msgs[j:min(j+1000, len(msgs))] {
						batch = append(batch, m)
					}
					batches = append(batches, batch)
				}
				if _, err := conn.Exec(ctx, "checkpoint"); err != nil {
					b.Logf("checkpoint: %v (WAL figures include full-page images)", err)
				}
				lsn0 := walLSN(b, pool)
				pg0, ok := backendCPU(pid)
				pgOK = pgOK && ok
				cpu0 := cpuTime()
				b.StartTimer()
				for _, batch := range batches {
					if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return p.Apply(ctx, tx, batch) }); err != nil {
						b.Fatal(err)
					}
				}
				b.StopTimer()
				goCPU += cpuTime() - cpu0
				pg1, _ := backendCPU(pid)
				pgCPU += pg1 - pg0
				lsn1 := walLSN(b, pool)
				wal += lsn1 - lsn0
				if os.Getenv("MILLRACE_WALINSPECT") != "" {
					walStats(b, pool, lsn0, lsn1, len(msgs))
				}
				events += len(msgs)
				b.StartTimer()
			}
			b.ReportMetric(float64(events)/b.Elapsed().Seconds(), "events/s")
			b.ReportMetric(float64(events)/goCPU.Seconds(), "events/go-cpu-s")
			if pgOK && pgCPU > 0 {
				b.ReportMetric(float64(events)/pgCPU.Seconds(), "events/pg-cpu-s")
			}
			b.ReportMetric(float64(wal)/float64(events), "wal-B/event")
			if testing.Verbose() {
				rows, _ := pool.Query(ctx, `select relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del
					from pg_stat_user_tables order by relname`)
				for rows.Next() {
					var name string
					var ins, upd, hot, del int64
					rows.Scan(&name, &ins, &upd, &hot, &del)
					b.Logf("%-20s ins %7d upd %7d hot %7d del %7d", name, ins, upd, hot, del)
				}
				rows.Close()
			}
		})
	}
}

// BenchmarkDecode measures the projector's own work per event without a
// database: decoding and merging a recorded build.
func BenchmarkDecode(b *testing.B) {
	msgs := fixtureMessages(b)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		s := newState()
		evs := make([]event, 0, len(msgs))
		for _, m := range msgs {
			ev, keep, err := decodeMessage(m)
			if err != nil {
				b.Fatal(err)
			}
			if keep {
				evs = append(evs, ev)
				s.add(&evs[len(evs)-1])
			}
		}
		for j := range evs {
			s.apply(&evs[j])
		}
	}
	b.ReportMetric(float64(b.N*len(msgs))/b.Elapsed().Seconds(), "events/s")
}

// walStats logs WAL by record type between two LSNs (pg_walinspect, a
// contrib extension of PostgreSQL 15), to see what the bytes are made of.
func walStats(tb testing.TB, pool *pgxpool.Pool, from, to int64, events int) {
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `create extension if not exists pg_walinspect`); err != nil {
		tb.Logf("pg_walinspect: %v", err)
		return
	}
	rows, err := pool.Query(ctx, `select "resource_manager/record_type", count, record_size, fpi_size
		from pg_get_wal_stats('0/0'::pg_lsn + $1::numeric, '0/0'::pg_lsn + $2::numeric, true)
		where count > 0 order by record_size + fpi_size desc limit 12`, from, to)
	if err != nil {
		tb.Logf("pg_get_wal_stats: %v", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var typ string
		var n, rec, fpi int64
		rows.Scan(&typ, &n, &rec, &fpi)
		tb.Logf("%-28s %8d records %10d B (%.1f B/event) fpi %d B", typ, n, rec, float64(rec)/float64(events), fpi)
	}
}

// paced makes the batches a runner takes from `streams` slow builds
// running at once, as the bench's paced-1000 load does (1,000 streams of
// 2.5 events/s, about 1,400 events per batch of 500 ms): each stream
// replays the bench's recordings (loadtest/fixtures, a build of 81 events
// and a test of 514, picked at random for each invocation; this package's
// recording when they are missing) back to back, and each batch holds
// `per` events, each the next event of a stream picked at random, so that a
// batch touches about as many invocations as it holds events. warm is the
// batches that first bring every stream to a random point of its first
// build (drained, 1000 events each), then come `n` paced batches.
func paced(tb testing.TB, prefix string, streams, per, n int, seed int64) (warm, batches [][]projection.Message) {
	var copiers []*copier
	recs, _ := filepath.Glob("../../loadtest/fixtures/*.besrec")
	for _, path := range recs {
		f, err := os.Open(path)
		if err != nil {
			tb.Fatal(err)
		}
		copiers = append(copiers, newCopier(tb, recordingMessages(tb, f)))
		f.Close()
	}
	if len(copiers) == 0 {
		copiers = append(copiers, newCopier(tb, fixtureMessages(tb)))
	}
	rng := rand.New(rand.NewSource(seed))
	type st struct {
		msgs []*msg
		next int
	}
	ss := make([]st, streams)
	built := 0
	refill := func(s *st) {
		c := copiers[rng.Intn(len(copiers))]
		s.msgs, s.next = c.invocation(fmt.Sprintf("%s-%06d", prefix, built)), 0
		built++
	}
	seq := uint64(0)
	now := t0
	emit := func(s *st) *msg {
		if s.next == len(s.msgs) {
			refill(s)
		}
		c := *s.msgs[s.next]
		s.next++
		seq++
		now = now.Add(400 * time.Microsecond) // 2,500 events/s
		c.seq, c.at = seq, now
		return &c
	}
	var pending []projection.Message
	for i := range ss {
		refill(&ss[i])
		for k := rng.Intn(len(ss[i].msgs)); k > 0; k-- {
			pending = append(pending, emit(&ss[i]))
		}
	}
	for len(pending) > 0 {
		k := min(1000, len(pending))
		warm = append(warm, pending[:k])
		pending = pending[k:]
	}
	for range n {
		batch := make([]projection.Message, 0, per)
		for range per {
			batch = append(batch, emit(&ss[rng.Intn(streams)]))
		}
		batches = append(batches, batch)
	}
	return warm, batches
}

// copier makes copies of a recorded build, each with its own invocation id.
type copier struct {
	tmpl []*msg
	obes []*buildpb.OrderedBuildEvent
}

func newCopier(tb testing.TB, tmpl []*msg) *copier {
	c := &copier{tmpl: tmpl, obes: make([]*buildpb.OrderedBuildEvent, len(tmpl))}
	for i, m := range tmpl {
		c.obes[i] = new(buildpb.OrderedBuildEvent)
		if err := proto.Unmarshal(m.data, c.obes[i]); err != nil {
			tb.Fatal(err)
		}
	}
	return c
}

func (c *copier) invocation(inv string) []*msg {
	out := make([]*msg, len(c.tmpl))
	for i, m := range c.tmpl {
		d := *m
		d.hdr = make(map[string]string, len(m.hdr))
		for k, v := range m.hdr {
			d.hdr[k] = v
		}
		if d.hdr[envelope.InvocationID] != "" {
			d.hdr[envelope.InvocationID] = inv
			obe := proto.Clone(c.obes[i]).(*buildpb.OrderedBuildEvent)
			obe.StreamId.InvocationId = inv
			d.data, _ = proto.Marshal(obe)
		}
		out[i] = &d
	}
	return out
}

// BenchmarkApplyPaced projects the batches of paced traffic (see paced:
// 1,000 streams, 86 batches of 1,400 events after the warm-up) through one
// connection, telling the projector each commit as the runner does, and
// reports, per BES event, PostgreSQL backend CPU and WAL bytes, and with
// -v the rows written (inserted, updated or deleted), the statements per
// batch and each table's counts. With MILLRACE_WALINSPECT set it also logs
// the WAL by record type and by relation (pg_walinspect).
//
//	go test ./projectors/builds -run '^$' -bench ApplyPaced -benchtime 1x -v
func BenchmarkApplyPaced(b *testing.B) {
	pool, _ := testenv.Pool(b)
	ctx := context.Background()
	conn, err := pool.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Release()
	pid := conn.Conn().PgConn().PID()
	p := newProjector(b, Config{})
	// Counting rows costs PostgreSQL two more statements a batch, so only
	// -v counts them.
	count := testing.Verbose()
	writes, stmts := 0, 0
	// The runner sweeps every 30 s while it keeps up: every 54 batches of
	// 1,400 events at 2,500 events/s.
	apply := func(batches [][]projection.Message) {
		for i, batch := range batches {
			if i%54 == 53 {
				now := batch[0].Time()
				if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return p.Sweep(ctx, tx, now) }); err != nil {
					b.Fatal(err)
				}
				p.Committed()
			}
			if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
				if !count {
					return p.Apply(ctx, tx, batch)
				}
				ct := &countingTx{Tx: tx}
				n, err := txRowWrites(ctx, tx, func() error { return p.Apply(ctx, ct, batch) })
				writes += n
				stmts += ct.statements
				return err
			}); err != nil {
				b.Fatal(err)
			}
			p.Committed()
		}
	}
	var events, total, statements, nBatches int
	var pgCPU time.Duration
	var wal int64
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		warm, batches := paced(b, fmt.Sprintf("p%d", i), 1000, 1400, 86, int64(i))
		apply(warm)
		writes, stmts = 0, 0
		lsn0 := walLSN(b, pool)
		pg0, _ := backendCPU(pid)
		b.StartTimer()
		apply(batches)
		b.StopTimer()
		pg1, _ := backendCPU(pid)
		pgCPU += pg1 - pg0
		lsn1 := walLSN(b, pool)
		wal += lsn1 - lsn0
		total += writes
		statements += stmts
		nBatches += len(batches)
		n := 0
		for _, batch := range batches {
			n += len(batch)
		}
		events += n
		if os.Getenv("MILLRACE_WALINSPECT") != "" {
			walStats(b, pool, lsn0, lsn1, n)
			walByRelation(b, pool, lsn0, lsn1, n)
		}
		b.StartTimer()
	}
	if count {
		b.Logf("per batch (%d batches): %.1f statements, %.0f rows written", nBatches,
			float64(statements)/float64(nBatches), float64(total)/float64(nBatches))
	}
	if pgCPU > 0 {
		b.ReportMetric(float64(events)/pgCPU.Seconds(), "events/pg-cpu-s")
	}
	b.ReportMetric(float64(wal)/float64(events), "wal-B/event")
	if count {
		b.ReportMetric(float64(total)/float64(events), "row-writes/event")
		rows, _ := pool.Query(ctx, `select relname, n_tup_ins, n_tup_upd, n_tup_hot_upd, n_tup_del
			from pg_stat_user_tables order by relname`)
		for rows.Next() {
			var name string
			var ins, upd, hot, del int64
			rows.Scan(&name, &ins, &upd, &hot, &del)
			b.Logf("%-20s ins %7d upd %7d hot %7d del %7d", name, ins, upd, hot, del)
		}
		rows.Close()
	}
}

// countingTx counts the statements a projector sends through it, queued
// in pipelines or alone.
type countingTx struct {
	pgx.Tx
	statements int
}

func (t *countingTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	t.statements += b.Len()
	return t.Tx.SendBatch(ctx, b)
}

func (t *countingTx) CopyFrom(ctx context.Context, table pgx.Identifier, columns []string, src pgx.CopyFromSource) (int64, error) {
	t.statements++
	return t.Tx.CopyFrom(ctx, table, columns, src)
}

func (t *countingTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	t.statements++
	return t.Tx.Exec(ctx, sql, args...)
}

func (t *countingTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	t.statements++
	return t.Tx.Query(ctx, sql, args...)
}

func (t *countingTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	t.statements++
	return t.Tx.QueryRow(ctx, sql, args...)
}

// walByRelation logs WAL between two LSNs by relation (the first block a
// record names) and record type, full-page images apart, to see which
// table or index the bytes are written for.
func walByRelation(tb testing.TB, pool *pgxpool.Pool, from, to int64, events int) {
	ctx := context.Background()
	rows, err := pool.Query(ctx, `
		with r as (
		    select resource_manager || '/' || record_type as typ, record_length, fpi_length,
		           substring(block_ref from 'rel [0-9]+/([0-9]+)/')::oid as db,
		           substring(block_ref from 'rel [0-9]+/[0-9]+/([0-9]+)')::oid as node
		    from pg_get_wal_records_info('0/0'::pg_lsn + $1::numeric, '0/0'::pg_lsn + $2::numeric))
		select case when r.db is null then '(no relation)'
		            when r.db <> (select oid from pg_database where datname = current_database()) then '(other databases)'
		            else coalesce(c.relname, 'node ' || r.node) end as rel,
		       r.typ, count(*), sum(r.record_length - r.fpi_length)::bigint as rec, sum(r.fpi_length)::bigint as fpi
		from r left join pg_class c on c.relfilenode = r.node and r.node <> 0
		group by 1, 2 order by sum(r.record_length) desc limit 40`, from, to)
	if err != nil {
		tb.Logf("pg_get_wal_records_info: %v", err)
		return
	}
	defer rows.Close()
	for rows.Next() {
		var rel, typ string
		var n, rec, fpi int64
		rows.Scan(&rel, &typ, &n, &rec, &fpi)
		tb.Logf("%-32s %-22s %7d records (%.3f/event) %6.1f B/event, fpi %6.1f B/event", rel, typ, n,
			float64(n)/float64(events), float64(rec)/float64(events), float64(fpi)/float64(events))
	}
}
