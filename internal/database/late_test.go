package database_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/testenv"
)

// Late hands out nothing before it connects, the one pool after, and
// closes it when Run's context ends.
func TestLate(t *testing.T) {
	var l database.Late
	ctx := context.Background()
	if err := l.Ping(ctx); !errors.Is(err, database.ErrNotConnected) {
		t.Fatalf("Ping before Run: %v, want ErrNotConnected", err)
	}
	if l.Pool() != nil {
		t.Fatal("a pool before Run")
	}
	early, cancelEarly := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancelEarly()
	if l.Await(early) != nil {
		t.Fatal("Await returned a pool before Run")
	}

	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- l.Run(runCtx, database.Config{URL: testenv.Database(t)}) }()
	waitCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	pool := l.Await(waitCtx)
	if pool == nil {
		t.Fatal("Await: no pool within 30 s")
	}
	if l.Pool() != pool {
		t.Fatal("Pool is not the pool Await gave")
	}
	if err := l.Ping(ctx); err != nil {
		t.Fatalf("Ping once connected: %v", err)
	}
	stop()
	if err := <-done; err != nil {
		t.Fatalf("Run: %v", err)
	}
	if err := pool.Ping(ctx); err == nil {
		t.Fatal("the pool still answers after Run returned: it was not closed")
	}
}

// A Run stopped before the database answers returns nil and leaves
// Await waiting on its own context.
func TestLateStoppedBeforeConnecting(t *testing.T) {
	var l database.Late
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := l.Run(ctx, database.Config{URL: "postgres://x@127.0.0.1:1/x?connect_timeout=1", Migrate: true}); err != nil {
		t.Fatalf("Run: %v", err)
	}
	short, c := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer c()
	if l.Await(short) != nil {
		t.Fatal("a pool from a Run that never connected")
	}
}
