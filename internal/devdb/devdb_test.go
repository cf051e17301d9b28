package devdb_test

import (
	"context"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/internal/testenv"
)

// EnsureDatabase creates a missing database once, also when several
// processes ask at the same moment, and returns its URL each time.
func TestEnsureDatabase(t *testing.T) {
	srv := testenv.Server(t)
	ctx := context.Background()
	name := fmt.Sprintf("devdb_ensure_%d_%d", os.Getpid(), time.Now().UnixNano())
	t.Cleanup(func() {
		conn, err := pgx.Connect(ctx, srv.URL)
		if err == nil {
			conn.Exec(ctx, "drop database if exists "+name)
			conn.Close(ctx)
		}
	})
	var wg sync.WaitGroup
	urls := make([]string, 4)
	errs := make([]error, 4)
	for i := range urls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			urls[i], errs[i] = srv.EnsureDatabase(ctx, name)
		}()
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("caller %d: %v", i, err)
		}
	}
	conn, err := pgx.Connect(ctx, urls[0])
	if err != nil {
		t.Fatalf("connect to the database made: %v", err)
	}
	var db string
	conn.QueryRow(ctx, "select current_database()").Scan(&db)
	conn.Close(ctx)
	if db != name || urls[3] != urls[0] {
		t.Fatalf("connected to %q by %q and %q", db, urls[0], urls[3])
	}
}
