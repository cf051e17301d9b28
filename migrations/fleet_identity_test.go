package migrations_test

import (
	"context"
	"slices"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/tern/v2/migrate"

	"github.com/millrace/millrace/migrations"
)

// TestFleetIdentityMovesRows: migration 008 keys the fleet tables by
// (pool, node). Rows written before it keep their meaning: each device
// takes its node's pool, each booking its allocation's, each report its
// reporting node's; and the migration goes down again.
func TestFleetIdentityMovesRows(t *testing.T) {
	const fleetIdentity = 8 // 008_fleet_node_identity.sql
	ctx := context.Background()
	conn := emptyDatabase(t)
	m, err := migrate.NewMigrator(ctx, conn, migrations.VersionTable)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.LoadMigrations(migrations.FS()); err != nil {
		t.Fatal(err)
	}
	// The fleet tables last changed shape in 006; 007 is the builds'.
	before := int32(fleetIdentity - 1)
	if err := m.MigrateTo(ctx, before); err != nil {
		t.Fatal(err)
	}
	exec := func(sql string) {
		t.Helper()
		if _, err := conn.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	// As 006 stored them: node ids unique, pools in fleet_nodes and
	// fleet_allocations only.
	exec(`insert into fleet_nodes (node_id, pool, state_since, first_seen, last_seen) values
		('n1', 'prod', now(), now(), now()), ('n2', 'sandbox', now(), now(), now())`)
	exec(`insert into fleet_devices (node_id, gpu_index, model) values ('n1', 0, 'H100'), ('n1', 1, 'H100'), ('n2', 0, 'T4')`)
	exec(`insert into fleet_allocations (id, reservation_id, pool, node_id, gpu_indices, decision_id, placed_at) values
		('r1/1/0', 'r1', 'prod', 'n1', '{0,1}', 'r1/place/1', now())`)
	exec(`insert into fleet_bookings (node_id, gpu_index, allocation_id, reservation_id) values
		('n1', 0, 'r1/1/0', 'r1'), ('n1', 1, 'r1/1/0', 'r1')`)
	exec(`insert into fleet_allocation_reports (allocation_id, node_id, state, reported_at) values
		('r1/1/0', 'n1', 'bound', now()), ('gone/1/0', 'gone', 'failed', now())`)

	if err := m.MigrateTo(ctx, fleetIdentity); err != nil {
		t.Fatal(err)
	}
	rows := func(sql string) []string {
		t.Helper()
		r, err := conn.Query(ctx, sql)
		if err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
		out, err := pgx.CollectRows(r, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	for _, c := range []struct {
		sql  string
		want []string
	}{
		{`select pool || '/' || node_id || ':' || gpu_index from fleet_devices order by 1`, []string{"prod/n1:0", "prod/n1:1", "sandbox/n2:0"}},
		{`select pool || '/' || node_id || ':' || gpu_index from fleet_bookings order by 1`, []string{"prod/n1:0", "prod/n1:1"}},
		{`select allocation_id || ' ' || pool || '/' || node_id from fleet_allocation_reports order by 1`,
			[]string{"gone/1/0 /gone", "r1/1/0 prod/n1"}},
		{`select id || ' ' || state from fleet_reservation_status`, nil},
	} {
		if got := rows(c.sql); !slices.Equal(got, c.want) {
			t.Errorf("%s: %v, want %v", c.sql, got, c.want)
		}
	}
	// The pair is the key now: n1 of sandbox is another node.
	exec(`insert into fleet_nodes (node_id, pool, state_since, first_seen, last_seen) values ('n1', 'sandbox', now(), now(), now())`)
	exec(`insert into fleet_devices (pool, node_id, gpu_index, model) values ('sandbox', 'n1', 0, 'T4')`)
	exec(`delete from fleet_devices where pool = 'sandbox' and node_id = 'n1'`)
	exec(`delete from fleet_nodes where pool = 'sandbox' and node_id = 'n1'`)

	if err := m.MigrateTo(ctx, before); err != nil {
		t.Fatalf("down to %d: %v", before, err)
	}
	if got := rows(`select node_id || ':' || gpu_index from fleet_devices order by 1`); !slices.Equal(got, []string{"n1:0", "n1:1", "n2:0"}) {
		t.Errorf("devices after going down: %v", got)
	}
}
