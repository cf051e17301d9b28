package placer

import (
	"context"
	"crypto/rand"
	"encoding/hex"
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
	nodeSet := map[nodeKey]bool{}
	for _, pl := range plans {
		rids = append(rids, pl.e.id)
		for _, a := range pl.allocs {
			nodeSet[a.n.key()] = true
		}
	}
	slices.Sort(rids)
	nodeKeys := make([]nodeKey, 0, len(nodeSet))
	for k := range nodeSet {
		nodeKeys = append(nodeKeys, k)
	}
	slices.SortFunc(nodeKeys, compareKeys)
	open, taken := map[string]bool{}, map[string]bool{}
	locked := map[nodeKey]nodeRow{}
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
	lockPools, lockIDs := keyColumns(nodeKeys)
	b.Queue(sqlLockNodes, lockPools, lockIDs).Query(func(rows pgx.Rows) error {
		var r nodeRow
		_, err := pgx.ForEachRow(rows, []any{&r.id, &r.pool, &r.labels, &r.connected, &r.state, &r.rev, &r.heldAt}, func() error {
			locked[r.key()] = r
			r.heldAt = nil // scanned into afresh: rows must not share it
			return nil
		})
		return err
	})
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return nil, fmt.Errorf("placer: lock for commit: %w", err)
	}

	// Nodes that changed under the planner.
	stale := map[nodeKey]bool{}
	for _, k := range nodeKeys {
		r, ok := locked[k]
		n := p.idx.nodes[k]
		if !ok || r.state != "healthy" || !r.connected || r.rev != n.rev {
			stale[k] = true
		}
	}
	keep := plans[:0:0]
	for _, pl := range plans {
		drop := !open[pl.e.id] || taken[pl.e.id]
		bad := false
		for _, a := range pl.allocs {
			bad = bad || stale[a.n.key()]
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
			allocs[j] = &fleetpb.Allocation{Id: allocationID(prefix, j), NodeId: a.n.id, GpuIndices: gpus,
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
	var rnodes []nodeKey
	var rrids []string
	seen := map[nodeKey]bool{}
	for _, i := range rejected {
		rrids = append(rrids, keep[i].e.id)
		for _, a := range keep[i].allocs {
			if k := a.n.key(); !seen[k] {
				seen[k] = true
				rnodes = append(rnodes, k)
			}
		}
	}
	var booked map[nodeKey][]int32
	placed := map[string]bool{}
	b = &pgx.Batch{}
	bPools, bIDs := keyColumns(rnodes)
	b.Queue(sqlNodeBookings, bPools, bIDs).Query(func(rows pgx.Rows) error {
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
	for _, k := range rnodes {
		p.idx.setBooked(p.idx.nodes[k], booked[k])
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
func (p *Placer) renewNodes(ctx context.Context, tx pgx.Tx, keys map[nodeKey]bool, locked map[nodeKey]nodeRow) error {
	var present []nodeKey
	for k := range keys {
		if _, ok := locked[k]; ok {
			present = append(present, k)
		} else {
			p.idx.forget(p.idx.nodes[k])
		}
	}
	if len(present) == 0 {
		return nil
	}
	pools, ids := keyColumns(present)
	rows, err := tx.Query(ctx, sqlNodeDevices, pools, ids)
	if err != nil {
		return fmt.Errorf("placer: re-read devices: %w", err)
	}
	devs, err := scanDevices(rows)
	if err != nil {
		return fmt.Errorf("placer: re-read devices: %w", err)
	}
	for _, k := range present {
		p.idx.upsert(locked[k], devs[k], true)
	}
	return nil
}

// forget drops a node that has no fleet_nodes row; one with bookings stays
// in its pool as an unplaceable node, as a fresh load would have it.
func (x *index) forget(n *node) {
	pi := x.pool(n.pool)
	pi.removeNode(n)
	if len(n.booked) == 0 && n.fences == 0 {
		delete(x.nodes, n.key())
		return
	}
	n.labels, n.state, n.connected, n.rev, n.gpus = nil, "unknown", false, 0, nil
	n.recount()
	pi.addNode(n)
}

// allocationID is a new allocation's id: "<reservation>/<generation>/<n>."
// followed by 128 random bits in hex. The prefix says, in logs and on the
// console, which reservation and placement the allocation belongs to; the
// random part makes an allocation id impossible to guess from a sibling's
// (sequential ids let a node name allocations placed on other nodes).
// Clients must treat the id as opaque.
func allocationID(prefix string, n int) string {
	var b [16]byte
	rand.Read(b[:]) // crypto/rand never fails (Go 1.24)
	return prefix + strconv.Itoa(n) + "." + hex.EncodeToString(b[:])
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
