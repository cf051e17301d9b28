package fleet

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/internal/testenv"
)

// BenchmarkLiveness measures runner batches of 1,000 liveness entries over
// a fleet of 10,000 nodes, each entry moving a node's last_seen: Apply and
// the commit, through one connection, as the runner does them. Entries come
// as 1 message of 1,000 (one gateway's flush of a big pool), 10 of 100, or
// 1,000 of 1 (the worst case for decoding). Besides wall time (which other
// load on the machine inflates) it reports this process's CPU and the
// PostgreSQL backend's CPU per batch, and WAL bytes per entry (the whole
// server's: other databases' activity inflates it).
//
//	go test ./projectors/fleet -run '^$' -bench Liveness -benchtime 300x
func BenchmarkLiveness(b *testing.B) {
	pool, _ := testenv.Pool(b)
	ctx := context.Background()
	p := mustNew(Config{})
	const fleet = 10000
	s := newStream()
	for i := range fleet {
		s.connect("pool-a", fmt.Sprintf("node-%05d", i), "gw-1", fmt.Sprintf("s-%d", i),
			map[string]string{"zone": "a", "rack": fmt.Sprintf("r%03d", i/40)},
			gpu(0, "H100", 81559, okH), gpu(1, "H100", 81559, okH))
	}
	applyAll(b, pool, p, s.msgs, 1000)
	if _, err := pool.Exec(ctx, "vacuum analyze fleet_nodes"); err != nil {
		b.Fatal(err)
	}
	conn, err := pool.Acquire(ctx)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Release()
	pid := conn.Conn().PgConn().PID()

	for _, shape := range []struct{ msgs, per int }{{1, 1000}, {10, 100}, {1000, 1}} {
		b.Run(fmt.Sprintf("%dx%d", shape.msgs, shape.per), func(b *testing.B) {
			next := 0
			batch := func() []*msg {
				s.msgs = s.msgs[:0]
				for range shape.msgs {
					var a []heard
					for range shape.per {
						a = append(a, heard{fmt.Sprintf("node-%05d", next%fleet), "s", 300})
						next++
					}
					// A batch takes 5 ms of stream time, so that each node is
					// heard every 50 ms: always fresh.
					s.at(s.now.Sub(t0)+5*time.Millisecond/time.Duration(shape.msgs)).liveness("pool-a", "gw-1", a...)
				}
				return s.msgs
			}
			var goCPU, pgCPU time.Duration
			var wal int64
			pgOK := true
			for b.Loop() {
				b.StopTimer()
				msgs := toMessages(batch())
				lsn0 := walLSN(b, conn)
				pg0, ok := backendCPU(pid)
				pgOK = pgOK && ok
				cpu0 := cpuTime()
				b.StartTimer()
				if err := pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error { return p.Apply(ctx, tx, msgs) }); err != nil {
					b.Fatal(err)
				}
				b.StopTimer()
				goCPU += cpuTime() - cpu0
				pg1, _ := backendCPU(pid)
				pgCPU += pg1 - pg0
				wal += walLSN(b, conn) - lsn0
				b.StartTimer()
			}
			n := float64(b.N)
			b.ReportMetric(float64(b.Elapsed().Microseconds())/n/1000, "ms/batch")
			b.ReportMetric(float64(goCPU.Microseconds())/n/1000, "go-cpu-ms/batch")
			if pgOK {
				b.ReportMetric(float64(pgCPU.Microseconds())/n/1000, "pg-cpu-ms/batch")
			}
			b.ReportMetric(float64(wal)/n/1000, "wal-B/entry")
		})
	}
	if testing.Verbose() {
		var upd, hot int64
		conn.QueryRow(ctx, `select n_tup_upd, n_tup_hot_upd from pg_stat_user_tables where relname = 'fleet_nodes'`).Scan(&upd, &hot)
		b.Logf("fleet_nodes: %d updates, %d HOT", upd, hot)
	}
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

func walLSN(tb testing.TB, q Querier) int64 {
	var lsn int64
	if err := q.QueryRow(context.Background(), `select pg_current_wal_lsn() - '0/0'::pg_lsn`).Scan(&lsn); err != nil {
		tb.Fatal(err)
	}
	return lsn
}

// BenchmarkSweep measures a sweep of 10,000 healthy nodes that marks none
// (the common case, every SweepTick of stream time and every runner Sweep).
func BenchmarkSweep(b *testing.B) {
	pool, _ := testenv.Pool(b)
	ctx := context.Background()
	p := mustNew(Config{})
	s := newStream()
	var a []heard
	for i := range 10000 {
		id := fmt.Sprintf("node-%05d", i)
		s.connect("pool-a", id, "gw-1", "s", nil, gpu(0, "H100", 81559, okH))
		a = append(a, heard{id, "s", 100})
	}
	s.at(time.Second).liveness("pool-a", "gw-1", a...)
	applyAll(b, pool, p, s.msgs, 1000)
	if _, err := pool.Exec(ctx, "vacuum analyze fleet_nodes"); err != nil {
		b.Fatal(err)
	}
	now := t0.Add(10 * time.Second)
	for b.Loop() {
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.Sweep(ctx, tx, now) }); err != nil {
			b.Fatal(err)
		}
	}
}
