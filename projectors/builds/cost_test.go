package builds

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams/projection"
)

// tableCounts is what pg_stat_xact_user_tables says one backend has done
// to each table: scans, tuples read, and rows written.
type tableCounts map[string]tableCount

type tableCount struct {
	seqScans, seqRead, idxScans, idxFetched int64
	ins, upd, hot, del                      int64
}

func (c tableCount) writes() int64 { return c.ins + c.upd + c.del }

// readCounts reads the counts of the backend tx runs on, those of a
// table's partitions under the table's name. They include
// earlier transactions of the backend not yet flushed to the statistics,
// so what one piece of work did is the difference of two readings in one
// transaction (countsOf).
func readCounts(ctx context.Context, tx pgx.Tx) (tableCounts, error) {
	rows, err := tx.Query(ctx, `select coalesce(i.inhparent::regclass::text, s.relname), sum(seq_scan)::int8,
		sum(seq_tup_read)::int8, sum(coalesce(idx_scan, 0))::int8, sum(coalesce(idx_tup_fetch, 0))::int8,
		sum(n_tup_ins)::int8, sum(n_tup_upd)::int8, sum(n_tup_hot_upd)::int8, sum(n_tup_del)::int8
		from pg_stat_xact_user_tables s left join pg_inherits i on i.inhrelid = s.relid group by 1`)
	if err != nil {
		return nil, err
	}
	out := tableCounts{}
	var name string
	var c tableCount
	_, err = pgx.ForEachRow(rows, []any{&name, &c.seqScans, &c.seqRead, &c.idxScans, &c.idxFetched,
		&c.ins, &c.upd, &c.hot, &c.del}, func() error {
		out[name] = c
		return nil
	})
	return out, err
}

// countsOf runs f in tx and returns what it did to each table.
func countsOf(ctx context.Context, tx pgx.Tx, f func() error) (tableCounts, error) {
	before, err := readCounts(ctx, tx)
	if err != nil {
		return nil, err
	}
	if err := f(); err != nil {
		return nil, err
	}
	after, err := readCounts(ctx, tx)
	if err != nil {
		return nil, err
	}
	for name, a := range after {
		b := before[name]
		after[name] = tableCount{a.seqScans - b.seqScans, a.seqRead - b.seqRead, a.idxScans - b.idxScans,
			a.idxFetched - b.idxFetched, a.ins - b.ins, a.upd - b.upd, a.hot - b.hot, a.del - b.del}
	}
	return after, nil
}

// txRowWrites runs f in tx and returns the rows it inserted, updated and
// deleted.
func txRowWrites(ctx context.Context, tx pgx.Tx, f func() error) (int, error) {
	c, err := countsOf(ctx, tx, f)
	var n int64
	for _, t := range c {
		n += t.writes()
	}
	return int(n), err
}

// applyCounted applies each batch in its own transaction on conn, telling
// the projector each commit as the runner does, and returns what each did
// to the tables.
func applyCounted(t testing.TB, conn *pgxpool.Conn, p *Projector, batches [][]projection.Message) []tableCounts {
	t.Helper()
	ctx := context.Background()
	var out []tableCounts
	for i, batch := range batches {
		err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			c, err := countsOf(ctx, tx, func() error { return p.Apply(ctx, tx, batch) })
			out = append(out, c)
			return err
		})
		if err != nil {
			t.Fatalf("batch %d: %v", i, err)
		}
		p.Committed()
	}
	return out
}

// TestPlansProbeByKey: a batch reads the rows it names through their
// primary keys however large the tables have grown since its statements
// were planned. The projector's connection plans each statement for good
// while the tables are new and small; a plan that scans a whole table then
// scans it again in every batch, its cost growing with the table rather
// than with the batch (at 1,000 paced streams, most of PostgreSQL's time).
// Autovacuum is off for the tables here, as on a server without it: its
// ANALYZE would have the statements planned again.
func TestPlansProbeByKey(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	// Partitioned tables take storage settings per partition: this week's
	// and t0's (the scenarios' clock) are the ones that fill.
	if err := EnsurePartitions(ctx, pool, time.Now(), 0); err != nil {
		t.Fatal(err)
	}
	if err := EnsurePartitions(ctx, pool, t0, 0); err != nil {
		t.Fatal(err)
	}
	tables := append(append([]string{}, DigestTables...), "build_output_chunks")
	for _, part := range partitionedTables {
		rows, err := pool.Query(ctx, `select inhrelid::regclass::text from pg_inherits where inhparent = $1::regclass`, part)
		if err != nil {
			t.Fatal(err)
		}
		ps, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		tables = append(tables, ps...)
	}
	for _, table := range tables {
		if slices.Contains(partitionedTables, table) {
			continue
		}
		if _, err := pool.Exec(ctx, "alter table "+table+" set (autovacuum_enabled = off)"); err != nil {
			t.Fatal(err)
		}
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	p := newProjector(t, Config{})

	// Small tables while the statements are planned (a generic plan is
	// made after five executions).
	warm, batches := paced(t, "small", 20, 30, 30, 1)
	applyCounted(t, conn, p, warm)
	applyCounted(t, conn, p, batches[:15])

	// Other builds' rows, many more than a batch names.
	for _, sql := range []string{
		`insert into invocations (id, project, first_event_at, last_event_at)
		 select 'filler-' || n, 'filler', now(), now() from generate_series(1, 20000) n`,
		`insert into targets (build_key, label_id)
		 select i.build_key, build_label_id('//pkg:t' || n) from generate_series(1, 100000) n
		 join invocations i on i.id = 'filler-' || n / 10 and i.project = 'filler'`,
		`insert into tests (build_key, label_id, status, has_summary)
		 select i.build_key, build_label_id('//pkg:t' || n), 'PASSED', true from generate_series(1, 50000) n
		 join invocations i on i.id = 'filler-' || n / 10 and i.project = 'filler'`,
		`insert into targets_running (build_key, label_id)
		 select i.build_key, build_label_id('//pkg:r' || n) from generate_series(1, 100000) n
		 join invocations i on i.id = 'filler-' || n / 10 and i.project = 'filler'`,
		`insert into tests_running (build_key, label_id, status, has_summary)
		 select i.build_key, build_label_id('//pkg:r' || n), 'PASSED', true from generate_series(1, 50000) n
		 join invocations i on i.id = 'filler-' || n / 10 and i.project = 'filler'`,
	} {
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatal(err)
		}
	}

	for i, c := range applyCounted(t, conn, p, batches[15:]) {
		for _, table := range []string{"invocations", "targets", "targets_running", "tests", "tests_running", "build_output", "build_output_chunks", "build_metrics", "hourly_rollups"} {
			if n := c[table]; n.seqScans != 0 || n.seqRead != 0 {
				t.Errorf("batch %d scanned %s %d times, reading %d rows; want none (rows named by key)",
					15+i, table, n.seqScans, n.seqRead)
			}
		}
	}
}

// TestNewRowsWrittenInBulk: a batch's new target, test and output chunk
// rows reach the WAL as a record per page they fill, not a record per
// row (COPY's multi-insert; an INSERT logs about 50 bytes of headers
// with every row). It reads the WAL with pg_walinspect, a contrib
// extension of PostgreSQL 15, and is skipped where it cannot be created.
func TestNewRowsWrittenInBulk(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `create extension if not exists pg_walinspect`); err != nil {
		t.Skipf("pg_walinspect: %v", err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Release()
	p := newProjector(t, Config{})
	warm, batches := paced(t, "bulk", 200, 300, 12, 4)
	applyCounted(t, conn, p, warm)
	var from, to string
	if err := conn.QueryRow(ctx, `select pg_current_wal_insert_lsn()::text`).Scan(&from); err != nil {
		t.Fatal(err)
	}
	inserted := map[string]int64{}
	for _, c := range applyCounted(t, conn, p, batches) {
		for name, n := range c {
			inserted[name] += n.ins
		}
	}
	// Flushed, not inserted: pg_walinspect reads no further (other
	// sessions' records may be inserted past it), and the batches'
	// commits flushed theirs.
	if err := conn.QueryRow(ctx, `select pg_current_wal_flush_lsn()::text`).Scan(&to); err != nil {
		t.Fatal(err)
	}
	// The paced builds' rows are new while the builds run (running.go).
	for _, table := range []string{"targets_running", "tests_running", "build_output_chunks"} {
		var records int64
		err := conn.QueryRow(ctx, `
			select count(*) from pg_get_wal_records_info($1::pg_lsn, $2::pg_lsn)
			where record_type in ('INSERT', 'INSERT+INIT', 'MULTI_INSERT', 'MULTI_INSERT+INIT')
			  and block_ref ~ ('rel [0-9]+/' || (select oid from pg_database where datname = current_database()) ||
			                   '/(' || coalesce((select string_agg(pg_relation_filenode(inhrelid)::text, '|')
			                                     from pg_inherits where inhparent = $3::regclass),
			                                    pg_relation_filenode($3::regclass)::text) || ') ')`, from, to, table).Scan(&records)
		if err != nil {
			t.Fatal(err)
		}
		rows := inserted[table]
		t.Logf("%s: %d rows inserted in %d WAL records", table, rows, records)
		if rows < 2*int64(len(batches)) {
			t.Fatalf("%s: only %d rows inserted by %d batches; the test needs several a batch", table, rows, len(batches))
		}
		if records*2 > rows {
			t.Errorf("%s: %d rows inserted in %d WAL records, want at most one record for two rows", table, rows, records)
		}
	}
}
