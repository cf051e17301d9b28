package database_test

import (
	"context"
	"net"
	"os"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/testenv"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.DropTemplate()
	os.Exit(code)
}

// A pool opened here has the JIT off unless its URL says otherwise, and
// Migrate leaves the schema current.
func TestOpen(t *testing.T) {
	ctx := context.Background()
	url := testenv.Database(t)
	pool, err := database.Open(ctx, database.Config{URL: url, Migrate: true})
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	var jit string
	if err := pool.QueryRow(ctx, "show jit").Scan(&jit); err != nil || jit != "off" {
		t.Fatalf("jit %q, %v; want off", jit, err)
	}
	var n int
	if err := pool.QueryRow(ctx, "select count(*) from invocations").Scan(&n); err != nil {
		t.Fatalf("the migrated schema: %v", err)
	}
	on, err := database.Open(ctx, database.Config{URL: url + "&jit=on"})
	if err != nil {
		t.Fatal(err)
	}
	defer on.Close()
	if err := on.QueryRow(ctx, "show jit").Scan(&jit); err != nil || jit != "on" {
		t.Fatalf("a URL asking for jit: %q, %v", jit, err)
	}
}

// Connect keeps trying while nothing answers, and gives up when its
// context ends.
func TestConnectGivesUpWithItsContext(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing answers there now
	ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
	defer cancel()
	if p := database.Connect(ctx, database.Config{URL: "postgres://x@" + addr + "/x?connect_timeout=1", Migrate: true}); p != nil {
		p.Close()
		t.Fatal("Connect returned a pool with no server")
	}
	if ctx.Err() == nil {
		t.Fatal("Connect returned before its context ended")
	}
}
