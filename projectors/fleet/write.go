package fleet

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Rows are written with plain INSERTs and UPDATEs over unnest() arrays,
// one statement per table and kind, all in one pipeline: the load told
// which nodes exist. (INSERT ... ON CONFLICT would cost two more WAL
// records per row; only the rare allocation reports and the one clock row
// use it.) A node whose only change is last_seen, the common case of a
// heartbeat, is written by a statement that sets last_seen alone: it
// touches no indexed column, so PostgreSQL can update it in place (HOT,
// with the table's fillfactor 80), and it keeps its rev.

const nodeRows = `
from unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::bool[], $8::text[],
            $9::timestamptz[], $10::timestamptz[], $11::timestamptz[], $12::text[], $13::text[], $14::text[],
            $15::text[], $16::timestamptz[])
     as u(node_id, pool, labels, agent_version, session_id, gateway_id, connected, state,
          state_since, first_seen, last_seen, status_hash, conditions, inventory_hash, held, held_at)`

// heldArray turns u.held (a JSON array of allocation ids, one per node:
// unnest cannot take arrays of arrays of different lengths) into text[].
const heldArray = `array(select jsonb_array_elements_text(u.held::jsonb))`

const sqlInsertNodes = `
insert into fleet_nodes (node_id, pool, labels, agent_version, session_id, gateway_id, connected, state,
                         state_since, first_seen, last_seen, status_hash, conditions, inventory_hash,
                         held_allocations, held_at)
select u.node_id, u.pool, u.labels::jsonb, u.agent_version, u.session_id, u.gateway_id, u.connected, u.state,
       u.state_since, u.first_seen, u.last_seen, coalesce(u.status_hash, ''), coalesce(u.conditions, '[]')::jsonb,
       u.inventory_hash, ` + heldArray + `, u.held_at
` + nodeRows

// sqlUpdateNodes writes the fold's nodes; a NULL keeps the stored value of
// a column the batch did not set. Every such change takes a new rev.
const sqlUpdateNodes = `
update fleet_nodes n set
    labels        = coalesce(u.labels::jsonb, n.labels),
    agent_version = coalesce(u.agent_version, n.agent_version),
    session_id    = u.session_id,
    gateway_id    = u.gateway_id,
    connected     = u.connected,
    state         = u.state,
    state_since   = u.state_since,
    last_seen     = u.last_seen,
    status_hash   = coalesce(u.status_hash, n.status_hash),
    conditions    = coalesce(u.conditions::jsonb, n.conditions),
    inventory_hash = u.inventory_hash,
    held_allocations = case when u.held is null then n.held_allocations else ` + heldArray + ` end,
    held_at       = coalesce(u.held_at, n.held_at),
    rev           = nextval('fleet_rev')
` + nodeRows + `
where n.pool = u.pool and n.node_id = u.node_id`

const sqlUpdateSeen = `
update fleet_nodes n set last_seen = u.last_seen
from unnest($1::text[], $2::text[], $3::timestamptz[]) as u(pool, node_id, last_seen)
where n.pool = u.pool and n.node_id = u.node_id`

// agedSQL is Config.aged in SQL, over the fleet_nodes row n: the state and
// state_since it has after a sweep at horizon h, with nodes aging from no
// earlier than resumed (h and resumed are SQL expressions; a NULL horizon
// changes nothing), and the condition under which that differs from the
// stored state. Sweep and sqlLiveness both use it, so the rule is written
// once in each language.
func agedSQL(h, resumed, suspect, unreachable string) (state, since, changes string) {
	base := "greatest(n.last_seen, " + resumed + ")"
	toUnreachable := "n.state <> 'unreachable' and " + base + " < " + h + " - " + unreachable
	toSuspect := "n.state = 'healthy' and " + base + " < " + h + " - " + suspect
	state = "case when " + toUnreachable + " then 'unreachable' when " + toSuspect + " then 'suspect' else n.state end"
	since = "case when " + toUnreachable + " then " + base + " + " + unreachable +
		" when " + toSuspect + " then " + base + " + " + suspect + " else n.state_since end"
	changes = "((" + toUnreachable + ") or (" + toSuspect + "))"
	return state, since, changes
}

// sqlLiveness applies one liveness entry to each of its nodes, as the fold
// does (fold.liveness): age the node to the entry's horizon, move
// last_seen, and if the entry is fresh make the node healthy since it was
// seen. The SET expressions all read the stored row. Entries of unknown
// nodes, or no newer than last_seen, match no row.
var sqlLiveness = func() string {
	aged, agedSince, _ := agedSQL("u.horizon", "u.resumed", "$7::interval", "$8::interval")
	state := "case when u.fresh then 'healthy' else " + aged + " end"
	since := "case when u.fresh and " + aged + " <> 'healthy' then u.seen else " + agedSince + " end"
	return `
update fleet_nodes n set
    last_seen   = u.seen,
    state       = ` + state + `,
    state_since = ` + since + `,
    rev         = case when (` + state + `) <> n.state or (` + since + `) <> n.state_since
                       then nextval('fleet_rev') else n.rev end
from unnest($1::text[], $2::text[], $3::timestamptz[], $4::bool[], $5::timestamptz[], $6::timestamptz[])
     as u(pool, node_id, seen, fresh, horizon, resumed)
where n.pool = u.pool and n.node_id = u.node_id and u.seen > n.last_seen`
}()

// sqlSweepAt ages every node to a given horizon and resumed time: the
// runner's Sweep, and the sweeps the stream's own clock calls for
// (fold.liveness).
var sqlSweepAt = func() string {
	state, since, changes := agedSQL("$1::timestamptz", "$2::timestamptz", "$3::interval", "$4::interval")
	return `
update fleet_nodes n set state = ` + state + `, state_since = ` + since + `, rev = nextval('fleet_rev')
where ` + changes
}()

const sqlDeleteDevices = `
delete from fleet_devices d using unnest($1::text[], $2::text[]) as u(pool, node_id)
where d.pool = u.pool and d.node_id = u.node_id`

const sqlInsertDevices = `
insert into fleet_devices (pool, node_id, gpu_index, model, memory_mib, uuid, health)
select * from unnest($1::text[], $2::text[], $3::int4[], $4::text[], $5::int8[], $6::text[], $7::text[])`

// sqlDeviceHealth sets health by index; an index the inventory does not
// have is ignored, and so is a device whose health is unchanged (a
// re-homed node lists all its devices: no row is rewritten for that).
const sqlDeviceHealth = `
update fleet_devices d set health = u.health
from unnest($1::text[], $2::text[], $3::int4[], $4::text[]) as u(pool, node_id, gpu_index, health)
where d.pool = u.pool and d.node_id = u.node_id and d.gpu_index = u.gpu_index and d.health <> u.health`

const sqlReports = `
insert into fleet_allocation_reports as r (allocation_id, pool, node_id, state, error, reported_at)
select * from unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::timestamptz[])
on conflict (allocation_id, pool, node_id) do update set
    state = excluded.state, error = excluded.error, reported_at = excluded.reported_at`

const sqlClock = `
insert into fleet_clock (id, liveness_time, resumed_at) values (true, $1, $2)
on conflict (id) do update set liveness_time = excluded.liveness_time, resumed_at = excluded.resumed_at`

type nodeCols struct {
	pool, id, session, gateway, state     []string
	labels, agent, statusHash, conditions []*string
	inventory                             []string
	held                                  []*string
	heldAt                                []*time.Time
	connected                             []bool
	since, first, last                    []time.Time
}

func (c *nodeCols) add(n *node) {
	c.id = append(c.id, n.id)
	c.pool = append(c.pool, n.pool)
	c.labels = append(c.labels, n.labels)
	c.agent = append(c.agent, n.agent)
	c.session = append(c.session, n.session)
	c.gateway = append(c.gateway, n.gateway)
	c.connected = append(c.connected, n.connected)
	c.state = append(c.state, n.state)
	c.since = append(c.since, n.stateSince)
	c.first = append(c.first, n.firstSeen)
	c.last = append(c.last, n.lastSeen)
	c.statusHash = append(c.statusHash, n.statusHash)
	c.conditions = append(c.conditions, n.conditions)
	c.inventory = append(c.inventory, n.inventory)
	c.held = append(c.held, n.held)
	var at *time.Time
	if n.held != nil {
		at = &n.heldAt
	}
	c.heldAt = append(c.heldAt, at)
}

func (c *nodeCols) args() []any {
	return []any{c.id, c.pool, c.labels, c.agent, c.session, c.gateway, c.connected, c.state,
		c.since, c.first, c.last, c.statusHash, c.conditions, c.inventory, c.held, c.heldAt}
}

type deviceCols struct {
	pool, node, model, uuid, health []string
	index                           []int32
	memory                          []int64
}

func (c *deviceCols) add(k nodeKey, d device) {
	c.pool = append(c.pool, k.pool)
	c.node = append(c.node, k.id)
	c.index = append(c.index, int32(d.index)) // decode refused indices above MaxInt32
	c.model = append(c.model, d.model)
	c.memory = append(c.memory, int64(d.memory)) // and memory above MaxInt64
	c.uuid = append(c.uuid, d.uuid)
	c.health = append(c.health, d.health)
}

// write sends the fold's rows in one pipeline.
func (f *fold) write(ctx context.Context, tx pgx.Tx) error {
	keys := slices.Clone(f.order)
	slices.SortFunc(keys, compareKeys) // rows in key order: the same locks in the same order every time
	var (
		created, changed      nodeCols
		seenPool, seenID      []string
		seenAt                []time.Time
		replPool, replID      []string
		devs                  deviceCols
		hPool, hNode, hHealth []string
		hIndex                []int32
	)
	for _, k := range keys {
		n := f.nodes[k]
		switch {
		case n == nil:
			continue
		case n.created:
			created.add(n)
		case n.full:
			changed.add(n)
		case n.seenMove:
			seenPool, seenID, seenAt = append(seenPool, k.pool), append(seenID, k.id), append(seenAt, n.lastSeen)
		}
		if n.replace {
			replPool, replID = append(replPool, k.pool), append(replID, k.id)
			for _, d := range n.devices {
				devs.add(k, d)
			}
		}
		for _, i := range sortedKeys(n.health) {
			hPool, hNode = append(hPool, k.pool), append(hNode, k.id)
			hIndex, hHealth = append(hIndex, int32(i)), append(hHealth, n.health[i])
		}
	}
	b := &pgx.Batch{}
	if len(created.id) > 0 {
		b.Queue(sqlInsertNodes, created.args()...)
	}
	if len(changed.id) > 0 {
		b.Queue(sqlUpdateNodes, changed.args()...)
	}
	if len(seenID) > 0 {
		b.Queue(sqlUpdateSeen, seenPool, seenID, seenAt)
	}
	if fc := &f.fast; len(fc.id) > 0 {
		b.Queue(sqlLiveness, fc.pool, fc.id, fc.seen, fc.fresh, fc.horizon, fc.resumed,
			f.cfg.SuspectAfter, f.cfg.UnreachableAfter).Exec(func(tag pgconn.CommandTag) error {
			f.stats.IgnoredLiveness += len(fc.id) - int(tag.RowsAffected())
			return nil
		})
	}
	if len(replID) > 0 {
		b.Queue(sqlDeleteDevices, replPool, replID)
	}
	if len(devs.node) > 0 {
		b.Queue(sqlInsertDevices, devs.pool, devs.node, devs.index, devs.model, devs.memory, devs.uuid, devs.health)
	}
	if len(hNode) > 0 {
		b.Queue(sqlDeviceHealth, hPool, hNode, hIndex, hHealth)
	}
	if len(f.repIDs) > 0 {
		rks := slices.Clone(f.repIDs)
		slices.SortFunc(rks, func(a, b reportKey) int {
			return cmp.Or(strings.Compare(a.alloc, b.alloc), compareKeys(a.node, b.node))
		})
		var alloc, pool, node, state, errs []string
		var at []time.Time
		for _, k := range rks {
			r := f.reports[k]
			alloc, pool, node = append(alloc, k.alloc), append(pool, k.node.pool), append(node, k.node.id)
			state, errs, at = append(state, r.state), append(errs, r.err), append(at, r.at)
		}
		b.Queue(sqlReports, alloc, pool, node, state, errs, at)
	}
	if f.clockMoved {
		var resumed *time.Time
		if !f.resumed.IsZero() {
			resumed = &f.resumed
		}
		b.Queue(sqlClock, f.clock, resumed)
	}
	if sw := f.pending; sw != nil {
		var resumed *time.Time
		if !sw.resumed.IsZero() {
			resumed = &sw.resumed
		}
		b.Queue(sqlSweepAt, sw.horizon, resumed, f.cfg.SuspectAfter, f.cfg.UnreachableAfter)
	}
	if b.Len() == 0 {
		return nil
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("fleet: write: %w", err)
	}
	return nil
}

// compareKeys orders nodes as the primary key does (pool, node id; byte
// order, as Go compares strings).
func compareKeys(a, b nodeKey) int {
	return cmp.Or(strings.Compare(a.pool, b.pool), strings.Compare(a.id, b.id))
}

func sortedKeys[K interface{ ~uint32 }, V any](m map[K]V) []K {
	if len(m) == 0 {
		return nil
	}
	keys := make([]K, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}
