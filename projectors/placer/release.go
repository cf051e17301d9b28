package placer

import (
	"cmp"
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/types/known/timestamppb"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// A release is done when the node has carried it out. Released ends an
// allocation but leaves its bookings: the allocation is "releasing" and
// its GPUs are not bookable, since the node may still run its workload on
// them. confirm, at every sweep, frees them (a Freed decision) once the
// node the allocation was placed on has reported UNBOUND or FAILED for it
// (fleet_allocation_reports, from FLEET_NODES), or once that node is
// unreachable: then the allocation fences its node (fleet_fences), which
// takes nothing new until it has confirmed the unbind (Unfenced). Releasing
// and fencing allocations on connected nodes are asked again (UnbindAgain)
// every UnbindRetry, so that a node that reconnected, a gateway that
// restarted, or an Unbind lost on the way do not leave them waiting.
//
// Every change of rows is a decision on FLEET_PLACE, so a replay of the
// stream yields the live run's rows whatever the clock did.

const (
	// Releasing allocations whose own node (pool and node) confirmed, or
	// whose node is unreachable or unknown. A FAILED report means the node
	// never held the allocation.
	sqlReleasing = `select a.id, a.reservation_id, a.pool, a.node_id, a.gpu_indices,
			coalesce(r.state in ('unbound', 'failed'), false),
			coalesce(n.state = 'unreachable', true),
			coalesce(n.connected, false)
		from fleet_allocations a
		left join fleet_allocation_reports r on r.allocation_id = a.id and r.pool = a.pool and r.node_id = a.node_id
		left join fleet_nodes n on n.pool = a.pool and n.node_id = a.node_id
		where a.released_at is not null and a.freed_at is null
		order by a.pool, a.node_id, a.id`
	// Fences of nodes that have confirmed the unbind since.
	sqlFences = `select f.pool, f.node_id, f.allocation_id, a.reservation_id,
			coalesce(r.state in ('unbound', 'failed'), false),
			coalesce(n.connected and n.state <> 'unreachable', false)
		from fleet_fences f
		left join fleet_allocations a on a.id = f.allocation_id
		left join fleet_allocation_reports r on r.allocation_id = f.allocation_id and r.pool = f.pool and r.node_id = f.node_id
		left join fleet_nodes n on n.pool = f.pool and n.node_id = f.node_id
		order by f.pool, f.node_id, f.allocation_id`
)

// confirm frees the releasing allocations whose node confirmed the
// unbind or is unreachable, lifts the fences of nodes that confirmed, and
// asks again for unbinds that wait.
func (p *Placer) confirm(ctx context.Context, tx pgx.Tx, w *work) error {
	type waiting struct {
		id, rid string
		node    nodeKey
	}
	var (
		frees   []*fleetpb.PlacementDecision
		again   []waiting
		stillAt = map[string]bool{}
	)
	rows, err := tx.Query(ctx, sqlReleasing)
	if err != nil {
		return fmt.Errorf("placer: releasing allocations: %w", err)
	}
	var (
		a                               liveAlloc
		rid                             string
		confirmed, unreachable, connect bool
	)
	type freed struct {
		a      liveAlloc
		fenced bool
	}
	var done []freed
	if _, err := pgx.ForEachRow(rows, []any{&a.id, &rid, &a.pool, &a.node, &a.gpus, &confirmed, &unreachable, &connect}, func() error {
		switch {
		case confirmed:
			frees = append(frees, freedDecision(rid, a, "unbound", false, w.now))
			done = append(done, freed{a, false})
		case unreachable:
			frees = append(frees, freedDecision(rid, a, "node_unreachable", true, w.now))
			done = append(done, freed{a, true})
		default:
			stillAt[a.id] = true
			if connect {
				again = append(again, waiting{a.id, rid, nodeKey{a.pool, a.node}})
			}
		}
		a.gpus = nil
		return nil
	}); err != nil {
		return fmt.Errorf("placer: releasing allocations: %w", err)
	}

	var unfence []*fleetpb.PlacementDecision
	var lifted []nodeKey
	rows, err = tx.Query(ctx, sqlFences)
	if err != nil {
		return fmt.Errorf("placer: fences: %w", err)
	}
	var (
		k         nodeKey
		id        string
		frid      *string
		unbound   bool
		reachable bool
	)
	if _, err := pgx.ForEachRow(rows, []any{&k.pool, &k.id, &id, &frid, &unbound, &reachable}, func() error {
		r := ""
		if frid != nil {
			r = *frid
		}
		switch {
		case unbound:
			unfence = append(unfence, &fleetpb.PlacementDecision{
				DecisionId: id + "/unfenced", ReservationId: r, Pool: k.pool, At: timestamppb.New(w.now),
				Body: &fleetpb.PlacementDecision_Unfenced{Unfenced: &fleetpb.Unfenced{NodeId: k.id, AllocationIds: []string{id}}},
			})
			lifted = append(lifted, k)
		default:
			stillAt[id] = true
			w.fences++
			if reachable {
				again = append(again, waiting{id, r, k})
			}
		}
		return nil
	}); err != nil {
		return fmt.Errorf("placer: fences: %w", err)
	}

	ds := append(frees, unfence...)
	if len(ds) > 0 {
		if _, err := ApplyDecisions(ctx, tx, ds); err != nil {
			return err
		}
	}
	for _, f := range done {
		n := p.idx.nodeOf(nodeKey{f.a.pool, f.a.node})
		p.idx.unbook(n, f.a.gpus)
		if f.fenced {
			p.idx.fence(n, 1)
		}
	}
	for _, k := range lifted {
		if n := p.idx.nodes[k]; n != nil {
			p.idx.fence(n, -1)
		}
	}
	w.out = append(w.out, ds...)

	// Ask again, one decision per reservation and pool, for unbinds
	// asked longer than UnbindRetry ago. A first sight starts the clock:
	// the Released itself was the first ask.
	if p.unbindAsked == nil {
		p.unbindAsked = map[string]time.Time{}
	}
	for id := range p.unbindAsked {
		if !stillAt[id] {
			delete(p.unbindAsked, id)
		}
	}
	type group struct {
		rid, pool string
	}
	byGroup := map[group][]*fleetpb.Allocation{}
	var order []group
	for _, x := range again {
		at, ok := p.unbindAsked[x.id]
		if !ok {
			p.unbindAsked[x.id] = w.now
			continue
		}
		if w.now.Sub(at) < p.cfg.UnbindRetry {
			continue
		}
		p.unbindAsked[x.id] = w.now
		g := group{x.rid, x.node.pool}
		if _, ok := byGroup[g]; !ok {
			order = append(order, g)
		}
		byGroup[g] = append(byGroup[g], &fleetpb.Allocation{Id: x.id, NodeId: x.node.id})
	}
	slices.SortFunc(order, func(a, b group) int { return cmp.Or(cmp.Compare(a.pool, b.pool), cmp.Compare(a.rid, b.rid)) })
	for _, g := range order {
		w.out = append(w.out, &fleetpb.PlacementDecision{
			DecisionId:    fmt.Sprintf("%s/unbind-again/%d", g.rid, w.now.UnixMicro()),
			ReservationId: g.rid, Pool: g.pool, At: timestamppb.New(w.now),
			Body: &fleetpb.PlacementDecision_UnbindAgain{UnbindAgain: &fleetpb.UnbindAgain{
				Allocations: byGroup[g], Reason: "unconfirmed",
			}},
		})
	}
	return nil
}

func freedDecision(rid string, a liveAlloc, reason string, fenced bool, now time.Time) *fleetpb.PlacementDecision {
	f := &fleetpb.Freed{AllocationIds: []string{a.id}, Reason: reason}
	if fenced {
		f.Fenced = []string{a.id}
	}
	return &fleetpb.PlacementDecision{
		DecisionId: a.id + "/freed", ReservationId: rid, Pool: a.pool, At: timestamppb.New(now),
		Body: &fleetpb.PlacementDecision_Freed{Freed: f},
	}
}
