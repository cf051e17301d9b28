package database

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/jackc/pgx/v5/pgxpool"
)

// ErrNotConnected is Ping's answer before Run has connected.
var ErrNotConnected = errors.New("database not connected yet")

// Late is the pool of a process that connects in the background: Run
// connects (retrying while the database is away, as Connect does) and
// holds the pool until its context ends, while the parts that need the
// database wait for it (Await) and the rest start at once. The edges of
// `millrace dev` serve within a second of a restart whatever the database
// is doing this way. The zero Late is ready for use.
type Late struct {
	pool  atomic.Pointer[pgxpool.Pool]
	once  sync.Once
	ready chan struct{} // closed once pool is set
}

func (l *Late) readyC() chan struct{} {
	l.once.Do(func() { l.ready = make(chan struct{}) })
	return l.ready
}

// Run connects with c, makes the pool available, and closes it when ctx
// ends; it returns nil then, connected or not. Call it once.
func (l *Late) Run(ctx context.Context, c Config) error {
	pool := Connect(ctx, c)
	if pool == nil {
		return nil // stopped before the database answered
	}
	l.pool.Store(pool)
	close(l.readyC())
	<-ctx.Done()
	pool.Close()
	return nil
}

// Await waits for the pool; nil when ctx ends first.
func (l *Late) Await(ctx context.Context) *pgxpool.Pool {
	select {
	case <-l.readyC():
		return l.pool.Load()
	case <-ctx.Done():
		return nil
	}
}

// Pool is the pool once connected, else nil, without waiting (for the
// console, which answers "not ready" rather than waiting).
func (l *Late) Pool() *pgxpool.Pool { return l.pool.Load() }

// Ping checks that the database answers, for a readiness probe:
// ErrNotConnected before Run has connected.
func (l *Late) Ping(ctx context.Context) error {
	pool := l.pool.Load()
	if pool == nil {
		return ErrNotConnected
	}
	if err := pool.Ping(ctx); err != nil {
		return fmt.Errorf("database: %w", err)
	}
	return nil
}
