package database

import (
	"flag"
	"log/slog"

	"github.com/millrace/millrace/internal/envflag"
)

// Options are the flags that say where PostgreSQL is, as every command
// that opens the database registers them; they live beside Config so that
// the development fallback (DevDir) and its flag stay one thing.
type Options struct {
	// URL is Config.URL (DATABASE_URL); empty: the development database.
	URL string
	// DevDir is Config.DevDir, the private development cluster's directory.
	DevDir string
}

// RegisterFlags registers the database's flags on fs, each with its
// environment variable (internal/envflag).
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	envflag.String(fs, &o.URL, "database-url", "DATABASE_URL", "", "PostgreSQL URL; empty uses 127.0.0.1:5432 if it answers, else a private cluster in --pg-dir")
	envflag.String(fs, &o.DevDir, "pg-dir", "MILLRACE_PG_DIR", "var/pg", "data directory of the private development cluster")
}

// Config is the database's configuration. Whether to migrate is the
// command's to say, not the operator's: a server brings the schema up to
// date before its pool opens, a reading tool leaves it as it is.
func (o Options) Config(migrate bool, log *slog.Logger) Config {
	return Config{URL: o.URL, DevDir: o.DevDir, Migrate: migrate, Logger: log}
}
