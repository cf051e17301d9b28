package builds

import (
	"bytes"
	"context"
	"errors"
	"maps"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams/projection"
)

// acquire returns a connection of a fresh database: the projector's
// statements are planned once per connection, as on the runner's.
func acquire(t *testing.T) (*pgxpool.Pool, *pgxpool.Conn) {
	t.Helper()
	pool, _ := testenv.Pool(t)
	conn, err := pool.Acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(conn.Release)
	return pool, conn
}

// TestCacheSavesReads: with the runner saying which batches committed,
// a batch reads neither the running builds the batches before it wrote
// nor, for builds whose rows they inserted, which target and test rows
// exist; and the tables end as without the cache.
func TestCacheSavesReads(t *testing.T) {
	warm, batches := paced(t, "cache", 100, 60, 40, 2)
	var digests []map[string]string
	var scans []tableCount
	for _, cached := range []bool{false, true} {
		pool, conn := acquire(t)
		p := newProjector(t, Config{})
		applyCounted(t, conn, p, warm)
		sum := tableCounts{}
		for _, b := range batches {
			if !cached {
				p.Aborted()
			}
			for name, c := range applyCounted(t, conn, p, [][]projection.Message{b})[0] {
				s := sum[name]
				s.idxScans += c.idxScans
				s.upd += c.upd
				sum[name] = s
			}
		}
		digests = append(digests, digest(t, pool))
		scans = append(scans, sum["invocations"], sum["targets"])
		t.Logf("cache %v: invocations %d index scans, %d updates; targets %d index scans, %d updates",
			cached, sum["invocations"].idxScans, sum["invocations"].upd, sum["targets"].idxScans, sum["targets"].upd)
	}
	if !maps.Equal(digests[0], digests[1]) {
		t.Errorf("tables differ with the cache:\nwithout %v\nwith    %v", digests[0], digests[1])
	}
	// Without the cache every written invocation is probed twice (read,
	// then updated), with it about once; target rows likewise.
	for i, table := range []string{"invocations", "targets"} {
		without, with := scans[i], scans[2+i]
		if with.upd != without.upd {
			t.Errorf("%s: %d updates with the cache, %d without", table, with.upd, without.upd)
		}
		if float64(with.idxScans) > 0.7*float64(without.idxScans) {
			t.Errorf("%s: %d index scans with the cache, %d without: want at most 70%%", table, with.idxScans, without.idxScans)
		}
	}
}

// TestCacheStale: a row that differs from what the cache holds (changed
// behind the projector's back) fails the batch with errStale, an error the
// runner retries (no PostgreSQL error class of a data error); the retry,
// after Aborted, applies it as if there had been no cache.
func TestCacheStale(t *testing.T) {
	warm, batches := paced(t, "stale", 30, 40, 6, 3)
	// The same batches without the cache, for the tables they must leave.
	pool, conn := acquire(t)
	p := newProjector(t, Config{})
	for _, b := range append(warm, batches...) {
		p.Aborted()
		applyCounted(t, conn, p, [][]projection.Message{b})
	}
	want := digest(t, pool)

	for _, c := range []struct {
		name            string
		tamper, restore string // SQL run behind the projector's back, and undone
	}{
		{"last sequence moved",
			`update invocations set last_sequence = last_sequence + 1000 where status = 'running'`,
			`update invocations set last_sequence = last_sequence - 1000 where status = 'running'`},
		{"target rows gone",
			`create table gone as select * from targets_running where success is null;
			 delete from targets_running where success is null`,
			`insert into targets_running select * from gone`},
		{"target rows appeared",
			`insert into targets_running (build_key, label_id, kind_id)
			 select i.build_key, l.label_id, -7
			 from invocations i cross join (select distinct label_id from targets_running) l
			 where i.status = 'running' on conflict do nothing`,
			`delete from targets_running where kind_id = -7`},
	} {
		t.Run(c.name, func(t *testing.T) {
			pool, conn := acquire(t)
			p := newProjector(t, Config{})
			applyCounted(t, conn, p, warm)
			ctx := context.Background()
			if _, err := conn.Exec(ctx, c.tamper); err != nil {
				t.Fatal(err)
			}
			err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return p.Apply(ctx, tx, batches[0]) })
			var pe *pgconn.PgError
			if !errors.Is(err, errStale) || errors.As(err, &pe) {
				t.Fatalf("batch on a tampered table: %v, want errStale and no PostgreSQL error", err)
			}
			p.Aborted()
			if _, err := conn.Exec(ctx, c.restore); err != nil {
				t.Fatal(err)
			}
			applyCounted(t, conn, p, batches)
			if got := digest(t, pool); !maps.Equal(got, want) {
				t.Errorf("after the retry the tables differ:\ngot  %v\nwant %v", got, want)
			}
		})
	}
}

// TestCacheAfterSweep: a sweep that abandons nothing leaves the cache
// serving the next batch (the runner sweeps every 30 s while caught up); a
// build it abandons is read again by the next batch that names it, which
// then merges into the abandoned row as without the cache.
func TestCacheAfterSweep(t *testing.T) {
	ctx := context.Background()
	build := func() (*stream, *builder) {
		s := newStream(t0)
		b := s.invocation("acme", "inv-quiet")
		b.enqueued()
		b.attemptStarted()
		b.tool(startedEv("inv-quiet", s.now))
		b.tool(progressEv(1, "", "analysing\n"))
		b.tool(configuredEv("//pkg:gen", "genrule rule"))
		return s, b
	}
	sweepAt := func(conn *pgxpool.Conn, p *Projector, now time.Time) {
		if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return p.Sweep(ctx, tx, now) }); err != nil {
			t.Fatal(err)
		}
		p.Committed()
	}
	one := func(m *msg) [][]projection.Message { return [][]projection.Message{{m}} }

	var rows [][]byte
	for _, cached := range []bool{true, false} {
		pool, conn := acquire(t)
		p := newProjector(t, Config{})
		s, b := build()
		for _, m := range s.msgs {
			applyCounted(t, conn, p, one(m))
		}
		sweepAt(conn, p, s.now.Add(time.Minute)) // abandons nothing
		c := applyCounted(t, conn, p, one(b.tool(progressEv(2, "", "building\n"))))[0]
		if got := c["invocations"]; cached && got.idxScans != got.upd {
			t.Errorf("the batch after a sweep probed invocations %d times for %d updates: it read the cached build", got.idxScans, got.upd)
		}

		swept := s.now.Add(31 * time.Minute)
		sweepAt(conn, p, swept) // abandons inv-quiet
		if !cached {
			p.Aborted()
		}
		s.now = swept.Add(time.Minute)
		applyCounted(t, conn, p, one(b.tool(progressEv(3, "", "late\n"))))
		rows = append(rows, dumpBuild(t, pool, invKey{"acme", "inv-quiet"}))
	}
	if !bytes.Equal(rows[0], rows[1]) {
		t.Errorf("a late event for a build the sweep abandoned, with the cache:\n%s\nwithout:\n%s", rows[0], rows[1])
	}
}
