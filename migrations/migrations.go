// Package migrations holds millrace's PostgreSQL schema as numbered SQL files
// and applies them with tern, which serialises concurrent runs with a
// PostgreSQL advisory lock: several processes may call Apply at start.
package migrations

import (
	"context"
	"embed"
	"fmt"
	"io/fs"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/tern/v2/migrate"
)

//go:embed *.sql
var files embed.FS

// VersionTable records which migrations have run.
const VersionTable = "millrace_schema_version"

// FS returns the embedded migration files.
func FS() fs.FS { return files }

// Apply brings the database behind conn up to the newest migration. It is
// safe to call concurrently from several processes.
func Apply(ctx context.Context, conn *pgx.Conn) (from, to int32, err error) {
	m, err := migrate.NewMigrator(ctx, conn, VersionTable)
	if err != nil {
		return 0, 0, fmt.Errorf("migrations: %w", err)
	}
	if err := m.LoadMigrations(files); err != nil {
		return 0, 0, fmt.Errorf("migrations: load: %w", err)
	}
	from, err = m.GetCurrentVersion(ctx)
	if err != nil {
		return 0, 0, fmt.Errorf("migrations: current version: %w", err)
	}
	if err := m.Migrate(ctx); err != nil {
		return from, 0, fmt.Errorf("migrations: migrate from %d: %w", from, err)
	}
	to, err = m.GetCurrentVersion(ctx)
	if err != nil {
		return from, 0, fmt.Errorf("migrations: current version: %w", err)
	}
	return from, to, nil
}

// ApplyURL connects to url and applies the migrations.
func ApplyURL(ctx context.Context, url string) (from, to int32, err error) {
	conn, err := pgx.Connect(ctx, url)
	if err != nil {
		return 0, 0, fmt.Errorf("migrations: connect: %w", err)
	}
	defer conn.Close(context.WithoutCancel(ctx))
	return Apply(ctx, conn)
}
