package database_test

import (
	"flag"
	"log/slog"
	"os"
	"testing"

	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
)

// options registers the database's flags and parses args.
func options(t *testing.T, args ...string) database.Options {
	t.Helper()
	var o database.Options
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	o.RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	if err := envflag.Errors(fs); err != nil {
		t.Fatal(err)
	}
	return o
}

// The flags and their variables land in Config, with the command's say on
// migrating and logging.
func TestOptionsConfig(t *testing.T) {
	t.Setenv("DATABASE_URL", "")
	os.Unsetenv("DATABASE_URL")
	t.Setenv("MILLRACE_PG_DIR", "")
	os.Unsetenv("MILLRACE_PG_DIR")
	if c := options(t).Config(false, nil); c != (database.Config{DevDir: "var/pg"}) {
		t.Fatalf("defaults gave %+v", c)
	}
	t.Setenv("MILLRACE_PG_DIR", "from-env")
	log := slog.Default()
	want := database.Config{URL: "postgres://db/x", DevDir: "from-env", Migrate: true, Logger: log}
	if c := options(t, "-database-url", "postgres://db/x").Config(true, log); c != want {
		t.Fatalf("Config(true, log) = %+v, want %+v", c, want)
	}
}
