package migrations_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/tern/v2/migrate"

	"github.com/millrace/millrace/migrations"
)

// migratedBefore brings conn's database up to the migration before the one
// named NNN_<name>.sql and returns a migrator of every migration and that
// one's version. It is found by name, so that a renumbering at merge keeps
// a test right.
func migratedBefore(t testing.TB, conn *pgx.Conn, name string) (*migrate.Migrator, int32) {
	t.Helper()
	ctx := context.Background()
	m, err := migrate.NewMigrator(ctx, conn, migrations.VersionTable)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.LoadMigrations(migrations.FS()); err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(m.Migrations, func(x *migrate.Migration) bool { return strings.HasSuffix(x.Name, "_"+name+".sql") })
	if i < 0 {
		t.Fatalf("no migration named *_%s.sql", name)
	}
	version := m.Migrations[i].Sequence
	if err := m.MigrateTo(ctx, version-1); err != nil {
		t.Fatal(err)
	}
	return m, version
}
