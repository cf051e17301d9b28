package placer

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams/projection"
)

// ApplyDecision is ApplyDecisions of one decision; rejected says whether
// its rows conflicted with rows already there and were not written.
func ApplyDecision(ctx context.Context, tx pgx.Tx, d *fleetpb.PlacementDecision) (rejected bool, err error) {
	rej, err := ApplyDecisions(ctx, tx, []*fleetpb.PlacementDecision{d})
	return len(rej) > 0, err
}

// ApplyDecisions turns placement decisions into rows of fleet_allocations,
// fleet_bookings, fleet_placements and fleet_failures, in order, with a few
// statements per run of decisions of one kind. It is the one code path
// from a decision to rows: the live placer writes its decisions with it
// before publishing them, and the Decisions projector applies FLEET_PLACE
// with it on replay, so both yield the same rows.
//
//   - Placed inserts the placement (one per reservation), one booking per
//     GPU and the allocations, each INSERT ... ON CONFLICT DO NOTHING
//     RETURNING. A decision of which any row did not insert (another
//     placement of the reservation, a GPU booked already, an allocation id
//     used already) is rejected: exactly the rows it did insert are deleted
//     again, and its index in ds is returned.
//   - Released marks its allocations released (released_at, reason) and
//     ends the placement they belong to; with requeued the placement row
//     is deleted so that the reservation can be placed again. Their
//     bookings stay (the allocations are "releasing") until a Freed
//     decision: a GPU is bookable again only once its node confirmed the
//     unbind or was fenced. Releasing what is released already is a no-op.
//   - Freed sets freed_at of released allocations, deletes their bookings
//     and records a fence (fleet_fences) for each allocation it fences;
//     Unfenced deletes fences. Freeing what is freed is a no-op.
//   - UnbindAgain writes nothing: it is a message to the gateways.
//   - Failed records the failure unless the reservation has a placement
//     (then it is rejected).
//
// Decisions must be valid (see checkDecision); decisions from the network
// go through the Decisions projector, which checks them.
func ApplyDecisions(ctx context.Context, tx pgx.Tx, ds []*fleetpb.PlacementDecision) (rejected []int, err error) {
	for start := 0; start < len(ds); {
		kind := kindOf(ds[start])
		end := start + 1
		for end < len(ds) && kindOf(ds[end]) == kind {
			end++
		}
		var rej []int
		switch kind {
		case kindPlaced:
			rej, err = applyPlaced(ctx, tx, ds[start:end])
		case kindReleased:
			err = applyReleased(ctx, tx, ds[start:end])
		case kindFailed:
			rej, err = applyFailed(ctx, tx, ds[start:end])
		case kindFreed:
			err = applyFreed(ctx, tx, ds[start:end])
		case kindUnfenced:
			err = applyUnfenced(ctx, tx, ds[start:end])
		case kindUnbindAgain:
			// a message to the gateways: no rows
		default:
			err = fmt.Errorf("decision %s has no body", ds[start].GetDecisionId())
		}
		if err != nil {
			return nil, fmt.Errorf("placer: apply decisions: %w", err)
		}
		for _, i := range rej {
			rejected = append(rejected, start+i)
		}
		start = end
	}
	return rejected, nil
}

type decisionKind int

const (
	kindNone decisionKind = iota
	kindPlaced
	kindReleased
	kindFailed
	kindFreed
	kindUnbindAgain
	kindUnfenced
)

func kindOf(d *fleetpb.PlacementDecision) decisionKind {
	switch d.GetBody().(type) {
	case *fleetpb.PlacementDecision_Placed:
		return kindPlaced
	case *fleetpb.PlacementDecision_Released:
		return kindReleased
	case *fleetpb.PlacementDecision_Failed:
		return kindFailed
	case *fleetpb.PlacementDecision_Freed:
		return kindFreed
	case *fleetpb.PlacementDecision_UnbindAgain:
		return kindUnbindAgain
	case *fleetpb.PlacementDecision_Unfenced:
		return kindUnfenced
	}
	return kindNone
}

// pgTime is a decision's time as PostgreSQL stores it (microseconds).
func pgTime(d *fleetpb.PlacementDecision) time.Time {
	return d.GetAt().AsTime().UTC().Truncate(time.Microsecond)
}

const (
	sqlInsertPlacements = `insert into fleet_placements (reservation_id, decision_id, placed_at)
		select * from unnest($1::text[], $2::text[], $3::timestamptz[])
		on conflict do nothing
		returning reservation_id`
	sqlInsertBookings = `insert into fleet_bookings (pool, node_id, gpu_index, allocation_id, reservation_id)
		select * from unnest($1::text[], $2::text[], $3::int[], $4::text[], $5::text[])
		on conflict do nothing
		returning pool, node_id, gpu_index`
	sqlInsertAllocations = `insert into fleet_allocations (id, reservation_id, pool, node_id, gpu_indices, whole_node, decision_id, placed_at)
		select u.id, u.rid, u.pool, u.node, u.gpus::int[], u.whole, u.did, u.at
		from unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bool[], $7::text[], $8::timestamptz[])
			as u(id, rid, pool, node, gpus, whole, did, at)
		on conflict do nothing
		returning id`
	sqlUndoPlacements = `delete from fleet_placements p using unnest($1::text[]) as u(id) where p.reservation_id = u.id`
	sqlUndoBookings   = `delete from fleet_bookings b using unnest($1::text[], $2::text[], $3::int[]) as u(pool, node, gpu)
		where b.pool = u.pool and b.node_id = u.node and b.gpu_index = u.gpu`
	sqlUndoAllocations = `delete from fleet_allocations a using unnest($1::text[]) as u(id) where a.id = u.id`
)

// gpuKey is one GPU of one node (pool, node id).
type gpuKey struct {
	node nodeKey
	gpu  int32
}

// applyPlaced writes a run of Placed decisions under the guards and undoes
// the ones that did not insert whole.
func applyPlaced(ctx context.Context, tx pgx.Tx, ds []*fleetpb.PlacementDecision) ([]int, error) {
	type booking struct {
		gpuKey
		alloc, rid string
		owner      int
	}
	var (
		pRid, pDid             []string
		pAt                    []time.Time
		bookings               []booking
		aID, aRid, aPool       []string
		aNode, aGPUs, aDid     []string
		aWhole                 []bool
		aAt                    []time.Time
		placementOwner         = make(map[string]int, len(ds))
		allocOwner             = make(map[string]int, len(ds))
		bookingsOf, allocsOf   = make([]int, len(ds)), make([]int, len(ds))
		inserted               = make([]int, len(ds)) // rows inserted per decision
		placementIns           = make([]bool, len(ds))
		sb                     strings.Builder
		insertedB              []gpuKey
		insertedA, insertedPls []string
	)
	for i, d := range ds {
		at := pgTime(d)
		rid, did := d.GetReservationId(), d.GetDecisionId()
		pRid, pDid, pAt = append(pRid, rid), append(pDid, did), append(pAt, at)
		if _, ok := placementOwner[rid]; !ok {
			placementOwner[rid] = i
		}
		for _, a := range d.GetPlaced().GetAllocations() {
			sb.Reset()
			sb.WriteByte('{')
			for j, g := range a.GetGpuIndices() {
				if j > 0 {
					sb.WriteByte(',')
				}
				sb.WriteString(strconv.FormatUint(uint64(g), 10))
				bookings = append(bookings, booking{gpuKey{nodeKey{d.GetPool(), a.GetNodeId()}, int32(g)}, a.GetId(), rid, i})
				bookingsOf[i]++
			}
			sb.WriteByte('}')
			aID, aRid, aPool = append(aID, a.GetId()), append(aRid, rid), append(aPool, d.GetPool())
			aNode, aGPUs, aDid = append(aNode, a.GetNodeId()), append(aGPUs, sb.String()), append(aDid, did)
			aWhole, aAt = append(aWhole, a.GetWholeNode()), append(aAt, at)
			if _, ok := allocOwner[a.GetId()]; !ok {
				allocOwner[a.GetId()] = i
			}
			allocsOf[i]++
		}
	}
	// Rows in key order so that concurrent placers lock in one order; the
	// sort is stable, so of two decisions that want one GPU the first in
	// ds is the one whose row inserts.
	slices.SortStableFunc(bookings, func(a, b booking) int {
		return cmp.Or(compareKeys(a.node, b.node), cmp.Compare(a.gpu, b.gpu))
	})
	bookingOwner := make(map[gpuKey]int, len(bookings))
	bPool, bNode, bGPU := make([]string, len(bookings)), make([]string, len(bookings)), make([]int32, len(bookings))
	bAlloc, bRid := make([]string, len(bookings)), make([]string, len(bookings))
	for j, b := range bookings {
		bPool[j], bNode[j], bGPU[j], bAlloc[j], bRid[j] = b.node.pool, b.node.id, b.gpu, b.alloc, b.rid
		if _, ok := bookingOwner[b.gpuKey]; !ok {
			bookingOwner[b.gpuKey] = b.owner
		}
	}

	batch := &pgx.Batch{}
	batch.Queue(sqlInsertPlacements, pRid, pDid, pAt).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var rid string
			if err := rows.Scan(&rid); err != nil {
				return err
			}
			i := placementOwner[rid]
			placementIns[i] = true
			insertedPls = append(insertedPls, rid)
		}
		return rows.Err()
	})
	batch.Queue(sqlInsertBookings, bPool, bNode, bGPU, bAlloc, bRid).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var k gpuKey
			if err := rows.Scan(&k.node.pool, &k.node.id, &k.gpu); err != nil {
				return err
			}
			inserted[bookingOwner[k]]++
			insertedB = append(insertedB, k)
		}
		return rows.Err()
	})
	allocIns := make([]int, len(ds))
	batch.Queue(sqlInsertAllocations, aID, aRid, aPool, aNode, aGPUs, aWhole, aDid, aAt).Query(func(rows pgx.Rows) error {
		for rows.Next() {
			var id string
			if err := rows.Scan(&id); err != nil {
				return err
			}
			allocIns[allocOwner[id]]++
			insertedA = append(insertedA, id)
		}
		return rows.Err()
	})
	if err := tx.SendBatch(ctx, batch).Close(); err != nil {
		return nil, err
	}

	var rejected []int
	isRejected := make([]bool, len(ds))
	for i := range ds {
		if !placementIns[i] || inserted[i] != bookingsOf[i] || allocIns[i] != allocsOf[i] {
			rejected = append(rejected, i)
			isRejected[i] = true
		}
	}
	if len(rejected) == 0 {
		return nil, nil
	}
	// Undo exactly the rows the rejected decisions inserted: each key
	// inserted belongs to the first decision that asked for it.
	var undoP, undoA, undoPool, undoNode []string
	var undoGPU []int32
	for _, rid := range insertedPls {
		if isRejected[placementOwner[rid]] {
			undoP = append(undoP, rid)
		}
	}
	for _, k := range insertedB {
		if isRejected[bookingOwner[k]] {
			undoPool, undoNode, undoGPU = append(undoPool, k.node.pool), append(undoNode, k.node.id), append(undoGPU, k.gpu)
		}
	}
	for _, id := range insertedA {
		if isRejected[allocOwner[id]] {
			undoA = append(undoA, id)
		}
	}
	batch = &pgx.Batch{}
	if len(undoP) > 0 {
		batch.Queue(sqlUndoPlacements, undoP)
	}
	if len(undoNode) > 0 {
		batch.Queue(sqlUndoBookings, undoPool, undoNode, undoGPU)
	}
	if len(undoA) > 0 {
		batch.Queue(sqlUndoAllocations, undoA)
	}
	if batch.Len() > 0 {
		if err := tx.SendBatch(ctx, batch).Close(); err != nil {
			return nil, fmt.Errorf("undo rejected placements: %w", err)
		}
	}
	return rejected, nil
}

const (
	sqlReleaseAllocations = `update fleet_allocations a set released_at = u.at, release_reason = u.reason
		from unnest($1::text[], $2::timestamptz[], $3::text[]) as u(id, at, reason)
		where a.id = u.id and a.released_at is null`
	sqlRequeuePlacements = `delete from fleet_placements p using unnest($1::text[], $2::text[]) as u(rid, aid)
		where p.reservation_id = u.rid
		  and p.decision_id = (select a.decision_id from fleet_allocations a where a.id = u.aid)`
	sqlEndPlacements = `update fleet_placements p set ended_at = u.at, end_reason = u.reason
		from unnest($1::text[], $2::text[], $3::timestamptz[], $4::text[]) as u(rid, aid, at, reason)
		where p.reservation_id = u.rid and p.ended_at is null
		  and p.decision_id = (select a.decision_id from fleet_allocations a where a.id = u.aid)`
)

// applyReleased writes a run of Released decisions. The placement ended
// is the one the released allocations belong to, so a stale release (a
// duplicate message) never ends a later placement.
func applyReleased(ctx context.Context, tx pgx.Tx, ds []*fleetpb.PlacementDecision) error {
	var (
		aID, aReason           []string
		aAt                    []time.Time
		rqRid, rqAid           []string
		endRid, endAid, endWhy []string
		endAt                  []time.Time
		seenA                  = map[string]bool{}
		seenR                  = map[string]bool{}
	)
	for _, d := range ds {
		rel := d.GetReleased()
		at := pgTime(d)
		for _, id := range rel.GetAllocationIds() {
			if !seenA[id] {
				seenA[id] = true
				aID, aAt, aReason = append(aID, id), append(aAt, at), append(aReason, rel.GetReason())
			}
		}
		ids := rel.GetAllocationIds()
		if len(ids) == 0 || seenR[d.GetReservationId()] {
			continue
		}
		seenR[d.GetReservationId()] = true
		if rel.GetRequeued() {
			rqRid, rqAid = append(rqRid, d.GetReservationId()), append(rqAid, ids[0])
		} else {
			endRid, endAid = append(endRid, d.GetReservationId()), append(endAid, ids[0])
			endAt, endWhy = append(endAt, at), append(endWhy, rel.GetReason())
		}
	}
	if len(aID) == 0 {
		return nil
	}
	batch := &pgx.Batch{}
	batch.Queue(sqlReleaseAllocations, aID, aAt, aReason)
	if len(rqRid) > 0 {
		batch.Queue(sqlRequeuePlacements, rqRid, rqAid)
	}
	if len(endRid) > 0 {
		batch.Queue(sqlEndPlacements, endRid, endAid, endAt, endWhy)
	}
	return tx.SendBatch(ctx, batch).Close()
}

const (
	// Only released allocations are freed, once: a Freed replayed before
	// its Released (it never is: the placer publishes them in order) or
	// twice changes nothing.
	sqlFreeAllocations = `update fleet_allocations a set freed_at = u.at, free_reason = u.reason
		from unnest($1::text[], $2::timestamptz[], $3::text[]) as u(id, at, reason)
		where a.id = u.id and a.released_at is not null and a.freed_at is null
		returning a.id`
	sqlFreeBookings = `delete from fleet_bookings b using unnest($1::text[]) as u(id) where b.allocation_id = u.id`
	sqlInsertFences = `insert into fleet_fences (pool, node_id, allocation_id, fenced_at)
		select a.pool, a.node_id, a.id, u.at from unnest($1::text[], $2::timestamptz[]) as u(id, at)
		join fleet_allocations a on a.id = u.id
		on conflict do nothing`
	sqlDeleteFences = `delete from fleet_fences f using unnest($1::text[], $2::text[], $3::text[]) as u(pool, node, id)
		where f.pool = u.pool and f.node_id = u.node and f.allocation_id = u.id`
)

// applyFreed writes a run of Freed decisions: the allocations' GPUs
// become bookable, and the fenced ones fence their node.
func applyFreed(ctx context.Context, tx pgx.Tx, ds []*fleetpb.PlacementDecision) error {
	var (
		id, reason []string
		at         []time.Time
		fID        []string
		fAt        []time.Time
		seen       = map[string]bool{}
	)
	for _, d := range ds {
		f := d.GetFreed()
		for _, a := range f.GetAllocationIds() {
			if !seen[a] {
				seen[a] = true
				id, at, reason = append(id, a), append(at, pgTime(d)), append(reason, f.GetReason())
			}
		}
		for _, a := range f.GetFenced() {
			fID, fAt = append(fID, a), append(fAt, pgTime(d))
		}
	}
	rows, err := tx.Query(ctx, sqlFreeAllocations, id, at, reason)
	if err != nil {
		return err
	}
	freed, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		return err
	}
	if len(freed) == 0 {
		return nil
	}
	isFreed := make(map[string]bool, len(freed))
	for _, a := range freed {
		isFreed[a] = true
	}
	batch := &pgx.Batch{}
	batch.Queue(sqlFreeBookings, freed)
	// A fence only with the freeing that made it, so that a duplicate
	// Freed does not fence again a node that has been unfenced since.
	fID2, fAt2 := fID[:0:0], fAt[:0:0]
	for i, a := range fID {
		if isFreed[a] {
			fID2, fAt2 = append(fID2, a), append(fAt2, fAt[i])
		}
	}
	if len(fID2) > 0 {
		batch.Queue(sqlInsertFences, fID2, fAt2)
	}
	return tx.SendBatch(ctx, batch).Close()
}

// applyUnfenced writes a run of Unfenced decisions.
func applyUnfenced(ctx context.Context, tx pgx.Tx, ds []*fleetpb.PlacementDecision) error {
	var pool, node, id []string
	for _, d := range ds {
		u := d.GetUnfenced()
		for _, a := range u.GetAllocationIds() {
			pool, node, id = append(pool, d.GetPool()), append(node, u.GetNodeId()), append(id, a)
		}
	}
	_, err := tx.Exec(ctx, sqlDeleteFences, pool, node, id)
	return err
}

const sqlInsertFailures = `insert into fleet_failures (reservation_id, decision_id, failed_at, reason)
	select u.rid, u.did, u.at, u.reason
	from unnest($1::text[], $2::text[], $3::timestamptz[], $4::text[]) as u(rid, did, at, reason)
	where not exists (select 1 from fleet_placements p where p.reservation_id = u.rid)
	on conflict do nothing
	returning reservation_id`

// applyFailed writes a run of Failed decisions; one whose reservation has
// a placement or a failure already is rejected.
func applyFailed(ctx context.Context, tx pgx.Tx, ds []*fleetpb.PlacementDecision) ([]int, error) {
	rid, did, why := make([]string, len(ds)), make([]string, len(ds)), make([]string, len(ds))
	at := make([]time.Time, len(ds))
	owner := make(map[string]int, len(ds))
	for i, d := range ds {
		rid[i], did[i], at[i], why[i] = d.GetReservationId(), d.GetDecisionId(), pgTime(d), d.GetFailed().GetReason()
		if _, ok := owner[rid[i]]; !ok {
			owner[rid[i]] = i
		}
	}
	rows, err := tx.Query(ctx, sqlInsertFailures, rid, did, at, why)
	if err != nil {
		return nil, err
	}
	ok := make([]bool, len(ds))
	for rows.Next() {
		var r string
		if err := rows.Scan(&r); err != nil {
			rows.Close()
			return nil, err
		}
		ok[owner[r]] = true
	}
	if err := rows.Err(); err != nil {
		return nil, err
	}
	var rejected []int
	for i := range ds {
		if !ok[i] {
			rejected = append(rejected, i)
		}
	}
	return rejected, nil
}

// ------------------------------------------------------------ requests --

const (
	sqlInsertReservations = `insert into fleet_reservations
		(id, pool, gpus, nodes, model, labels, min_gpu_memory_mib, owner, request_id, requested_at)
		select u.id, u.pool, u.gpus, u.nodes, u.model, u.labels::jsonb, u.mem, u.owner, u.req, u.at
		from unnest($1::text[], $2::text[], $3::int[], $4::int[], $5::text[], $6::text[], $7::bigint[],
			$8::text[], $9::text[], $10::timestamptz[]) as u(id, pool, gpus, nodes, model, labels, mem, owner, req, at)
		on conflict (id) do nothing
		returning id`
	sqlCancelReservations = `update fleet_reservations r set cancelled_at = u.at
		from unnest($1::text[], $2::timestamptz[]) as u(id, at)
		where r.id = u.id and r.cancelled_at is null
		returning r.id`
)

// record writes a batch's requests (a resent request is a no-op) and
// cancellations to fleet_reservations, with the effect of applying the
// events one by one: a cancellation takes effect on a reservation that
// existed before the batch or was requested earlier in it. It returns the
// requests that were new and the cancellations that took effect, in batch
// order. The live placer and the Requests projector both record with it.
func record(ctx context.Context, tx pgx.Tx, evs []resvEvent) (newReqs, cancels []*resvEvent, err error) {
	var (
		id, pool, model, labels, owner, req []string
		gpus, nodes                         []int32
		mem                                 []int64
		at                                  []time.Time
		firstReq                            = map[string]int{} // id → position of its first request in evs
	)
	for i := range evs {
		ev := &evs[i]
		if !ev.requested {
			continue
		}
		if _, ok := firstReq[ev.id]; ok {
			continue
		}
		firstReq[ev.id] = i
		lb, err := json.Marshal(ev.spec.labels)
		if err != nil {
			return nil, nil, err
		}
		if ev.spec.labels == nil {
			lb = []byte("{}")
		}
		id, pool, model = append(id, ev.id), append(pool, ev.pool), append(model, ev.spec.model)
		labels, owner, req = append(labels, string(lb)), append(owner, ev.owner), append(req, ev.requestID)
		gpus, nodes = append(gpus, int32(ev.spec.gpus)), append(nodes, int32(ev.spec.nodes))
		mem, at = append(mem, int64(ev.spec.minMem)), append(at, ev.at)
	}
	inserted := map[string]bool{}
	if len(id) > 0 {
		rows, err := tx.Query(ctx, sqlInsertReservations, id, pool, gpus, nodes, model, labels, mem, owner, req, at)
		if err != nil {
			return nil, nil, fmt.Errorf("placer: record requests: %w", err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, nil, fmt.Errorf("placer: record requests: %w", err)
		}
		for _, x := range ids {
			inserted[x] = true
		}
	}
	var cID []string
	var cAt []time.Time
	cEv := map[string]*resvEvent{}
	for i := range evs {
		ev := &evs[i]
		switch {
		case ev.requested:
			if inserted[ev.id] && firstReq[ev.id] == i {
				newReqs = append(newReqs, ev)
			}
		case cEv[ev.id] != nil:
			// cancelled earlier in the batch
		default:
			first, requested := firstReq[ev.id]
			if inserted[ev.id] && (!requested || first > i) {
				continue // the reservation did not exist yet when it was cancelled
			}
			cEv[ev.id] = ev
			cID, cAt = append(cID, ev.id), append(cAt, ev.at)
		}
	}
	if len(cID) > 0 {
		rows, err := tx.Query(ctx, sqlCancelReservations, cID, cAt)
		if err != nil {
			return nil, nil, fmt.Errorf("placer: record cancellations: %w", err)
		}
		ids, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return nil, nil, fmt.Errorf("placer: record cancellations: %w", err)
		}
		done := make(map[string]bool, len(ids))
		for _, x := range ids {
			done[x] = true
		}
		for _, x := range cID {
			if done[x] {
				cancels = append(cancels, cEv[x])
			}
		}
	}
	return newReqs, cancels, nil
}

// clampSpec keeps a spec's numbers inside their columns; anything clamped
// is invalid anyway (maxCount) and fails.
func clampSpec(s spec) spec {
	s.gpus = min(s.gpus, math.MaxInt32)
	s.nodes = min(s.nodes, math.MaxInt32)
	s.minMem = min(s.minMem, math.MaxInt64)
	return s
}

// decodeBatch decodes a FLEET_RESV batch; the first bad message is returned
// as poison before anything is written.
func decodeBatch(batch []projection.Message) ([]resvEvent, error) {
	evs := make([]resvEvent, 0, len(batch))
	for _, m := range batch {
		ev, err := decodeReservation(m)
		if err == nil {
			err = checkText(ev)
		}
		if err != nil {
			return nil, projection.Poison(m, err)
		}
		ev.spec = clampSpec(ev.spec)
		evs = append(evs, ev)
	}
	return evs, nil
}

// checkText refuses strings PostgreSQL cannot store.
func checkText(ev resvEvent) error {
	bad := strings.ContainsRune(ev.id, 0) || strings.ContainsRune(ev.pool, 0) || strings.ContainsRune(ev.owner, 0) ||
		strings.ContainsRune(ev.requestID, 0) || strings.ContainsRune(ev.spec.model, 0)
	for k, v := range ev.spec.labels {
		bad = bad || strings.ContainsRune(k, 0) || strings.ContainsRune(v, 0)
	}
	if bad {
		return fmt.Errorf("reservation %q: a string holds a NUL byte", ev.id)
	}
	return nil
}

// ----------------------------------------------------------- projectors --

// Requests records FLEET_RESV into fleet_reservations exactly as the live
// placer does, without planning: `millrace replay fleet` rebuilds
// fleet_reservations with it. It holds no state.
type Requests struct{}

var (
	_ projection.Projector = (*Requests)(nil)
	_ projection.Resetter  = (*Requests)(nil)
)

// NewRequests returns the FLEET_RESV replay projector.
func NewRequests() *Requests { return &Requests{} }

// Name is the durable consumer name, "placer-requests".
func (*Requests) Name() string { return RequestsConsumer }

// Apply records a batch of reservation events.
func (*Requests) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	evs, err := decodeBatch(batch)
	if err != nil {
		return err
	}
	_, _, err = record(ctx, tx, evs)
	return err
}

// Reset empties fleet_reservations (projection.Resetter).
func (*Requests) Reset(ctx context.Context, tx pgx.Tx) error {
	if _, err := tx.Exec(ctx, "truncate fleet_reservations"); err != nil {
		return fmt.Errorf("placer: reset requests: %w", err)
	}
	return nil
}

// Decisions applies FLEET_PLACE to the booking tables with ApplyDecisions:
// `millrace replay fleet` rebuilds fleet_allocations, fleet_bookings,
// fleet_placements and fleet_failures with it. It holds no state.
type Decisions struct{}

var (
	_ projection.Projector = (*Decisions)(nil)
	_ projection.Resetter  = (*Decisions)(nil)
)

// NewDecisions returns the FLEET_PLACE replay projector.
func NewDecisions() *Decisions { return &Decisions{} }

// Name is the durable consumer name, "placer-decisions".
func (*Decisions) Name() string { return DecisionsConsumer }

// Apply applies a batch of decisions. A decision that does not decode is
// poison. A Placed decision whose rows are there already (the same
// decision stored twice, beyond JetStream's duplicate window) is skipped;
// one that conflicts with other rows is poison, since the live placer
// never publishes a decision it could not write.
func (*Decisions) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	ds := make([]*fleetpb.PlacementDecision, len(batch))
	for i, m := range batch {
		d, err := decodeDecision(m)
		if err != nil {
			return projection.Poison(m, err)
		}
		ds[i] = d
	}
	rejected, err := ApplyDecisions(ctx, tx, ds)
	if err != nil {
		return err
	}
	var ids []string
	for _, i := range rejected {
		for _, a := range ds[i].GetPlaced().GetAllocations() {
			ids = append(ids, a.GetId())
		}
	}
	if len(ids) == 0 {
		return nil
	}
	rows, err := tx.Query(ctx, "select a.id, a.decision_id from unnest($1::text[]) as u(id) join fleet_allocations a on a.id = u.id", ids)
	if err != nil {
		return fmt.Errorf("placer: check rejected decisions: %w", err)
	}
	owner := map[string]string{}
	for rows.Next() {
		var id, did string
		if err := rows.Scan(&id, &did); err != nil {
			rows.Close()
			return err
		}
		owner[id] = did
	}
	if err := rows.Err(); err != nil {
		return err
	}
	for _, i := range rejected {
		d := ds[i]
		if d.GetPlaced() == nil {
			continue // a failure of a placed reservation: the placement stands
		}
		if owner[d.GetPlaced().GetAllocations()[0].GetId()] == d.GetDecisionId() {
			continue // a duplicate
		}
		return projection.Poison(batch[i], fmt.Errorf("placed decision %s conflicts with the bookings or placements present", d.GetDecisionId()))
	}
	return nil
}

// Reset empties the tables written from FLEET_PLACE (projection.Resetter).
func (*Decisions) Reset(ctx context.Context, tx pgx.Tx) error {
	if _, err := tx.Exec(ctx, "truncate fleet_allocations, fleet_bookings, fleet_placements, fleet_failures, fleet_fences"); err != nil {
		return fmt.Errorf("placer: reset decisions: %w", err)
	}
	return nil
}

// ------------------------------------------------------------- digest --

// Querier is what Digest needs of a database handle; *pgxpool.Pool,
// *pgx.Conn and pgx.Tx all have it.
type Querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// DigestTables are the tables the placer's projections write, in the
// order Digest reports them (the outbox is not among them).
var DigestTables = []string{"fleet_reservations", "fleet_allocations", "fleet_bookings", "fleet_placements", "fleet_failures", "fleet_fences"}

var digestOrder = map[string]string{
	"fleet_reservations": `id collate "C"`,
	"fleet_allocations":  `id collate "C"`,
	"fleet_bookings":     `pool collate "C", node_id collate "C", gpu_index`,
	"fleet_placements":   `reservation_id collate "C"`,
	"fleet_failures":     `reservation_id collate "C"`,
	"fleet_fences":       `pool collate "C", node_id collate "C", allocation_id collate "C"`,
}

// Digest returns, per table of DigestTables, the md5 of all its rows
// (their text form, every column) in primary-key order: a replay is
// checked against the live run by comparing digests taken with the same
// TimeZone setting.
func Digest(ctx context.Context, q Querier) (map[string]string, error) {
	out := make(map[string]string, len(DigestTables))
	for _, table := range DigestTables {
		var sum string
		sql := fmt.Sprintf(`select md5(coalesce(string_agg(t::text, E'\n' order by %s), '')) from %s t`,
			digestOrder[table], table)
		if err := q.QueryRow(ctx, sql).Scan(&sum); err != nil {
			return nil, fmt.Errorf("placer: digest %s: %w", table, err)
		}
		out[table] = sum
	}
	return out, nil
}
