// Package database opens millrace's PostgreSQL database for a command: the
// URL (DATABASE_URL, or in development database "millrace" on the server
// internal/devdb finds, created on first use), the migrations, and the
// pool's settings. Connect keeps trying while the database is away, so
// that a process can start, and serve what needs no database, before
// PostgreSQL answers.
package database

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/devdb"
	"github.com/millrace/millrace/migrations"
)

// DevDatabase is the database the development defaults create and use.
const DevDatabase = "millrace"

// RetryEvery is how often Connect tries again.
const RetryEvery = 2 * time.Second

// Config says which database to open and how.
type Config struct {
	// URL is the database's; empty: DevDatabase on the server devdb finds
	// (127.0.0.1:5432 if it answers, else a private cluster in DevDir).
	URL    string
	DevDir string
	// Migrate brings the schema up to date before the pool opens.
	Migrate bool
	// Logger logs the development server used and the migrations; nil:
	// slog.Default().
	Logger *slog.Logger
}

func (c Config) log() *slog.Logger {
	if c.Logger == nil {
		return slog.Default()
	}
	return c.Logger
}

// URL is the database's URL, making the development database when the
// configuration names none.
func URL(ctx context.Context, c Config) (string, error) {
	if c.URL != "" {
		return c.URL, nil
	}
	srv, err := devdb.Find(ctx, c.DevDir)
	if err != nil {
		return "", fmt.Errorf("no DATABASE_URL and no development database: %w", err)
	}
	if srv.Private {
		c.log().Info("using the private PostgreSQL cluster", "dir", srv.DataDir())
	}
	return srv.EnsureDatabase(ctx, DevDatabase)
}

// Open connects a pool (migrating first when c.Migrate).
func Open(ctx context.Context, c Config) (*pgxpool.Pool, error) {
	url, err := URL(ctx, c)
	if err != nil {
		return nil, err
	}
	if c.Migrate {
		from, to, err := migrations.ApplyURL(ctx, url)
		if err != nil {
			return nil, err
		}
		if from != to {
			c.log().Info("migrated the database", "from", from, "to", to)
		}
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("database URL: %w", err)
	}
	// millrace's statements are short and run thousands of times; a
	// planner estimate over jit_above_cost made PostgreSQL JIT-compile the
	// fleet sweep (~240 ms each time for a 2 ms statement). A URL that sets
	// jit itself wins.
	if _, ok := cfg.ConnConfig.RuntimeParams["jit"]; !ok {
		cfg.ConnConfig.RuntimeParams["jit"] = "off"
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	return pool, nil
}

// Connect is Open, tried again every RetryEvery while the database is
// away; nil when ctx ends first. A pool connects lazily: only with Migrate
// does Open prove that the database answers.
func Connect(ctx context.Context, c Config) *pgxpool.Pool {
	for {
		p, err := Open(ctx, c)
		if err == nil {
			return p
		}
		if ctx.Err() != nil {
			return nil
		}
		c.log().Warn("database not available; retrying", "err", err)
		t := time.NewTimer(RetryEvery)
		select {
		case <-ctx.Done():
			t.Stop()
			return nil
		case <-t.C:
		}
	}
}
