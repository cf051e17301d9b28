package fleet_test

import (
	"context"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/fleet"
)

// The overview reads: pools by state with their GPUs, a pool's nodes a
// page at a time with their GPUs, reservations newest first across pools
// with their placement latency, and the latency of a window's placements.
func TestOverview(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `
		insert into fleet_nodes (node_id, pool, state, connected, state_since, first_seen, last_seen)
		select format('n%s', i), case when i <= 5 then 'a100' else 'h100' end,
		       case when i = 2 then 'suspect' when i = 3 then 'unreachable' else 'healthy' end, i <> 3, now(), now(), now()
		from generate_series(1, 7) i;
		insert into fleet_devices (pool, node_id, gpu_index, health)
		select n.pool, n.node_id, g, case when n.node_id = 'n1' and g = 0 then 'failed' else 'ok' end
		from fleet_nodes n, generate_series(0, 3) g;
		insert into fleet_reservations (id, pool, gpus, owner, requested_at) values
		    ('r1', 'a100', 2, 'ml', now() - interval '10 minutes'),
		    ('r2', 'a100', 1, 'ml', now() - interval '5 minutes'),
		    ('r3', 'h100', 4, 'cv', now() - interval '1 minute'),
		    ('r4', 'h100', 1, 'cv', now() - interval '3 days');
		insert into fleet_placements (reservation_id, decision_id, placed_at) values
		    ('r1', 'd1', now() - interval '10 minutes' + interval '200 milliseconds'),
		    ('r3', 'd3', now() - interval '1 minute' + interval '1 second'),
		    ('r4', 'd4', now() - interval '3 days' + interval '9 seconds');
		insert into fleet_allocations (id, reservation_id, pool, node_id, gpu_indices, decision_id, placed_at) values
		    ('a1', 'r1', 'a100', 'n1', '{1,2}', 'd1', now()), ('a3', 'r3', 'h100', 'n6', '{0,1,2,3}', 'd3', now())`); err != nil {
		t.Fatal(err)
	}
	pools, err := fleet.Pools(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	want := []fleet.PoolSummary{
		{Pool: "a100", Nodes: 5, Healthy: 3, Suspect: 1, Unreachable: 1, Connected: 4, GPUs: 20, GPUsBad: 1, GPUsHeld: 2},
		{Pool: "h100", Nodes: 2, Healthy: 2, Connected: 2, GPUs: 8, GPUsHeld: 4},
	}
	if len(pools) != 2 || pools[0] != want[0] || pools[1] != want[1] {
		t.Errorf("pools %+v, want %+v", pools, want)
	}

	page, next, err := fleet.NodesPage(ctx, pool, fleet.NodeQuery{Pool: "a100", Limit: 2})
	if err != nil || len(page) != 2 || page[0].ID != "n1" || page[0].GPUs != 4 || page[0].GPUsBad != 1 || next != "n2" {
		t.Fatalf("first page: %v %+v next %q", err, page, next)
	}
	page, next, err = fleet.NodesPage(ctx, pool, fleet.NodeQuery{Pool: "a100", After: next, Limit: 10})
	if err != nil || len(page) != 3 || page[0].ID != "n3" || next != "" {
		t.Fatalf("the rest: %v %+v next %q", err, page, next)
	}
	page, _, _ = fleet.NodesPage(ctx, pool, fleet.NodeQuery{Pool: "a100", State: "unreachable"})
	if len(page) != 1 || page[0].ID != "n3" || page[0].Connected {
		t.Errorf("unreachable nodes: %+v", page)
	}
	if _, _, err := fleet.NodesPage(ctx, pool, fleet.NodeQuery{Pool: "a100", State: "gone"}); err == nil {
		t.Error("a bad state")
	}

	rs, err := fleet.Reservations(ctx, pool, "", 3)
	if err != nil || len(rs) != 3 || rs[0].ID != "r3" || rs[1].ID != "r2" || rs[2].ID != "r1" {
		t.Fatalf("newest reservations: %v %+v", err, rs)
	}
	if rs[2].PlacementMs == nil || *rs[2].PlacementMs != 200 || rs[1].PlacementMs != nil || rs[1].State != "PENDING" || rs[0].State == "PENDING" {
		t.Errorf("states and latency: %+v %+v %+v", rs[0], rs[1], rs[2])
	}
	if rs, _ := fleet.Reservations(ctx, pool, "h100", 0); len(rs) != 2 || rs[1].ID != "r4" {
		t.Errorf("h100's: %+v", rs)
	}

	l, err := fleet.PlacementLatency(ctx, pool, "", time.Now().Add(-time.Hour))
	if err != nil || l.Placements != 2 || l.MaxMs < 999 || l.MaxMs > 1001 || l.P50Ms < 599 || l.P50Ms > 601 {
		t.Errorf("the last hour: %v %+v", err, l)
	}
	if l, _ := fleet.PlacementLatency(ctx, pool, "a100", time.Now().Add(-time.Hour)); l.Placements != 1 {
		t.Errorf("a100's last hour: %+v", l)
	}
	if l, err := fleet.PlacementLatency(ctx, pool, "none", time.Now()); err != nil || l.Placements != 0 {
		t.Errorf("no placements: %v %+v", err, l)
	}
}
