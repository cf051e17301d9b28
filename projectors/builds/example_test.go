package builds_test

import (
	"context"
	"encoding/json"
	"os"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/projectors/builds"
)

// What `millrace builds show <id> --project acme --json` does.
func ExampleShow() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, os.Getenv("DATABASE_URL"))
	if err != nil {
		panic(err)
	}
	defer pool.Close()
	b, err := builds.Show(ctx, pool, "acme", "3f1c6a52-5b7e-4c1e-9d7a-2a5f0e8b9c41")
	if err != nil {
		panic(err) // builds.ErrNotFound when project acme has no such invocation
	}
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	enc.Encode(b)
}
