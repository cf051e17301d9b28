package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/internal/devdb"
)

// pgServer is the PostgreSQL server the scenarios create their databases
// on, with an admin connection to its maintenance database.
type pgServer struct {
	srv     *devdb.Server
	admin   *pgx.Conn
	adminMu sync.Mutex
	version string
	local   bool  // its processes are visible in /proc
	n       int   // databases created so far
	queries int64 // statements run on the admin connection (they count as other databases' transactions)
}

func openPG(ctx context.Context, dir string) (*pgServer, error) {
	srv, err := devdb.Find(ctx, dir)
	if err != nil {
		return nil, err
	}
	conn, err := pgx.Connect(ctx, srv.URL)
	if err != nil {
		return nil, fmt.Errorf("connect to %s: %w", redact(srv.URL), err)
	}
	s := &pgServer{srv: srv, admin: conn}
	if err := conn.QueryRow(ctx, "select version()").Scan(&s.version); err != nil {
		conn.Close(ctx)
		return nil, err
	}
	procs, _ := postgresProcs()
	s.local = len(procs) > 0
	return s, nil
}

func (s *pgServer) close() { s.admin.Close(context.Background()) }

// createDB makes a fresh database and returns its name and URL.
func (s *pgServer) createDB(ctx context.Context, scenario string) (string, string, error) {
	s.adminMu.Lock()
	defer s.adminMu.Unlock()
	s.n++
	name := fmt.Sprintf("millrace_bench_%d_%d_%s", os.Getpid(), s.n, sanitize(scenario))
	if _, err := s.admin.Exec(ctx, "create database "+pgx.Identifier{name}.Sanitize()); err != nil {
		return "", "", fmt.Errorf("create database %s: %w", name, err)
	}
	url, err := devdb.WithDatabase(s.srv.URL, name)
	return name, url, err
}

// dropDB drops a database the bench created, cutting its connections.
func (s *pgServer) dropDB(name string) error {
	s.adminMu.Lock()
	defer s.adminMu.Unlock()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	_, err := s.admin.Exec(ctx, "drop database if exists "+pgx.Identifier{name}.Sanitize()+" with (force)")
	return err
}

func (s *pgServer) query(ctx context.Context, f func(*pgx.Conn) error) error {
	s.adminMu.Lock()
	defer s.adminMu.Unlock()
	s.queries++
	return f(s.admin)
}

func (s *pgServer) adminQueries() int64 {
	s.adminMu.Lock()
	defer s.adminMu.Unlock()
	return s.queries
}

func (s *pgServer) walLSN(ctx context.Context) (string, error) {
	var lsn string
	err := s.query(ctx, func(c *pgx.Conn) error {
		return c.QueryRow(ctx, "select pg_current_wal_lsn()::text").Scan(&lsn)
	})
	return lsn, err
}

func (s *pgServer) walDiff(ctx context.Context, to, from string) (int64, error) {
	var n int64
	err := s.query(ctx, func(c *pgx.Conn) error {
		return c.QueryRow(ctx, "select pg_wal_lsn_diff($1::pg_lsn, $2::pg_lsn)::bigint", to, from).Scan(&n)
	})
	return n, err
}

// otherXacts is the number of transactions committed or rolled back in the
// server's other databases (a shared server shows activity here).
func (s *pgServer) otherXacts(ctx context.Context, db string) (int64, error) {
	var n int64
	err := s.query(ctx, func(c *pgx.Conn) error {
		return c.QueryRow(ctx, `select coalesce(sum(xact_commit + xact_rollback), 0)::bigint
			from pg_stat_database where datname is not null and datname <> $1`, db).Scan(&n)
	})
	return n, err
}

// postgresProcs are the server's processes on this machine: every process
// whose comm is "postgres" (backends keep that comm whatever their title).
func postgresProcs() (map[int]cpuTimes, error) {
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, err
	}
	out := map[int]cpuTimes{}
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		t, err := readCPU(pid)
		if err != nil || t.comm != "postgres" {
			continue
		}
		out[pid] = t
	}
	return out, nil
}

// pgCPU is the total CPU of all postgres processes, including backends that
// exited: the postmaster's children times hold those it reaped.
func pgCPU(procs map[int]cpuTimes) time.Duration {
	var d time.Duration
	for _, t := range procs {
		d += t.self()
		if p, ok := procs[t.ppid]; !ok || p.comm != "postgres" {
			d += t.children() // the postmaster
		}
	}
	return d
}

// pgMeter measures what one scenario costs PostgreSQL: the CPU of all its
// processes, the CPU attributed to the scenario (the backends of its
// database and the server's background writers), WAL written, and how busy
// the server's other databases were meanwhile.
type pgMeter struct {
	s       *pgServer
	db      string
	exclude map[int]bool // the bench's own connections

	before      map[int]cpuTimes
	beforeTotal time.Duration
	lsn         string
	xacts       int64
	queries     int64
	start       time.Time

	mu      sync.Mutex
	tracked map[int]cpuTimes // attributed processes, last reading
	others  map[int]bool     // client backends of other databases seen
	stopC   chan struct{}
	wg      sync.WaitGroup
	stopped bool // stop is called from one goroutine
}

// pgCost is a pgMeter's result.
type pgCost struct {
	CPUAll        time.Duration
	CPUAttributed time.Duration
	WALBytes      int64
	OtherXacts    int64
	OtherBackends int
	Elapsed       time.Duration
}

func (s *pgServer) meter(ctx context.Context, db string, exclude ...int) (*pgMeter, error) {
	m := &pgMeter{s: s, db: db, exclude: map[int]bool{}, tracked: map[int]cpuTimes{}, others: map[int]bool{}, stopC: make(chan struct{})}
	var adminPID int
	if err := s.query(ctx, func(c *pgx.Conn) error {
		return c.QueryRow(ctx, "select pg_backend_pid()").Scan(&adminPID)
	}); err != nil {
		return nil, err
	}
	m.exclude[adminPID] = true
	for _, p := range exclude {
		m.exclude[p] = true
	}
	var err error
	if m.before, err = postgresProcs(); err != nil {
		return nil, err
	}
	m.beforeTotal = pgCPU(m.before)
	if m.lsn, err = s.walLSN(ctx); err != nil {
		return nil, err
	}
	if m.xacts, err = s.otherXacts(ctx, db); err != nil {
		return nil, err
	}
	m.queries = s.adminQueries()
	m.start = time.Now()
	m.sample(ctx)
	m.wg.Go(func() {
		t := time.NewTicker(250 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-m.stopC:
				return
			case <-t.C:
				m.sample(ctx)
			}
		}
	})
	return m, nil
}

// sample finds the processes working for the scenario's database (and the
// server-wide background processes) and reads their CPU while they live.
func (m *pgMeter) sample(ctx context.Context) {
	type row struct {
		pid       int
		db        string
		typ       string
		otherBusy bool
	}
	var rows []row
	err := m.s.query(ctx, func(c *pgx.Conn) error {
		r, err := c.Query(ctx, `select pid, coalesce(datname, ''), coalesce(backend_type, ''), coalesce(state = 'active', false) from pg_stat_activity`)
		if err != nil {
			return err
		}
		var x row
		_, err = pgx.ForEachRow(r, []any{&x.pid, &x.db, &x.typ, &x.otherBusy}, func() error {
			rows = append(rows, x)
			return nil
		})
		return err
	})
	if err != nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, r := range rows {
		if m.exclude[r.pid] {
			continue
		}
		switch {
		case r.db == m.db,
			r.typ == "walwriter", r.typ == "checkpointer", r.typ == "background writer",
			r.typ == "autovacuum launcher":
			if t, err := readCPU(r.pid); err == nil {
				m.tracked[r.pid] = t
			}
		case r.typ == "client backend" && r.db != "":
			m.others[r.pid] = true
		}
	}
}

func (m *pgMeter) stop(ctx context.Context) (pgCost, error) {
	if m.stopped {
		return pgCost{}, nil
	}
	m.stopped = true
	close(m.stopC)
	m.wg.Wait()
	m.sample(ctx)
	var c pgCost
	c.Elapsed = time.Since(m.start)
	after, err := postgresProcs()
	if err != nil {
		return c, err
	}
	c.CPUAll = pgCPU(after) - m.beforeTotal
	m.mu.Lock()
	for pid, t := range m.tracked {
		c.CPUAttributed += t.self() - m.before[pid].self()
	}
	c.OtherBackends = len(m.others)
	m.mu.Unlock()
	lsn, err := m.s.walLSN(ctx)
	if err != nil {
		return c, err
	}
	if c.WALBytes, err = m.s.walDiff(ctx, lsn, m.lsn); err != nil {
		return c, err
	}
	x, err := m.s.otherXacts(ctx, m.db)
	if err != nil {
		return c, err
	}
	// Our own admin statements are transactions in the maintenance
	// database; leave them out (approximately: statistics are flushed late).
	c.OtherXacts = max(0, x-m.xacts-(m.s.adminQueries()-m.queries))
	return c, nil
}
