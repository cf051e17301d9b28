package fleet

import (
	"cmp"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// A batch is folded in memory, one message after the other in stream order,
// over what the database held before it (one read); then the result is
// written with a few statements over unnest() arrays (write.go). Because
// the fold is sequential, the rows do not depend on batch boundaries.
//
// Nodes the batch names only once, in a liveness entry (nearly every node
// of a live batch: a gateway lists a node every flush, a runner batch holds
// a fraction of a flush interval), are not read: their one entry goes to a
// single UPDATE that applies the same rule in SQL (sqlLiveness), so that
// the common batch is one read of the clock row and one write.

// Node states.
const (
	StateHealthy     = "healthy"
	StateSuspect     = "suspect"
	StateUnreachable = "unreachable"
)

// nodeKey is a node's identity: its pool and id, as in its certificate and
// its subject. Two pools may each have a node of the same id; they are two
// nodes.
type nodeKey struct{ pool, id string }

// node is one node as the fold sees it.
type node struct {
	nodeKey
	created bool // a connected event of this batch creates the row

	// Always known (loaded, then folded).
	session, gateway string
	connected        bool
	state            string
	stateSince       time.Time
	firstSeen        time.Time // only for a created row
	lastSeen         time.Time

	// Known only when this batch sets them; nil = keep the stored value.
	labels, agent, statusHash, conditions *string
	// held is the allocation ids of the batch's last Connected of the
	// node (sorted, as JSON text for the write), heldAt its stored time;
	// nil = keep the stored values.
	held   *string
	heldAt time.Time

	full     bool // more than last_seen changed: the whole row is written, with a new rev
	seenMove bool // last_seen moved

	// Devices: replaced by a connected event whose hardware differs from
	// the stored (inventory is its hash, loaded then folded), or health
	// set by index.
	inventory string
	replace   bool
	devices   []device
	health    map[uint32]string // index -> health, when not replaced
}

type device struct {
	index  uint32
	model  string
	memory uint64
	uuid   string
	health string
}

// reportKey is a report's identity: the allocation and the node that
// reported it. Reports are kept per reporting node; only the one from the
// node the allocation was placed on counts (readers join on the
// allocation's pool and node), so a sibling's report changes nothing.
type reportKey struct {
	alloc string
	node  nodeKey
}

type report struct {
	state, err string
	at         time.Time
}

// fold is one batch merged in memory.
type fold struct {
	cfg Config

	nodes    map[nodeKey]*node
	order    []nodeKey       // nodes the batch names, in order of first mention
	mentions map[nodeKey]int // how often; -1 once a node event names it

	// One liveness entry per node named nowhere else (sqlLiveness).
	fast fastCols

	reports map[reportKey]*report // latest report per allocation and reporter
	repIDs  []reportKey
	// placedOn is where the allocations the batch's reports name are
	// placed, as far as fleet_allocations knows (load): a report from
	// another node is counted in stats.ForeignReports.
	placedOn map[string]nodeKey

	// The liveness clock: stored time of the newest liveness batch, and
	// when it last resumed after a silence (fleet_clock).
	clock, resumed time.Time
	hasClock       bool
	clockMoved     bool

	// A sweep of every node that the stream's own clock calls for, run
	// after the fold's writes (sweepAt); split ends the fold after the
	// message that set it, so that it runs before what follows.
	pending *sweepAt
	split   bool

	stats Stats
}

// fastCols are the arguments of sqlLiveness: per entry, the node, when it
// was seen, whether that is fresh (within SuspectAfter of the stored
// time), and the horizon and resumed time of the aging that precedes it
// (NULL: none).
type fastCols struct {
	pool, id         []string
	seen             []time.Time
	fresh            []bool
	horizon, resumed []*time.Time
}

func newFold(cfg Config) *fold {
	return &fold{cfg: cfg, nodes: make(map[nodeKey]*node), mentions: make(map[nodeKey]int),
		reports: make(map[reportKey]*report), placedOn: make(map[string]nodeKey)}
}

// mention registers the node ids an event names, for load.
func (f *fold) mention(e *event) {
	if e.kind == kindLiveness {
		pool := e.live.GetPool()
		for _, a := range e.live.GetNodes() {
			if id := a.GetNodeId(); storableID(id) {
				k := nodeKey{pool, id}
				if f.mentions[k] == 0 {
					f.order = append(f.order, k)
				}
				if f.mentions[k] >= 0 {
					f.mentions[k]++
				}
			}
		}
		return
	}
	k := nodeKey{e.node.GetPool(), e.node.GetNodeId()}
	if _, ok := f.mentions[k]; !ok {
		f.order = append(f.order, k)
	}
	f.mentions[k] = -1
	if e.kind == kindAllocation {
		f.placedOn[e.node.GetAllocation().GetAllocationId()] = nodeKey{}
	}
}

// simple reports whether a node goes to sqlLiveness rather than the fold.
func (f *fold) simple(k nodeKey) bool { return f.mentions[k] == 1 }

const sqlLoadNodes = `
select n.pool, n.node_id, n.session_id, n.gateway_id, n.connected, n.state, n.state_since, n.last_seen, n.inventory_hash
from unnest($1::text[], $2::text[]) as u(pool, node_id)
join fleet_nodes n on n.pool = u.pool and n.node_id = u.node_id`

// sqlPlacedOn finds where reported allocations are placed. It reads a
// table of another stream (FLEET_PLACE) only to count foreign reports:
// what is stored does not depend on it, so a replay in any order yields
// the same rows.
const sqlPlacedOn = `
select a.id, a.pool, a.node_id from unnest($1::text[]) as u(id) join fleet_allocations a on a.id = u.id`

const sqlLoadClock = `select liveness_time, resumed_at from fleet_clock`

// load reads, in one round trip, the clock and the stored state of every
// node the batch names, but for those left to sqlLiveness.
func (f *fold) load(ctx context.Context, tx pgx.Tx) error {
	b := &pgx.Batch{}
	b.Queue(sqlLoadClock).QueryRow(func(row pgx.Row) error {
		var resumed *time.Time
		err := row.Scan(&f.clock, &resumed)
		switch {
		case errors.Is(err, pgx.ErrNoRows):
			return nil
		case err != nil:
			return err
		}
		f.hasClock = true
		f.clock = f.clock.UTC()
		if resumed != nil {
			f.resumed = resumed.UTC()
		}
		return nil
	})
	var loadPool, loadID []string
	for _, k := range f.order {
		if !f.simple(k) {
			loadPool, loadID = append(loadPool, k.pool), append(loadID, k.id)
		}
	}
	if len(loadID) > 0 {
		b.Queue(sqlLoadNodes, loadPool, loadID).Query(func(rows pgx.Rows) error {
			var n node
			_, err := pgx.ForEachRow(rows, []any{&n.pool, &n.id, &n.session, &n.gateway, &n.connected, &n.state,
				&n.stateSince, &n.lastSeen, &n.inventory}, func() error {
				c := n
				c.stateSince, c.lastSeen = c.stateSince.UTC(), c.lastSeen.UTC()
				f.nodes[c.nodeKey] = &c
				return nil
			})
			return err
		})
	}
	if len(f.placedOn) > 0 {
		allocs := make([]string, 0, len(f.placedOn))
		for id := range f.placedOn {
			allocs = append(allocs, id)
		}
		b.Queue(sqlPlacedOn, allocs).Query(func(rows pgx.Rows) error {
			var id string
			var k nodeKey
			_, err := pgx.ForEachRow(rows, []any{&id, &k.pool, &k.id}, func() error {
				f.placedOn[id] = k
				return nil
			})
			return err
		})
	}
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("fleet: load: %w", err)
	}
	return nil
}

// apply folds one event into the batch.
func (f *fold) apply(e *event) {
	switch e.kind {
	case kindLiveness:
		f.liveness(e)
	case kindConnected:
		f.connected(e)
	case kindDisconnected:
		n := f.nodes[nodeKey{e.node.Pool, e.node.NodeId}]
		if n == nil || e.node.SessionId != n.session {
			f.stats.IgnoredEvents++
			return
		}
		if !n.connected && n.gateway == "" {
			return // a redelivery, or a second disconnect of the session
		}
		n.connected, n.gateway = false, ""
		n.full = true
		// The state stays: whether the node is gone is the sweep's to say,
		// after the grace period, since it may be re-homing.
	case kindStatus:
		n := f.nodes[nodeKey{e.node.Pool, e.node.NodeId}]
		if n == nil || e.node.SessionId != n.session {
			f.stats.IgnoredEvents++
			return
		}
		sc := e.node.GetStatusChanged()
		n.statusHash = ptr(clean(sc.GetStatusHash()))
		n.conditions = ptr(conditionsJSON(sc.GetConditions()))
		for _, g := range sc.GetGpus() {
			h := gpuHealth(g.GetHealth())
			if n.replace {
				if i := slices.IndexFunc(n.devices, func(d device) bool { return d.index == g.GetIndex() }); i >= 0 {
					n.devices[i].health = h
				}
				continue
			}
			if n.health == nil {
				n.health = make(map[uint32]string)
			}
			n.health[g.GetIndex()] = h
		}
		n.full = true
	case kindAllocation:
		a := e.node.GetAllocation()
		from := nodeKey{e.node.Pool, e.node.NodeId}
		if on := f.placedOn[a.AllocationId]; on != (nodeKey{}) && on != from {
			// Stored under its reporter, where no reader looks for it.
			f.stats.ForeignReports++
		}
		rk := reportKey{alloc: a.AllocationId, node: from}
		r, ok := f.reports[rk]
		if !ok {
			r = &report{}
			f.reports[rk] = r
			f.repIDs = append(f.repIDs, rk)
		}
		*r = report{state: allocationState(a.State), err: clean(a.Error), at: e.at}
	}
}

// connected: the node holds a new session (or the gateway republished the
// live one). It is alive at the event's stored time, whatever the sweep had
// concluded: it counts as a liveness entry of age 0. (Unless the node was
// heard since: then the event is no news of its liveness, only of its
// session and inventory.)
func (f *fold) connected(e *event) {
	ev, c := e.node, e.node.GetConnected()
	k := nodeKey{ev.Pool, ev.NodeId}
	n := f.nodes[k]
	if n == nil {
		n = &node{nodeKey: k, created: true, state: StateHealthy, stateSince: e.at, firstSeen: e.at, lastSeen: e.at}
		f.nodes[k] = n
	}
	if e.at.After(n.lastSeen) {
		f.age(n, e.at)
		n.lastSeen, n.seenMove = e.at, true
		if n.state != StateHealthy {
			n.state, n.stateSince = StateHealthy, e.at
		}
	}
	n.session, n.gateway, n.connected = ev.SessionId, ev.GatewayId, true
	n.labels = ptr(labelsJSON(c.GetLabels()))
	n.agent = ptr(clean(c.GetAgentVersion()))
	// What the node holds as of this event (its Hello, or the gateway's
	// republish of the session's held set): the placer re-places what it
	// had bound before and no longer holds.
	n.held, n.heldAt = ptr(heldJSON(c.GetAllocations())), e.at
	devs := make([]device, 0, len(c.GetGpus()))
	for _, g := range c.GetGpus() {
		devs = append(devs, device{index: g.GetIndex(), model: clean(g.GetModel()),
			memory: g.GetMemoryMib(), uuid: clean(g.GetUuid()), health: gpuHealth(g.GetHealth())})
	}
	slices.SortFunc(devs, func(a, b device) int { return cmp.Compare(a.index, b.index) })
	h := inventoryHash(devs)
	if n.created || n.replace || h != n.inventory {
		n.replace, n.health, n.devices = true, nil, devs
	} else {
		// The same GPUs as stored (a re-home): only their health is news.
		n.health = make(map[uint32]string, len(devs))
		for _, d := range devs {
			n.health[d.index] = d.health
		}
	}
	n.inventory = h
	n.full = true
}

// inventoryHash identifies a node's hardware: its devices (sorted by
// index) without their health, which changes on its own.
func inventoryHash(devs []device) string {
	h := sha256.New()
	for _, d := range devs {
		fmt.Fprintf(h, "%d\x00%s\x00%d\x00%s\x00", d.index, d.model, d.memory, d.uuid)
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// liveness: last_seen = greatest(last_seen, stored time - age) for each
// listed node the projection knows; a fresh entry brings a suspect or
// unreachable node back to healthy. Then the clock moves.
func (f *fold) liveness(e *event) {
	fresh := e.at.Add(-f.cfg.SuspectAfter)
	var h, r *time.Time // sqlLiveness's horizon and resumed, as of this message
	if f.hasClock {
		h = ptr(f.horizon(e.at))
	}
	if !f.resumed.IsZero() {
		r = ptr(f.resumed)
	}
	pool := e.live.GetPool()
	for _, a := range e.live.GetNodes() {
		f.stats.Liveness++
		k := nodeKey{pool, a.GetNodeId()}
		seen := e.at.Add(-time.Duration(a.GetAgeMs()) * time.Millisecond)
		if storableID(k.id) && f.simple(k) {
			f.fast.pool = append(f.fast.pool, k.pool)
			f.fast.id = append(f.fast.id, k.id)
			f.fast.seen = append(f.fast.seen, seen)
			f.fast.fresh = append(f.fast.fresh, !seen.Before(fresh))
			f.fast.horizon = append(f.fast.horizon, h)
			f.fast.resumed = append(f.fast.resumed, r)
			continue // sqlLiveness counts it if it changes nothing
		}
		var n *node
		if storableID(k.id) {
			n = f.nodes[k]
		}
		if n == nil || !seen.After(n.lastSeen) {
			// An unknown node: its connected event precedes it in the
			// stream, except after retention cut it off, and it appears
			// with its next one. Or not news: a redelivery, two gateways.
			f.stats.IgnoredLiveness++
			continue
		}
		f.age(n, e.at)
		n.lastSeen, n.seenMove = seen, true
		if n.state != StateHealthy && !seen.Before(fresh) {
			n.state, n.stateSince = StateHealthy, seen
			n.full = true
		}
	}
	f.clockMoved = true
	if f.hasClock && !e.at.After(f.clock) {
		return
	}
	prev, had := f.clock, f.hasClock
	f.clock, f.hasClock = e.at, true
	switch {
	case had && e.at.Sub(prev) > f.cfg.ClockSlack:
		// The stream was silent for longer than the slack: sweeps in the
		// silence may have aged nodes up to prev + ClockSlack, under the
		// old resumed time; from now on nodes age from no earlier than
		// this batch. That sweep runs before anything after this message.
		f.pending = &sweepAt{horizon: prev.Add(f.cfg.ClockSlack), resumed: f.resumed}
		f.split = true
		f.resumed = e.at
	case !had:
		f.resumed = e.at
	case e.at.Truncate(f.cfg.SweepTick).After(prev.Truncate(f.cfg.SweepTick)):
		// The clock crossed a tick: age every node to it. The runner
		// sweeps only when the stream is idle, which a busy fleet's never
		// is; this sweep keeps time with the stream instead.
		f.pending = &sweepAt{horizon: e.at.Truncate(f.cfg.SweepTick), resumed: f.resumed}
	}
}

// sweepAt is a sweep of every node to a horizon, with nodes aging from no
// earlier than resumed (zero: no resume yet).
type sweepAt struct{ horizon, resumed time.Time }

// run folds events in order until the end or a split, and returns how many
// it folded.
func (f *fold) run(evs []event) int {
	for i := range evs {
		f.apply(&evs[i])
		if f.split {
			return i + 1
		}
	}
	return len(evs)
}

// age applies to one node, just before news of it at stored time at, what
// a sweep could have done to it since it was last heard: the latest such
// sweep had the horizon min(at, clock + ClockSlack). Sweeps compose (one
// at a later horizon does what an earlier one did and more), so whether the
// runner happened to sweep in between or not, the node ends up the same;
// that is what makes a replay, which sweeps only at its end, yield the
// rows of the live run.
func (f *fold) age(n *node, at time.Time) {
	if !f.hasClock {
		return
	}
	if state, since, ok := f.cfg.aged(n.state, n.lastSeen, f.resumed, f.horizon(at)); ok {
		n.state, n.stateSince = state, since
		n.full = true
	}
}

// horizon is the latest horizon a sweep could have had before news stored
// at time at: min(at, clock + ClockSlack).
func (f *fold) horizon(at time.Time) time.Time {
	if h := f.clock.Add(f.cfg.ClockSlack); h.Before(at) {
		return h
	}
	return at
}

// aged is the sweep's rule for one node (agedSQL is the same in SQL): it
// ages from base = max(last seen, resumed); past UnreachableAfter it is
// unreachable, else past SuspectAfter a healthy node is suspect. The state
// starts at base plus the threshold crossed, not at the sweep's time.
func (c Config) aged(state string, lastSeen, resumed, horizon time.Time) (string, time.Time, bool) {
	if state == StateUnreachable {
		return "", time.Time{}, false
	}
	base := lastSeen
	if resumed.After(base) {
		base = resumed
	}
	switch {
	case base.Before(horizon.Add(-c.UnreachableAfter)):
		return StateUnreachable, base.Add(c.UnreachableAfter), true
	case state == StateHealthy && base.Before(horizon.Add(-c.SuspectAfter)):
		return StateSuspect, base.Add(c.SuspectAfter), true
	}
	return "", time.Time{}, false
}

func ptr[T any](v T) *T { return &v }

// labelsJSON renders labels as a JSON object (keys sorted, so the jsonb
// text is canonical either way).
func labelsJSON(labels map[string]string) string {
	m := make(map[string]string, len(labels))
	for k, v := range labels {
		m[clean(k)] = clean(v)
	}
	b, _ := json.Marshal(m) // a map of strings always marshals
	return string(b)
}

// heldJSON renders allocation ids as a sorted JSON array without
// duplicates (the write turns it into the text[] column).
func heldJSON(ids []string) string {
	out := make([]string, 0, len(ids))
	for _, id := range ids {
		out = append(out, clean(id))
	}
	slices.Sort(out)
	b, _ := json.Marshal(slices.Compact(out))
	return string(b)
}

// Condition is one of a node's conditions, as its last status reported it.
type Condition struct {
	Type   string `json:"type"`
	Status bool   `json:"status"`
	Reason string `json:"reason"`
}

// conditionsJSON renders conditions as a JSON array, in the node's order.
func conditionsJSON(cs []*fleetpb.Condition) string {
	out := make([]Condition, 0, len(cs))
	for _, c := range cs {
		out = append(out, Condition{Type: clean(c.GetType()), Status: c.GetStatus(), Reason: clean(c.GetReason())})
	}
	b, _ := json.Marshal(out)
	return string(b)
}
