package reservations

import (
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/types/known/timestamppb"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// The API reads the fleet projections (migrations/003_fleet.sql) with its
// own SQL and writes none of them: the state a user sees is the
// fleet_reservation_status view, and the allocations come from
// fleet_allocations and the nodes' fleet_allocation_reports.

// store reads reservations.
type store struct {
	db *pgxpool.Pool
}

const reservationColumns = `id, pool, gpus, nodes, model, labels, min_gpu_memory_mib, owner,
	requested_at, state, placed_at, active_at, ended_at, reason`

// row is one row of fleet_reservation_status.
type row struct {
	r           *fleetpb.Reservation
	requestedAt time.Time
}

func scanReservation(rows pgx.CollectableRow) (row, error) {
	var (
		id, pool, model, owner, state, reason string
		gpus, nodes                           int32
		minMem                                int64
		labels                                []byte
		requestedAt                           time.Time
		placedAt, activeAt, endedAt           *time.Time
	)
	if err := rows.Scan(&id, &pool, &gpus, &nodes, &model, &labels, &minMem, &owner,
		&requestedAt, &state, &placedAt, &activeAt, &endedAt, &reason); err != nil {
		return row{}, err
	}
	spec := &fleetpb.ReservationSpec{
		Pool: pool, Gpus: uint32(max(gpus, 0)), Nodes: uint32(max(nodes, 0)), Model: model,
		MinGpuMemoryMib: uint64(max(minMem, 0)),
	}
	if len(labels) > 0 {
		// Labels the projector wrote are strings; anything else is left out
		// rather than failing the read.
		var m map[string]any
		if json.Unmarshal(labels, &m) == nil && len(m) > 0 {
			spec.Labels = make(map[string]string, len(m))
			for k, v := range m {
				if s, ok := v.(string); ok {
					spec.Labels[k] = s
				}
			}
		}
	}
	st := stateOf(state)
	r := &fleetpb.Reservation{
		Id: id, Spec: spec, State: st, Owner: owner, Reason: reason,
		CreatedAt: timestamppb.New(requestedAt),
		ActiveAt:  ts(activeAt),
		EndedAt:   ts(endedAt),
	}
	// The view keeps the time of a placement that ended (a release without
	// requeue); a PENDING reservation shows no placed_at.
	if st != fleetpb.ReservationState_RESERVATION_STATE_PENDING {
		r.PlacedAt = ts(placedAt)
	}
	return row{r: r, requestedAt: requestedAt}, nil
}

func stateOf(s string) fleetpb.ReservationState {
	return fleetpb.ReservationState(fleetpb.ReservationState_value["RESERVATION_STATE_"+s])
}

// stateName is the view's name of a state ("PENDING"), "" for UNSPECIFIED.
func stateName(s fleetpb.ReservationState) string {
	if s == fleetpb.ReservationState_RESERVATION_STATE_UNSPECIFIED {
		return ""
	}
	n := fleetpb.ReservationState_name[int32(s)]
	return n[len("RESERVATION_STATE_"):]
}

func ts(t *time.Time) *timestamppb.Timestamp {
	if t == nil {
		return nil
	}
	return timestamppb.New(*t)
}

// get returns one reservation with its allocations, or nil when the view
// has no such id (yet).
func (s store) get(ctx context.Context, id string) (*fleetpb.Reservation, error) {
	rows, err := s.db.Query(ctx, `select `+reservationColumns+` from fleet_reservation_status where id = $1`, id)
	if err != nil {
		return nil, err
	}
	got, err := pgx.CollectRows(rows, scanReservation)
	if err != nil || len(got) == 0 {
		return nil, err
	}
	r := got[0].r
	if err := s.allocations(ctx, []*fleetpb.Reservation{r}); err != nil {
		return nil, err
	}
	return r, nil
}

// allocations fills in the allocations each reservation holds now.
// Released allocations (after a cancel, a repair or a failure) are left
// out; the state of each live one is what its node last reported (BOUND,
// UNBOUND, FAILED), PENDING until the node answers.
func (s store) allocations(ctx context.Context, rs []*fleetpb.Reservation) error {
	if len(rs) == 0 {
		return nil
	}
	byID := make(map[string]*fleetpb.Reservation, len(rs))
	ids := make([]string, 0, len(rs))
	for _, r := range rs {
		byID[r.Id] = r
		ids = append(ids, r.Id)
	}
	rows, err := s.db.Query(ctx, `
		select al.reservation_id, al.id, al.node_id, al.gpu_indices, al.whole_node, coalesce(ar.state, '')
		from fleet_allocations al
		-- only the report of the node the allocation is placed on counts
		left join fleet_allocation_reports ar on ar.allocation_id = al.id and ar.pool = al.pool and ar.node_id = al.node_id
		where al.reservation_id = any($1) and al.released_at is null
		order by al.reservation_id, al.placed_at, al.id`, ids)
	if err != nil {
		return err
	}
	var (
		resID, id, node, state string
		gpus                   []int32
		whole                  bool
	)
	_, err = pgx.ForEachRow(rows, []any{&resID, &id, &node, &gpus, &whole, &state}, func() error {
		a := &fleetpb.Allocation{Id: id, NodeId: node, WholeNode: whole, State: allocationState(state)}
		for _, g := range gpus {
			a.GpuIndices = append(a.GpuIndices, uint32(max(g, 0)))
		}
		if r := byID[resID]; r != nil {
			r.Allocations = append(r.Allocations, a)
		}
		return nil
	})
	return err
}

// allocationState reads fleet_allocation_reports.state. Its values are the
// column's (its check constraint, migrations/003_fleet.sql), not the enum's
// generated names, so they are written out: renaming an enum value must not
// change how stored rows read.
func allocationState(s string) fleetpb.AllocationState {
	switch s {
	case "bound":
		return fleetpb.AllocationState_ALLOCATION_STATE_BOUND
	case "unbound":
		return fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND
	case "failed":
		return fleetpb.AllocationState_ALLOCATION_STATE_FAILED
	default:
		return fleetpb.AllocationState_ALLOCATION_STATE_PENDING
	}
}

// countOpen counts owner's reservations that are PENDING or PLACED, up to
// limit (counting further would not change the answer).
func (s store) countOpen(ctx context.Context, owner string, limit int) (int, error) {
	var n int
	err := s.db.QueryRow(ctx, `
		select count(*) from (
			select 1 from fleet_reservation_status
			where owner = $1 and cancelled_at is null and state in ('PENDING', 'PLACED')
			limit $2) open`, owner, limit).Scan(&n)
	return n, err
}

// listQuery is one page of List.
type listQuery struct {
	owner string
	pool  string   // "" for any
	state string   // "" for any
	pools []string // nil for any; the pools the key may use
	after *cursor  // nil for the first page
	limit int
}

// list returns up to q.limit reservations in (requested_at, id) order and
// whether there are more.
func (s store) list(ctx context.Context, q listQuery) ([]row, bool, error) {
	var (
		pool, state, pools, afterT any
		afterID                    string
	)
	if q.pool != "" {
		pool = q.pool
	}
	if q.state != "" {
		state = q.state
	}
	if q.pools != nil {
		pools = q.pools
	}
	if q.after != nil {
		afterT, afterID = time.UnixMicro(q.after.micros).UTC(), q.after.id
	}
	rows, err := s.db.Query(ctx, `select `+reservationColumns+` from fleet_reservation_status
		where owner = $1
		  and ($2::text is null or pool = $2)
		  and ($3::text is null or state = $3)
		  and ($4::text[] is null or pool = any($4))
		  and ($5::timestamptz is null or (requested_at, id) > ($5, $6::text))
		order by requested_at, id
		limit $7`, q.owner, pool, state, pools, afterT, afterID, q.limit+1)
	if err != nil {
		return nil, false, err
	}
	got, err := pgx.CollectRows(rows, scanReservation)
	if err != nil {
		return nil, false, err
	}
	more := len(got) > q.limit
	if more {
		got = got[:q.limit]
	}
	rs := make([]*fleetpb.Reservation, len(got))
	for i, g := range got {
		rs[i] = g.r
	}
	if err := s.allocations(ctx, rs); err != nil {
		return nil, false, err
	}
	return got, more, nil
}

// cursor is where a page ends: the (requested_at, id) of its last row.
type cursor struct {
	micros int64
	id     string
}

// A page token is base64url of: version byte 1, 8 bytes of the SHA-256 of
// the filters it was issued for, requested_at in microseconds (8 bytes),
// then the id. It is opaque to clients; the filter digest catches a token
// reused with other filters.
const tokenVersion = 1

var errBadToken = errors.New("bad page token")

func filterDigest(owner, pool, state string) []byte {
	h := sha256.Sum256([]byte(owner + "\x00" + pool + "\x00" + state))
	return h[:8]
}

func encodeToken(filter []byte, c cursor) string {
	b := make([]byte, 0, 17+len(c.id))
	b = append(b, tokenVersion)
	b = append(b, filter...)
	b = binary.BigEndian.AppendUint64(b, uint64(c.micros))
	b = append(b, c.id...)
	return base64.RawURLEncoding.EncodeToString(b)
}

func decodeToken(filter []byte, tok string) (*cursor, error) {
	b, err := base64.RawURLEncoding.DecodeString(tok)
	if err != nil || len(b) < 18 || b[0] != tokenVersion {
		return nil, errBadToken
	}
	if string(b[1:9]) != string(filter) {
		return nil, errFilterChanged
	}
	return &cursor{micros: int64(binary.BigEndian.Uint64(b[9:17])), id: string(b[17:])}, nil
}

var errFilterChanged = errors.New("page token of other filters")
