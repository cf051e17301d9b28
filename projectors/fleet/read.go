package fleet

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrNotFound is returned by Show for a node the projection does not know.
var ErrNotFound = errors.New("fleet: node not found")

// Querier is what the read side needs of a database handle; *pgxpool.Pool,
// *pgx.Conn and pgx.Tx all have it.
type Querier interface {
	Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error)
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// Node is one node as the projection knows it.
type Node struct {
	ID           string            `json:"id"`
	Pool         string            `json:"pool"`
	Labels       map[string]string `json:"labels"`
	AgentVersion string            `json:"agent_version"`
	// SessionID is the node's newest session; GatewayID the gateway that
	// holds it, "" once it disconnected.
	SessionID string `json:"session_id"`
	GatewayID string `json:"gateway_id"`
	Connected bool   `json:"connected"`
	// State is healthy, suspect or unreachable; StateSince when the node
	// entered it (for the sweep's transitions, the moment it crossed the
	// threshold, not the time of the sweep).
	State      string      `json:"state"`
	StateSince time.Time   `json:"state_since"`
	FirstSeen  time.Time   `json:"first_seen"`
	LastSeen   time.Time   `json:"last_seen"`
	StatusHash string      `json:"status_hash"`
	Conditions []Condition `json:"conditions"`
	// Rev orders changes: every change but last_seen alone takes a new one.
	Rev int64 `json:"rev"`
	// Devices are filled by Show, sorted by index; Nodes leaves them nil.
	Devices []Device `json:"devices,omitempty"`
}

// Device is one GPU of a node.
type Device struct {
	Index     int32  `json:"index"`
	Model     string `json:"model"`
	MemoryMiB int64  `json:"memory_mib"`
	UUID      string `json:"uuid"`
	Health    string `json:"health"` // ok, degraded, failed or unspecified
}

const nodeColumns = `node_id, pool, labels, agent_version, session_id, gateway_id, connected, state,
	state_since, first_seen, last_seen, status_hash, conditions, rev`

func scanNode(row pgx.Row) (Node, error) {
	var n Node
	err := row.Scan(&n.ID, &n.Pool, &n.Labels, &n.AgentVersion, &n.SessionID, &n.GatewayID, &n.Connected,
		&n.State, &n.StateSince, &n.FirstSeen, &n.LastSeen, &n.StatusHash, &n.Conditions, &n.Rev)
	n.StateSince, n.FirstSeen, n.LastSeen = n.StateSince.UTC(), n.FirstSeen.UTC(), n.LastSeen.UTC()
	return n, err
}

// Nodes lists the nodes of a pool ("" for every pool), sorted by pool and
// id, without their devices.
func Nodes(ctx context.Context, q Querier, pool string) ([]Node, error) {
	rows, err := q.Query(ctx, `select `+nodeColumns+` from fleet_nodes
		where $1 = '' or pool = $1 order by pool collate "C", node_id collate "C"`, pool)
	if err != nil {
		return nil, fmt.Errorf("fleet: nodes of %q: %w", pool, err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (Node, error) { return scanNode(r) })
	if err != nil {
		return nil, fmt.Errorf("fleet: nodes of %q: %w", pool, err)
	}
	return out, nil
}

// Show returns one node (pool and id: a node of the same id in another
// pool is another node) with its devices, or ErrNotFound. (It is not named
// Node, which is the type.)
func Show(ctx context.Context, q Querier, pool, nodeID string) (*Node, error) {
	n, err := scanNode(q.QueryRow(ctx, `select `+nodeColumns+` from fleet_nodes where pool = $1 and node_id = $2`, pool, nodeID))
	if errors.Is(err, pgx.ErrNoRows) {
		return nil, ErrNotFound
	}
	if err != nil {
		return nil, fmt.Errorf("fleet: node %s/%s: %w", pool, nodeID, err)
	}
	rows, err := q.Query(ctx, `select gpu_index, model, memory_mib, uuid, health from fleet_devices
		where pool = $1 and node_id = $2 order by gpu_index`, pool, nodeID)
	if err != nil {
		return nil, fmt.Errorf("fleet: devices of %s/%s: %w", pool, nodeID, err)
	}
	n.Devices, err = pgx.CollectRows(rows, pgx.RowToStructByPos[Device])
	if err != nil {
		return nil, fmt.Errorf("fleet: devices of %s/%s: %w", pool, nodeID, err)
	}
	if n.Devices == nil {
		n.Devices = []Device{}
	}
	return &n, nil
}

// PoolCounts are the nodes of one pool by state.
type PoolCounts struct {
	Healthy     int `json:"healthy"`
	Suspect     int `json:"suspect"`
	Unreachable int `json:"unreachable"`
	// Connected counts nodes that hold a session now, whatever their state.
	Connected int `json:"connected"`
}

// Counts returns the number of nodes by state, per pool.
func Counts(ctx context.Context, q Querier) (map[string]PoolCounts, error) {
	rows, err := q.Query(ctx, `select pool,
		count(*) filter (where state = 'healthy'), count(*) filter (where state = 'suspect'),
		count(*) filter (where state = 'unreachable'), count(*) filter (where connected)
		from fleet_nodes group by pool`)
	if err != nil {
		return nil, fmt.Errorf("fleet: counts: %w", err)
	}
	out := map[string]PoolCounts{}
	var (
		pool string
		c    PoolCounts
	)
	if _, err := pgx.ForEachRow(rows, []any{&pool, &c.Healthy, &c.Suspect, &c.Unreachable, &c.Connected}, func() error {
		out[pool] = c
		return nil
	}); err != nil {
		return nil, fmt.Errorf("fleet: counts: %w", err)
	}
	return out, nil
}

// NodeRef names a node: its pool and id.
type NodeRef struct {
	Pool string `json:"pool"`
	ID   string `json:"id"`
}

// Unreachable lists, sorted by pool and id, the nodes that are unreachable
// and entered that state after since (by StateSince: the moment each
// crossed UnreachableAfter, which is earlier than the sweep that noticed
// it).
func Unreachable(ctx context.Context, q Querier, since time.Time) ([]NodeRef, error) {
	rows, err := q.Query(ctx, `select pool, node_id from fleet_nodes
		where state = 'unreachable' and state_since > $1 order by pool collate "C", node_id collate "C"`, since)
	if err != nil {
		return nil, fmt.Errorf("fleet: unreachable: %w", err)
	}
	ids, err := pgx.CollectRows(rows, pgx.RowToStructByPos[NodeRef])
	if err != nil {
		return nil, fmt.Errorf("fleet: unreachable: %w", err)
	}
	return ids, nil
}

// DigestTables are the tables that make up the projection, in the order
// Digest reports them; Reset empties them.
var DigestTables = []string{"fleet_nodes", "fleet_devices", "fleet_allocation_reports", "fleet_clock"}

// digestSpec says what Digest hashes of each table and in which order: every
// column but fleet_nodes.rev, whose values depend on how many changes the
// sequence counted before (a replay counts on from the live run's).
var digestSpec = map[string]struct{ row, order string }{
	"fleet_nodes": {`(t.node_id, t.pool, t.labels, t.agent_version, t.session_id, t.gateway_id, t.connected,
		t.state, t.state_since, t.first_seen, t.last_seen, t.status_hash, t.conditions,
		t.held_allocations, t.held_at)`, `t.pool collate "C", t.node_id collate "C"`},
	"fleet_devices":            {`t`, `t.pool collate "C", t.node_id collate "C", t.gpu_index`},
	"fleet_allocation_reports": {`t`, `t.allocation_id collate "C", t.pool collate "C", t.node_id collate "C"`},
	"fleet_clock":              {`t`, `t.id`},
}

// Digest returns, per projection table, the md5 of all its rows (their
// text form) in key order, leaving out fleet_nodes.rev. Two databases hold
// the same projection iff the digests are equal, which is how a replay is
// checked against the live run. Timestamps are rendered in the session's
// time zone: compare digests taken with the same TimeZone setting.
func Digest(ctx context.Context, q Querier) (map[string]string, error) {
	out := make(map[string]string, len(DigestTables))
	for _, table := range DigestTables {
		d := digestSpec[table]
		sql := fmt.Sprintf(`select md5(coalesce(string_agg((%s)::text, E'\n' order by %s), '')) from %s t`,
			d.row, d.order, table)
		var sum string
		if err := q.QueryRow(ctx, sql).Scan(&sum); err != nil {
			return nil, fmt.Errorf("fleet: digest %s: %w", table, err)
		}
		out[table] = sum
	}
	return out, nil
}
