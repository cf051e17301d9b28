package fleet

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
)

// The operator's overview of the fleet, for the console's fleet page:
// pools with their nodes by state and their GPUs, a pool's nodes a page
// at a time, its reservations newest first, and how long placements took.
// Each read is one query on a key or an index; none reads every
// reservation.

// PoolSummary is one pool: its nodes by state, its GPUs (and those not
// healthy: degraded or failed), the GPUs its live allocations hold.
type PoolSummary struct {
	Pool        string `json:"pool"`
	Nodes       int    `json:"nodes"`
	Healthy     int    `json:"healthy"`
	Suspect     int    `json:"suspect"`
	Unreachable int    `json:"unreachable"`
	Connected   int    `json:"connected"`
	GPUs        int    `json:"gpus"`
	GPUsBad     int    `json:"gpus_unhealthy"`
	GPUsHeld    int    `json:"gpus_allocated"`
}

// Pools summarizes every pool, by name.
func Pools(ctx context.Context, q Querier) ([]PoolSummary, error) {
	rows, err := q.Query(ctx, `with n as (
		select pool, count(*) as nodes, count(*) filter (where state = 'healthy') as healthy,
		       count(*) filter (where state = 'suspect') as suspect, count(*) filter (where state = 'unreachable') as unreachable,
		       count(*) filter (where connected) as connected
		from fleet_nodes group by pool
	), d as (
		select pool, count(*) as gpus, count(*) filter (where health in ('degraded', 'failed')) as bad
		from fleet_devices group by pool
	), a as (
		select pool, sum(cardinality(gpu_indices)) as held from fleet_allocations where released_at is null group by pool
	)
	select n.pool, n.nodes, n.healthy, n.suspect, n.unreachable, n.connected,
	       coalesce(d.gpus, 0), coalesce(d.bad, 0), coalesce(a.held, 0)
	from n left join d on d.pool = n.pool left join a on a.pool = n.pool
	order by n.pool collate "C"`)
	if err != nil {
		return nil, fmt.Errorf("fleet: pools: %w", err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowToStructByPos[PoolSummary])
	if err != nil {
		return nil, fmt.Errorf("fleet: pools: %w", err)
	}
	return out, nil
}

// NodeQuery is a page of a pool's nodes: State (healthy, suspect,
// unreachable; "" any), after the node id After, at most Limit (0: 100).
type NodeQuery struct {
	Pool, State, After string
	Limit              int
}

// NodeRow is a node as a list shows it: the node, its GPUs and those not
// healthy.
type NodeRow struct {
	Node
	GPUs    int `json:"gpus"`
	GPUsBad int `json:"gpus_unhealthy"`
}

// MaxNodeRows is the most nodes a page holds.
const MaxNodeRows = 1000

// NodesPage reads a page of a pool's nodes in id order (the primary key's),
// each with its GPU counts; Next is the After of the next page ("" on the
// last).
func NodesPage(ctx context.Context, q Querier, nq NodeQuery) (rows []NodeRow, next string, err error) {
	switch nq.State {
	case "", "healthy", "suspect", "unreachable":
	default:
		return nil, "", fmt.Errorf("state %q is none of healthy, suspect, unreachable", nq.State)
	}
	limit := nq.Limit
	if limit <= 0 {
		limit = 100
	}
	limit = min(limit, MaxNodeRows)
	rs, err := q.Query(ctx, `select `+nodeColumnsOf("n")+`, d.gpus, d.bad
		from fleet_nodes n cross join lateral (
			select count(*)::int as gpus, (count(*) filter (where health in ('degraded', 'failed')))::int as bad
			from fleet_devices d where d.pool = n.pool and d.node_id = n.node_id) d
		where n.pool = $1 and n.node_id > $2 and ($3 = '' or n.state = $3)
		order by n.node_id limit $4`, nq.Pool, nq.After, nq.State, limit+1)
	if err != nil {
		return nil, "", fmt.Errorf("fleet: nodes of %q: %w", nq.Pool, err)
	}
	defer rs.Close()
	for rs.Next() {
		var r NodeRow
		n := &r.Node
		if err := rs.Scan(&n.ID, &n.Pool, &n.Labels, &n.AgentVersion, &n.SessionID, &n.GatewayID, &n.Connected,
			&n.State, &n.StateSince, &n.FirstSeen, &n.LastSeen, &n.StatusHash, &n.Conditions, &n.Rev, &r.GPUs, &r.GPUsBad); err != nil {
			return nil, "", fmt.Errorf("fleet: nodes of %q: %w", nq.Pool, err)
		}
		n.StateSince, n.FirstSeen, n.LastSeen = n.StateSince.UTC(), n.FirstSeen.UTC(), n.LastSeen.UTC()
		rows = append(rows, r)
	}
	if err := rs.Err(); err != nil {
		return nil, "", fmt.Errorf("fleet: nodes of %q: %w", nq.Pool, err)
	}
	if len(rows) > limit {
		rows = rows[:limit]
		next = rows[limit-1].ID
	}
	return rows, next, nil
}

func nodeColumnsOf(alias string) string {
	return alias + `.node_id, ` + alias + `.pool, ` + alias + `.labels, ` + alias + `.agent_version, ` + alias + `.session_id, ` +
		alias + `.gateway_id, ` + alias + `.connected, ` + alias + `.state, ` + alias + `.state_since, ` + alias + `.first_seen, ` +
		alias + `.last_seen, ` + alias + `.status_hash, ` + alias + `.conditions, ` + alias + `.rev`
}

// Reservation is a reservation as the console lists it: what it asked
// for, its state (PENDING, PLACED, ACTIVE, FAILED, CANCELLED) and how long
// its placement took.
type Reservation struct {
	ID          string     `json:"id"`
	Pool        string     `json:"pool"`
	GPUs        int        `json:"gpus"`
	Nodes       int        `json:"nodes"`
	Model       string     `json:"model"`
	Owner       string     `json:"owner"`
	State       string     `json:"state"`
	RequestedAt time.Time  `json:"requested_at"`
	PlacedAt    *time.Time `json:"placed_at"`
	EndedAt     *time.Time `json:"ended_at"`
	Reason      string     `json:"reason"`
	// PlacementMs is how long it waited to be placed (null: not yet, or
	// never).
	PlacementMs *int64 `json:"placement_ms"`
}

// Reservations lists the newest reservations of pool ("" every pool), at
// most limit (0: 50): of each pool from its index on (pool, requested_at),
// merged.
func Reservations(ctx context.Context, q Querier, pool string, limit int) ([]Reservation, error) {
	if limit <= 0 {
		limit = 50
	}
	limit = min(limit, MaxNodeRows)
	rows, err := q.Query(ctx, `select r.id, r.pool, r.gpus, r.nodes, r.model, r.owner, r.state, r.requested_at, r.placed_at, r.ended_at, r.reason
		from (select distinct pool from fleet_reservations where $1 = '' or pool = $1) p
		cross join lateral (select s.* from fleet_reservation_status s where s.pool = p.pool
		                    order by s.requested_at desc limit $2) r`, pool, limit)
	if err != nil {
		return nil, fmt.Errorf("fleet: reservations: %w", err)
	}
	defer rows.Close()
	var out []Reservation
	for rows.Next() {
		var r Reservation
		if err := rows.Scan(&r.ID, &r.Pool, &r.GPUs, &r.Nodes, &r.Model, &r.Owner, &r.State, &r.RequestedAt, &r.PlacedAt, &r.EndedAt, &r.Reason); err != nil {
			return nil, fmt.Errorf("fleet: reservations: %w", err)
		}
		r.RequestedAt = r.RequestedAt.UTC()
		if r.PlacedAt != nil {
			ms := r.PlacedAt.Sub(r.RequestedAt).Milliseconds()
			r.PlacementMs = &ms
		}
		out = append(out, r)
	}
	if err := rows.Err(); err != nil {
		return nil, fmt.Errorf("fleet: reservations: %w", err)
	}
	slices.SortFunc(out, func(a, b Reservation) int {
		return cmp.Or(b.RequestedAt.Compare(a.RequestedAt), cmp.Compare(a.ID, b.ID))
	})
	return out[:min(limit, len(out))], nil
}

// Latency is how long the placements of a window took, from the request
// to the decision, in milliseconds.
type Latency struct {
	Placements int     `json:"placements"`
	P50Ms      float64 `json:"p50_ms"`
	P90Ms      float64 `json:"p90_ms"`
	P99Ms      float64 `json:"p99_ms"`
	MaxMs      float64 `json:"max_ms"`
}

// PlacementLatency is the latency of the placements made since (of pool,
// "" every pool), on the index of their times (migration 025).
func PlacementLatency(ctx context.Context, q Querier, pool string, since time.Time) (Latency, error) {
	var l Latency
	var pct []float64
	err := q.QueryRow(ctx, `select count(*), percentile_cont(array[0.5, 0.9, 0.99]) within group (order by ms), coalesce(max(ms), 0)
		from (select extract(epoch from p.placed_at - r.requested_at) * 1000 as ms
		      from fleet_placements p join fleet_reservations r on r.id = p.reservation_id
		      where p.placed_at >= $1 and ($2 = '' or r.pool = $2)) x`, since, pool).Scan(&l.Placements, &pct, &l.MaxMs)
	if err != nil {
		return l, fmt.Errorf("fleet: placement latency: %w", err)
	}
	if len(pct) == 3 {
		l.P50Ms, l.P90Ms, l.P99Ms = pct[0], pct[1], pct[2]
	}
	return l, nil
}
