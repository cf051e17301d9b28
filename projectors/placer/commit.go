package placer

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strconv"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Lookups by a list of keys join unnest($1) rather than filter with
// = any($1): a table PostgreSQL has not analyzed yet (a burst of new rows
// before autovacuum) is otherwise scanned whole with every row compared to
// every key.
const sqlTaken = `select f.reservation_id from unnest($1::text[]) as u(id) join fleet_failures f on f.reservation_id = u.id
	union select p.reservation_id from unnest($1::text[]) as u(id) join fleet_placements p on p.reservation_id = u.id`

// commit writes a round of plans under the guards, Nomad's plan-apply
// way: the planner was optimistic, the commit re-checks serially.
//
//  1. The reservations are locked (FOR NO KEY UPDATE, which a cancellation
//     or another placer also needs) and must still be open: not cancelled,
//     failed or placed. Those that are not leave the queue.
//  2. The chosen nodes are locked FOR SHARE, so that no node can turn
//     unhealthy (or change its GPUs) between this check and the commit;
//     a plan on a node that is no longer healthy and connected, or whose
//     rev moved since the index read it, goes back to be planned again,
//     and the index takes the node as the locked row and its devices say.
//  3. The rest is written by ApplyDecisions: every placement, booking and
//     allocation is an INSERT ... ON CONFLICT DO NOTHING, so a GPU booked
//     by someone the index did not know of, or a reservation placed by
//     another placer, rejects the plan; its inserted rows are deleted
//     again (partial commit), the index re-reads the bookings of the
//     nodes involved, and the reservation is planned again unless it was
//     placed meanwhile.
//
// It returns the reservations to plan again.
func (p *Placer) commit(ctx context.Context, tx pgx.Tx, w *work, plans []*plan) (again []*entry, err error) {
	rids := make([]string, 0, len(plans))
	nodeSet := map[string]bool{}
	for _, pl := range plans {
		rids = append(rids, pl.e.id)
		for _, a := range pl.allocs {
			nodeSet[a.n.id] = true
		}
	}
	slices.Sort(rids)
	nodeIDs := slices.Sorted(func(yield func(string) bool) {
		for id := range nodeSet {
			if !yield(id) {
				return
			}
		}
	})
	open, taken := map[string]bool{}, map[string]bool{}
	locked := map[string]nodeRow{}
	b := &pgx.Batch{}
	b.Queue(sqlLockReservations, rids).Query(func(rows pgx.Rows) error {
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, id := range ids {
			open[id] = true
		}
		return err
	})
	b.Queue(sqlTaken, rids).Query(func(rows pgx.Rows) error {
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, id := range ids {
			taken[id] = true
		}
		return err
	})
	b.Queue(sqlLockNodes, nodeIDs).Query(func(rows pgx.Rows) error {
		var r nodeRow
		_, err := pgx.ForEachRow(rows, []any{&r.id, &r.pool, &r.labels, &r.connected, &r.state, &r.rev}, func() error {
			locked[r.id] = r
			return nil
		})
		return err
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("placer: lock for commit: %w", err)
	}

	// Nodes that changed under the planner.
	stale := map[string]bool{}
	for _, id := range nodeIDs {
		r, ok := locked[id]
		n := p.idx.nodes[id]
		if !ok || r.state != "healthy" || !r.connected || r.rev != n.rev {
			stale[id] = true
		}
	}
	keep := plans[:0:0]
	for _, pl := range plans {
		drop := !open[pl.e.id] || taken[pl.e.id]
		bad := false
		for _, a := range pl.allocs {
			bad = bad || stale[a.n.id]
		}
		if drop || bad {
			for _, a := range pl.allocs {
				p.idx.unbook(a.n, a.gpus)
			}
		}
		switch {
		case drop:
			p.dequeue(pl.e)
		case bad:
			again = append(again, pl.e)
		default:
			keep = append(keep, pl)
		}
	}
	if len(stale) > 0 {
		if err := p.renewNodes(ctx, tx, stale, locked); err != nil {
			return nil, err
		}
	}
	if len(keep) == 0 {
		return again, nil
	}

	ds := make([]*fleetpb.PlacementDecision, len(keep))
	at := timestamppb.New(w.now)
	for i, pl := range keep {
		e := pl.e
		prefix := e.id + "/" + strconv.Itoa(e.gen) + "/"
		allocs := make([]*fleetpb.Allocation, len(pl.allocs))
		for j, a := range pl.allocs {
			gpus := make([]uint32, len(a.gpus))
			for k, g := range a.gpus {
				gpus[k] = uint32(g)
			}
			allocs[j] = &fleetpb.Allocation{Id: prefix + strconv.Itoa(j), NodeId: a.n.id, GpuIndices: gpus,
				WholeNode: a.whole, State: fleetpb.AllocationState_ALLOCATION_STATE_PENDING}
		}
		ds[i] = &fleetpb.PlacementDecision{
			DecisionId: e.id + "/place/" + strconv.Itoa(e.gen), ReservationId: e.id, Pool: e.pool, At: at,
			Body: &fleetpb.PlacementDecision_Placed{Placed: &fleetpb.Placed{Allocations: allocs}},
		}
	}
	rejected, err := ApplyDecisions(ctx, tx, ds)
	if err != nil {
		return nil, err
	}
	isRejected := make([]bool, len(keep))
	for _, i := range rejected {
		isRejected[i] = true
	}
	for i, pl := range keep {
		if !isRejected[i] {
			p.dequeue(pl.e)
			w.out = append(w.out, ds[i])
		}
	}
	if len(rejected) == 0 {
		return again, nil
	}

	// Someone the index did not know of holds some of these GPUs or
	// placed some of these reservations: learn what the tables hold.
	p.log.Info("plans rejected by the commit guards; planning them again", "rejected", len(rejected), "plans", len(keep))
	var rnodes, rrids []string
	seen := map[string]bool{}
	for _, i := range rejected {
		rrids = append(rrids, keep[i].e.id)
		for _, a := range keep[i].allocs {
			if !seen[a.n.id] {
				seen[a.n.id] = true
				rnodes = append(rnodes, a.n.id)
			}
		}
	}
	var booked map[string][]int32
	placed := map[string]bool{}
	b = &pgx.Batch{}
	b.Queue(sqlNodeBookings, rnodes).Query(func(rows pgx.Rows) error {
		var err error
		booked, err = scanBookings(rows)
		return err
	})
	b.Queue("select p.reservation_id from unnest($1::text[]) as u(id) join fleet_placements p on p.reservation_id = u.id", rrids).Query(func(rows pgx.Rows) error {
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		for _, id := range ids {
			placed[id] = true
		}
		return err
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("placer: re-read bookings: %w", err)
	}
	for _, id := range rnodes {
		p.idx.setBooked(p.idx.nodes[id], booked[id])
	}
	for _, i := range rejected {
		if placed[keep[i].e.id] {
			p.dequeue(keep[i].e)
		} else {
			again = append(again, keep[i].e)
		}
	}
	return again, nil
}

// renewNodes sets the index's picture of nodes from their locked rows and
// their devices; a node without a row is forgotten.
func (p *Placer) renewNodes(ctx context.Context, tx pgx.Tx, ids map[string]bool, locked map[string]nodeRow) error {
	var present []string
	for id := range ids {
		if _, ok := locked[id]; ok {
			present = append(present, id)
		} else {
			p.idx.forget(p.idx.nodes[id])
		}
	}
	if len(present) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, sqlNodeDevices, present)
	if err != nil {
		return fmt.Errorf("placer: re-read devices: %w", err)
	}
	devs, err := scanDevices(rows)
	if err != nil {
		return fmt.Errorf("placer: re-read devices: %w", err)
	}
	for _, id := range present {
		p.idx.upsert(locked[id], devs[id], true)
	}
	return nil
}

// forget drops a node that has no fleet_nodes row; one with bookings stays
// as an unplaceable node of no pool, as a fresh load would have it.
func (x *index) forget(n *node) {
	x.pool(n.pool).removeNode(n)
	if len(n.booked) == 0 {
		delete(x.nodes, n.id)
		return
	}
	n.pool, n.labels, n.state, n.connected, n.rev, n.gpus = "", nil, "unknown", false, 0, nil
	n.recount()
	x.pool("").addNode(n)
}

const (
	sqlOutbox = `insert into outbox (subject, msg_id, headers, body)
		select u.s, u.m, u.h::jsonb, u.b from unnest($1::text[], $2::text[], $3::text[], $4::bytea[]) with ordinality as u(s, m, h, b, o)
		order by u.o`
	sqlNotify = `select pg_notify($1, '')`
)

// writeOutbox queues the decisions for the relay, in the order they were
// applied, and notifies it when the transaction commits.
func writeOutbox(ctx context.Context, tx pgx.Tx, subject func(string) string, ds []*fleetpb.PlacementDecision) error {
	if len(ds) == 0 {
		return nil
	}
	subjects, ids, headers := make([]string, len(ds)), make([]string, len(ds)), make([]string, len(ds))
	bodies := make([][]byte, len(ds))
	opts := proto.MarshalOptions{Deterministic: true}
	for i, d := range ds {
		body, err := opts.Marshal(d)
		if err != nil {
			return fmt.Errorf("placer: encode decision %s: %w", d.GetDecisionId(), err)
		}
		h, err := json.Marshal(map[string]string{
			envelope.Schema:      envelope.SchemaFleetV1,
			envelope.Kind:        envelope.KindDecision,
			envelope.Pool:        d.GetPool(),
			envelope.Reservation: d.GetReservationId(),
		})
		if err != nil {
			return err
		}
		subjects[i], ids[i], headers[i], bodies[i] = subject(d.GetPool()), d.GetDecisionId(), string(h), body
	}
	b := &pgx.Batch{}
	b.Queue(sqlOutbox, subjects, ids, headers, bodies)
	b.Queue(sqlNotify, NotifyChannel)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("placer: write outbox: %w", err)
	}
	return nil
}
