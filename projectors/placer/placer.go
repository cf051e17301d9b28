package placer

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/timestamppb"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams/projection"
)

// Placer is the live placer: a projection.Projector of FLEET_RESV that
// records reservations, places them on GPUs and writes its decisions,
// with the bookings they describe, in the same transaction, to the outbox.
// It keeps an index of the fleet and the queue of pending reservations in
// memory (projection.Committer tells it whether its transactions
// committed). It is not safe for concurrent use: the runner calls it from
// one goroutine.
type Placer struct {
	cfg Config
	log *slog.Logger

	idx      *index // nil: load index and queue at the next call
	loadedAt time.Time
	queues   map[string]*queue // pending reservations by pool
	pending  map[string]*entry

	// bindFrom bounds the sweep's look for unbound allocations (placed_at
	// at or after it); zero looks at every live allocation. lastSweep is
	// when the policies last ran. The next* values take effect when the
	// sweep's transaction commits.
	bindFrom, nextBindFrom   time.Time
	lastSweep, nextLastSweep time.Time

	// idle says the last committed transaction was a sweep that found
	// nothing time could change (quiet); nextIdle takes effect when the
	// transaction commits.
	idle, nextIdle bool

	// unbindAsked is when the gateways were last asked to unbind each
	// allocation that is releasing or fences its node (its Released, or
	// its last UnbindAgain), as far as this process knows; it only paces
	// UnbindAgain and is rebuilt from nothing after a restart.
	unbindAsked map[string]time.Time

	// heldChecked is, per node, the held_at (its last Connected) whose
	// lost allocations a committed sweep has released: what the node
	// reported before then is in the projection with it, so that check
	// is final and a node is looked at once per Connected.
	// nextHeldChecked takes effect when the sweep's transaction commits.
	heldChecked, nextHeldChecked map[nodeKey]time.Time
}

var (
	_ projection.Projector = (*Placer)(nil)
	_ projection.Sweeper   = (*Placer)(nil)
	_ projection.Committer = (*Placer)(nil)
	_ projection.Idler     = (*Placer)(nil)
)

// New returns a placer with cfg's defaults applied, or what is wrong with
// cfg.
func New(cfg Config) (*Placer, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	return &Placer{cfg: cfg, log: cfg.Logger.With("consumer", ConsumerName)}, nil
}

// Name is the durable consumer name, "placer".
func (p *Placer) Name() string { return ConsumerName }

// entry is one pending reservation.
type entry struct {
	id          string
	pool        string
	spec        spec
	key         string    // kind and constraints, for the planner's memo
	requestedAt time.Time // queue order: (requestedAt, id)
	since       time.Time // pending since (requested, or last released)
	gen         int       // generation of its next placement
	avoid       map[string]bool
	queued      bool
}

func newEntry(id, pool string, s spec, requestedAt, since time.Time, gen int) *entry {
	kind := "g"
	if s.nodes > 0 {
		kind = "n"
	}
	return &entry{id: id, pool: pool, spec: s, key: kind + s.constraintKey(), requestedAt: requestedAt, since: since, gen: gen}
}

type queue struct {
	items []*entry // by (requestedAt, id); dequeued entries linger until compacted
	dead  int
}

func entryLess(a, b *entry) int {
	return cmp.Or(a.requestedAt.Compare(b.requestedAt), strings.Compare(a.id, b.id))
}

func (p *Placer) enqueue(e *entry) {
	if old := p.pending[e.id]; old != nil {
		p.dequeue(old)
	}
	q := p.queues[e.pool]
	if q == nil {
		q = &queue{}
		p.queues[e.pool] = q
	}
	e.queued = true
	p.pending[e.id] = e
	n := len(q.items)
	if n == 0 || entryLess(q.items[n-1], e) < 0 {
		q.items = append(q.items, e)
		return
	}
	i, _ := slices.BinarySearchFunc(q.items, e, entryLess)
	q.items = slices.Insert(q.items, i, e)
}

func (p *Placer) dequeue(e *entry) {
	if !e.queued {
		return
	}
	e.queued = false
	delete(p.pending, e.id)
	q := p.queues[e.pool]
	q.dead++
	if q.dead > 64 && q.dead > len(q.items)/2 {
		q.items = slices.DeleteFunc(q.items, func(e *entry) bool { return !e.queued })
		q.dead = 0
	}
}

// queued lists the pending reservations: pool by pool, each in request
// order.
func (p *Placer) queued() []*entry {
	pools := slices.Sorted(func(yield func(string) bool) {
		for k := range p.queues {
			if !yield(k) {
				return
			}
		}
	})
	var out []*entry
	for _, name := range pools {
		for _, e := range p.queues[name].items {
			if e.queued {
				out = append(out, e)
			}
		}
	}
	return out
}

// work is what one transaction decided, in the order it was applied.
type work struct {
	now   time.Time
	out   []*fleetpb.PlacementDecision
	fails []failure
	// fences is how many fences the sweep's confirm left standing.
	fences int
}

type failure struct {
	e      *entry
	reason string
}

// Apply records a batch of reservation events and places what is pending
// (and, when the last sweep is SweepOverdue old, does a sweep's work too).
// A message that does not decode is returned as poison before anything is
// written.
func (p *Placer) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	evs, err := decodeBatch(batch)
	if err != nil {
		return err
	}
	w := &work{now: p.cfg.Now().UTC().Truncate(time.Microsecond)}
	if err := p.prepare(ctx, tx, w.now); err != nil {
		return err
	}
	newReqs, cancels, err := record(ctx, tx, evs)
	if err != nil {
		return err
	}
	for _, ev := range newReqs {
		p.enqueue(newEntry(ev.id, ev.pool, ev.spec, ev.at, ev.at, 1))
	}
	if err := p.cancel(ctx, tx, w, cancels); err != nil {
		return err
	}
	overdue := p.cfg.SweepOverdue > 0 && w.now.Sub(p.lastSweep) >= p.cfg.SweepOverdue
	return p.run(ctx, tx, w, overdue)
}

// Sweep acts on the passage of time (see README.md): it releases and
// places again the reservations that hold GPUs on unreachable nodes or
// whose allocations were not bound in time, retries what is pending, and
// fails what waited longer than PendingTimeout.
func (p *Placer) Sweep(ctx context.Context, tx pgx.Tx, now time.Time) error {
	w := &work{now: now.UTC().Truncate(time.Microsecond)}
	if err := p.prepare(ctx, tx, w.now); err != nil {
		return err
	}
	return p.run(ctx, tx, w, true)
}

// run places what is pending and, when sweep is set, applies the policies
// of time first (repairs) and last (pending timeouts).
func (p *Placer) run(ctx context.Context, tx pgx.Tx, w *work, sweep bool) error {
	if sweep {
		rels, err := p.repairs(ctx, tx, w.now)
		if err != nil {
			return err
		}
		if err := p.release(ctx, tx, w, rels); err != nil {
			return err
		}
		if err := p.confirm(ctx, tx, w); err != nil {
			return err
		}
	}
	if err := p.placePending(ctx, tx, w); err != nil {
		return err
	}
	if sweep {
		deadline := w.now.Add(-p.cfg.PendingTimeout)
		for _, e := range p.queued() {
			if !e.since.After(deadline) {
				w.fails = append(w.fails, failure{e, p.idx.noCapacity(e.pool, &e.spec)})
			}
		}
	}
	if err := p.finish(ctx, tx, w); err != nil {
		return err
	}
	if sweep {
		p.nextBindFrom = w.now.Add(-2 * p.cfg.BindTimeout)
		p.nextLastSweep = w.now
	}
	p.nextIdle = sweep && p.quiet(w)
	return nil
}

// quiet says that a sweep that decided nothing (w) left nothing the
// passage of time could change: no reservation pending (a pending
// timeout, capacity that may free), no GPU booked (an allocation live,
// which a repair or bind timeout may release, or releasing, which waits
// for its node's confirmation) and no fence standing. Until a batch is
// applied its sweeps would then find nothing either, so the runner sweeps
// seldom (projection.Idler) rather than every second.
func (p *Placer) quiet(w *work) bool {
	if len(p.pending) > 0 || len(w.out) > 0 || len(w.fails) > 0 || w.fences > 0 || p.idx == nil {
		return false
	}
	for _, n := range p.idx.nodes {
		if len(n.booked) > 0 || n.fences > 0 {
			return false
		}
	}
	return true
}

// Idle implements projection.Idler.
func (p *Placer) Idle() bool { return p.idle }

// Committed keeps what the last transaction taught the index and queue.
func (p *Placer) Committed() {
	p.idle, p.nextIdle = p.nextIdle, false
	if !p.nextBindFrom.IsZero() {
		p.bindFrom, p.lastSweep = p.nextBindFrom, p.nextLastSweep
	}
	for k, at := range p.nextHeldChecked {
		if p.heldChecked == nil {
			p.heldChecked = map[nodeKey]time.Time{}
		}
		p.heldChecked[k] = at
	}
	p.nextHeldChecked = nil
	p.nextBindFrom, p.nextLastSweep = time.Time{}, time.Time{}
}

// Aborted forgets the index and queue; the next call reloads them from the
// database (which another process may have written meanwhile).
func (p *Placer) Aborted() {
	p.idle, p.nextIdle = false, false
	p.idx = nil
	p.queues, p.pending = nil, nil
	p.bindFrom, p.nextBindFrom = time.Time{}, time.Time{}
	p.heldChecked, p.nextHeldChecked = nil, nil
	p.nextLastSweep = time.Time{}
}

// prepare loads the index and the queue, or refreshes the index.
func (p *Placer) prepare(ctx context.Context, tx pgx.Tx, now time.Time) error {
	if p.idx != nil && (p.cfg.ReloadEvery < 0 || now.Sub(p.loadedAt) < p.cfg.ReloadEvery) {
		return p.idx.refresh(ctx, tx)
	}
	reload := p.idx != nil
	idx, err := loadIndex(ctx, tx)
	if err != nil {
		return err
	}
	p.idx, p.loadedAt = idx, now
	if reload {
		return nil // the queue is in step with the tables: only the index is renewed
	}
	return p.loadQueue(ctx, tx)
}

const sqlPending = `select r.id, r.pool, r.gpus, r.nodes, r.model, r.labels::text, r.min_gpu_memory_mib, r.requested_at,
		coalesce(a.gens, 0), greatest(r.requested_at, a.last_release)
	from fleet_reservations r
	left join lateral (select count(distinct decision_id) as gens, max(released_at) as last_release
		from fleet_allocations where reservation_id = r.id) a on true
	where r.cancelled_at is null
	  and not exists (select 1 from fleet_failures f where f.reservation_id = r.id)
	  and not exists (select 1 from fleet_placements p where p.reservation_id = r.id)
	order by r.requested_at, r.id`

// loadQueue rebuilds the pending queue: reservations not cancelled, not
// failed and without a placement.
func (p *Placer) loadQueue(ctx context.Context, tx pgx.Tx) error {
	p.queues, p.pending = map[string]*queue{}, map[string]*entry{}
	rows, err := tx.Query(ctx, sqlPending)
	if err != nil {
		return fmt.Errorf("placer: load pending: %w", err)
	}
	var (
		id, pool, model, labels string
		gpus, nodes             int32
		mem                     int64
		requested, since        time.Time
		gens                    int64
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &pool, &gpus, &nodes, &model, &labels, &mem, &requested, &gens, &since}, func() error {
		s := spec{gpus: int(gpus), nodes: int(nodes), model: model, labels: parseLabels(labels), minMem: uint64(max(mem, 0))}
		p.enqueue(newEntry(id, pool, s, requested.UTC(), since.UTC(), int(gens)+1))
		return nil
	})
	if err != nil {
		return fmt.Errorf("placer: load pending: %w", err)
	}
	return nil
}

// cancel ends the reservations cancelled in this batch: a pending one
// leaves the queue, a placed one is released.
func (p *Placer) cancel(ctx context.Context, tx pgx.Tx, w *work, cancels []*resvEvent) error {
	var rels []release
	for _, ev := range cancels {
		if e := p.pending[ev.id]; e != nil {
			p.dequeue(e)
			w.out = append(w.out, &fleetpb.PlacementDecision{
				DecisionId: ev.id + "/cancel", ReservationId: ev.id, Pool: e.pool, At: timestamppb.New(w.now),
				Body: &fleetpb.PlacementDecision_Released{Released: &fleetpb.Released{Reason: "cancelled"}},
			})
			continue
		}
		rels = append(rels, release{rid: ev.id, reason: "cancelled"})
	}
	return p.release(ctx, tx, w, rels)
}

// release is a reservation whose live allocations are to be freed.
type release struct {
	rid     string
	reason  string
	requeue bool
}

const (
	sqlLiveAllocations = `select a.id, a.reservation_id, a.pool, a.node_id, a.gpu_indices, a.decision_id
		from unnest($1::text[]) as u(id) join fleet_allocations a on a.reservation_id = u.id
		where a.released_at is null order by a.reservation_id, a.id`
	sqlRequeue = `select r.id, r.pool, r.gpus, r.nodes, r.model, r.labels::text, r.min_gpu_memory_mib, r.requested_at
		from unnest($1::text[]) as u(id) join fleet_reservations r on r.id = u.id where r.cancelled_at is null`
)

type liveAlloc struct {
	id, pool, node, decision string
	gpus                     []int32
}

// release frees the live allocations of rels with one Released decision
// per reservation, and queues again those to be placed again.
func (p *Placer) release(ctx context.Context, tx pgx.Tx, w *work, rels []release) error {
	if len(rels) == 0 {
		return nil
	}
	rids := make([]string, len(rels))
	for i, r := range rels {
		rids[i] = r.rid
	}
	rows, err := tx.Query(ctx, sqlLiveAllocations, rids)
	if err != nil {
		return fmt.Errorf("placer: read allocations to release: %w", err)
	}
	live := map[string][]liveAlloc{}
	var a liveAlloc
	var rid string
	if _, err := pgx.ForEachRow(rows, []any{&a.id, &rid, &a.pool, &a.node, &a.gpus, &a.decision}, func() error {
		live[rid] = append(live[rid], a)
		a.gpus = nil
		return nil
	}); err != nil {
		return fmt.Errorf("placer: read allocations to release: %w", err)
	}
	var ds []*fleetpb.PlacementDecision
	var requeue []string
	avoid := map[string]map[string]bool{}
	gens := map[string]int{}
	for _, r := range rels {
		as := live[r.rid]
		if len(as) == 0 {
			continue // nothing held (failed, or released already)
		}
		delete(live, r.rid)
		gen := generation(as[0].decision)
		ids := make([]string, len(as))
		for i, a := range as {
			// The GPUs stay booked (releasing) until the node confirms
			// the unbind or is fenced (confirm): a node that has not
			// carried the release out still runs the workload on them.
			ids[i] = a.id
		}
		ds = append(ds, &fleetpb.PlacementDecision{
			DecisionId: r.rid + "/release/" + strconv.Itoa(gen), ReservationId: r.rid, Pool: as[0].pool, At: timestamppb.New(w.now),
			Body: &fleetpb.PlacementDecision_Released{Released: &fleetpb.Released{AllocationIds: ids, Reason: r.reason, Requeued: r.requeue}},
		})
		if r.requeue {
			requeue = append(requeue, r.rid)
			gens[r.rid] = gen + 1
			avoid[r.rid] = map[string]bool{}
			for _, a := range as {
				avoid[r.rid][a.node] = true
			}
		}
	}
	if _, err := ApplyDecisions(ctx, tx, ds); err != nil {
		return err
	}
	w.out = append(w.out, ds...)
	if len(requeue) == 0 {
		return nil
	}
	rows, err = tx.Query(ctx, sqlRequeue, requeue)
	if err != nil {
		return fmt.Errorf("placer: read reservations to place again: %w", err)
	}
	var (
		id, pool, model, labels string
		gpus, nodes             int32
		mem                     int64
		requested               time.Time
	)
	_, err = pgx.ForEachRow(rows, []any{&id, &pool, &gpus, &nodes, &model, &labels, &mem, &requested}, func() error {
		s := spec{gpus: int(gpus), nodes: int(nodes), model: model, labels: parseLabels(labels), minMem: uint64(max(mem, 0))}
		e := newEntry(id, pool, s, requested.UTC(), w.now, gens[id])
		e.avoid = avoid[id]
		p.enqueue(e)
		return nil
	})
	if err != nil {
		return fmt.Errorf("placer: read reservations to place again: %w", err)
	}
	return nil
}

// generation is the placement number in a Placed decision id
// (<reservation>/place/<n>).
func generation(decisionID string) int {
	if i := strings.LastIndexByte(decisionID, '/'); i >= 0 {
		if n, err := strconv.Atoi(decisionID[i+1:]); err == nil && n > 0 {
			return n
		}
	}
	return 1
}

const (
	// Only the report of the node the allocation is placed on counts: a
	// report is keyed by its reporter, and one from a sibling (another
	// node, or a node of the same id in another pool) is never joined.
	sqlUnboundAllocations = `select a.reservation_id, coalesce(bool_or(r.state = 'failed'), false)
		from fleet_allocations a
		left join fleet_allocation_reports r on r.allocation_id = a.id and r.pool = a.pool and r.node_id = a.node_id
		where a.released_at is null and a.placed_at >= $2
		  and (r.state = 'failed' or (a.placed_at < $1 and (r.state is null or r.state <> 'bound')))
		group by a.reservation_id
		order by a.reservation_id`
	// sqlLostAllocations: live allocations on the nodes named that their
	// own node reported BOUND before its last Connected, which does not
	// list them: the node no longer holds them (it rebooted, or lost them
	// otherwise), and the gateway re-sends binds only within its bind
	// window. A node connected less than BindTimeout ago ($3) is left that
	// long to bind again what the gateway re-sent: a BOUND after the
	// Connected is not lost.
	sqlLostAllocations = `select distinct a.reservation_id
		from unnest($1::text[], $2::text[]) as u(pool, id)
		join fleet_nodes n on n.pool = u.pool and n.node_id = u.id
		join fleet_allocations a on a.pool = n.pool and a.node_id = n.node_id
		join fleet_allocation_reports r on r.allocation_id = a.id and r.pool = a.pool and r.node_id = a.node_id
		where a.released_at is null and n.connected and n.held_at < $3
		  and r.state = 'bound' and r.reported_at < n.held_at
		  and a.id <> all (n.held_allocations)
		order by a.reservation_id`
	sqlOnNodes = `select distinct a.reservation_id from unnest($1::text[], $2::text[]) as u(pool, id)
		join fleet_allocations a on a.pool = u.pool and a.node_id = u.id and a.released_at is null order by a.reservation_id`
)

// repairs lists the reservations to release and place again: those with
// an allocation on an unreachable node, then those with an allocation its
// connected node no longer holds (node_lost), then those with an
// allocation that failed to bind or was not bound within BindTimeout.
func (p *Placer) repairs(ctx context.Context, tx pgx.Tx, now time.Time) ([]release, error) {
	var unreachable []nodeKey
	for k, n := range p.idx.nodes {
		if n.state == "unreachable" && len(n.booked) > 0 {
			unreachable = append(unreachable, k)
		}
	}
	var out []release
	seen := map[string]bool{}
	if len(unreachable) > 0 {
		pools, ids := keyColumns(unreachable)
		rows, err := tx.Query(ctx, sqlOnNodes, pools, ids)
		if err != nil {
			return nil, fmt.Errorf("placer: allocations on unreachable nodes: %w", err)
		}
		rids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, fmt.Errorf("placer: allocations on unreachable nodes: %w", err)
		}
		for _, rid := range rids {
			seen[rid] = true
			out = append(out, release{rid: rid, reason: "node_unreachable", requeue: true})
		}
	}
	lost, err := p.lostAllocations(ctx, tx, now)
	if err != nil {
		return nil, err
	}
	for _, rid := range lost {
		if !seen[rid] {
			seen[rid] = true
			out = append(out, release{rid: rid, reason: "node_lost", requeue: true})
		}
	}
	rows, err := tx.Query(ctx, sqlUnboundAllocations, now.Add(-p.cfg.BindTimeout), p.bindFrom)
	if err != nil {
		return nil, fmt.Errorf("placer: unbound allocations: %w", err)
	}
	var rid string
	var failed bool
	if _, err := pgx.ForEachRow(rows, []any{&rid, &failed}, func() error {
		if !seen[rid] {
			seen[rid] = true
			reason := "bind_timeout"
			if failed {
				reason = "bind_failed"
			}
			out = append(out, release{rid: rid, reason: reason, requeue: true})
		}
		return nil
	}); err != nil {
		return nil, fmt.Errorf("placer: unbound allocations: %w", err)
	}
	return out, nil
}

// lostAllocations lists the reservations with an allocation its connected
// node no longer holds (sqlLostAllocations). Only nodes whose last
// Connected is BindTimeout old and not checked yet (heldChecked) are
// looked at: the reports stored before a Connected are projected with
// it, so one check per Connected is final, and a sweep of a fleet whose
// nodes stay connected reads nothing.
func (p *Placer) lostAllocations(ctx context.Context, tx pgx.Tx, now time.Time) ([]string, error) {
	cutoff := now.Add(-p.cfg.BindTimeout)
	var check []nodeKey
	for k, n := range p.idx.nodes {
		if !n.connected || n.heldAt.IsZero() || !n.heldAt.Before(cutoff) || n.heldAt.Equal(p.heldChecked[k]) {
			continue
		}
		if p.nextHeldChecked == nil {
			p.nextHeldChecked = map[nodeKey]time.Time{}
		}
		p.nextHeldChecked[k] = n.heldAt
		if len(n.booked) > 0 { // no bookings: no live allocation there
			check = append(check, k)
		}
	}
	if len(check) == 0 {
		return nil, nil
	}
	slices.SortFunc(check, compareKeys)
	pools, ids := keyColumns(check)
	rows, err := tx.Query(ctx, sqlLostAllocations, pools, ids, cutoff)
	if err != nil {
		return nil, fmt.Errorf("placer: allocations their nodes lost: %w", err)
	}
	rids, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return nil, fmt.Errorf("placer: allocations their nodes lost: %w", err)
	}
	return rids, nil
}

// placePending plans and commits the pending reservations, in rounds: the
// reservations a guard turned back are planned again against the index as
// the guard corrected it.
func (p *Placer) placePending(ctx context.Context, tx pgx.Tx, w *work) error {
	todo := p.queued()
	for round := 0; round < p.cfg.Rounds && len(todo) > 0; round++ {
		plans, invalid := p.planAll(todo)
		for _, e := range invalid {
			w.fails = append(w.fails, failure{e, "invalid spec: " + e.spec.invalid()})
			p.dequeue(e) // failed below
		}
		if len(plans) == 0 {
			break
		}
		again, err := p.commit(ctx, tx, w, plans)
		if err != nil {
			return err
		}
		todo = again
	}
	return nil
}

const sqlLockReservations = `select r.id from unnest($1::text[]) as u(id) join fleet_reservations r on r.id = u.id
	where r.cancelled_at is null order by r.id for no key update of r`

// finish fails what is to fail and writes the outbox.
func (p *Placer) finish(ctx context.Context, tx pgx.Tx, w *work) error {
	if len(w.fails) > 0 {
		rids := make([]string, len(w.fails))
		for i, f := range w.fails {
			rids[i] = f.e.id
		}
		slices.Sort(rids)
		rows, err := tx.Query(ctx, sqlLockReservations, rids)
		if err != nil {
			return fmt.Errorf("placer: lock reservations to fail: %w", err)
		}
		open, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return fmt.Errorf("placer: lock reservations to fail: %w", err)
		}
		isOpen := make(map[string]bool, len(open))
		for _, id := range open {
			isOpen[id] = true
		}
		var ds []*fleetpb.PlacementDecision
		for _, f := range w.fails {
			p.dequeue(f.e)
			if !isOpen[f.e.id] {
				continue // cancelled meanwhile
			}
			ds = append(ds, &fleetpb.PlacementDecision{
				DecisionId: f.e.id + "/fail", ReservationId: f.e.id, Pool: f.e.pool, At: timestamppb.New(w.now),
				Body: &fleetpb.PlacementDecision_Failed{Failed: &fleetpb.Failed{Reason: f.reason}},
			})
		}
		rejected, err := ApplyDecisions(ctx, tx, ds)
		if err != nil {
			return err
		}
		for i, d := range ds {
			if len(rejected) > 0 && rejected[0] == i {
				rejected = rejected[1:]
				continue // placed or failed by someone else
			}
			w.out = append(w.out, d)
		}
	}
	return writeOutbox(ctx, tx, p.cfg.Subject, w.out)
}
