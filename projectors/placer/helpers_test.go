package placer

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.DropTemplate()
	os.Exit(code)
}

// msg is a stored stream message as the runner hands it to Apply.
type msg struct {
	subject string
	data    []byte
	hdr     map[string]string
	seq     uint64
	at      time.Time
}

func (m *msg) Subject() string          { return m.subject }
func (m *msg) Data() []byte             { return m.data }
func (m *msg) Header(key string) string { return m.hdr[key] }
func (m *msg) Seq() uint64              { return m.seq }
func (m *msg) Time() time.Time          { return m.at }

func asMessages(ms []*msg) []projection.Message {
	out := make([]projection.Message, len(ms))
	for i, m := range ms {
		out[i] = m
	}
	return out
}

// env is a test database with a clock and a FLEET_RESV stream of its own.
type env struct {
	t    testing.TB
	pool *pgxpool.Pool
	now  time.Time
	seq  uint64
	msgs []*msg // every reservation message made, in stream order
}

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

func newEnv(t testing.TB) *env {
	t.Helper()
	pool, _ := testenv.Pool(t)
	return &env{t: t, pool: pool, now: time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)}
}

func (e *env) clock() time.Time { return e.now }

func (e *env) advance(d time.Duration) { e.now = e.now.Add(d) }

func (e *env) placer(cfg Config) *Placer {
	if cfg.Now == nil {
		cfg.Now = e.clock
	}
	if cfg.Logger == nil {
		cfg.Logger = quiet
	}
	p, err := New(cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	return p
}

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.pool.Exec(context.Background(), sql, args...); err != nil {
		e.t.Fatalf("%s: %v", sql, err)
	}
}

// addNode inserts a healthy, connected node with ngpu GPUs alike.
func (e *env) addNode(id, pool string, ngpu int, model string, mem int, labels map[string]string) {
	e.t.Helper()
	lb, _ := json.Marshal(labels)
	if labels == nil {
		lb = []byte("{}")
	}
	e.exec(`insert into fleet_nodes (node_id, pool, labels, connected, state, state_since, first_seen, last_seen)
		values ($1, $2, $3::jsonb, true, 'healthy', $4, $4, $4)`, id, pool, string(lb), e.now)
	e.exec(`insert into fleet_devices (pool, node_id, gpu_index, model, memory_mib, health)
		select $5, $1, g, $2, $3, 'ok' from generate_series(0, $4 - 1) g`, id, model, mem, ngpu, pool)
}

// setNode changes a node's liveness as the liveness projector would.
func (e *env) setNode(id, state string, connected bool) {
	e.t.Helper()
	e.exec(`update fleet_nodes set state = $2, connected = $3, rev = nextval('fleet_rev') where node_id = $1`, id, state, connected)
}

// setGPU changes a device's health (and bumps its node's rev).
func (e *env) setGPU(id string, idx int, health string) {
	e.t.Helper()
	e.exec(`update fleet_devices set health = $3 where node_id = $1 and gpu_index = $2`, id, idx, health)
	e.exec(`update fleet_nodes set rev = nextval('fleet_rev') where node_id = $1`, id)
}

// report records the allocation report of the node the allocation is
// placed on. allocID may be the id's readable prefix ("r/1/0"; see
// shortID).
func (e *env) report(allocID, state string) {
	e.t.Helper()
	e.exec(`insert into fleet_allocation_reports (allocation_id, pool, node_id, state, reported_at)
		select id, pool, node_id, $2, $3 from fleet_allocations where id = $1 or id like $1 || '.%'
		on conflict (allocation_id, pool, node_id) do update set state = excluded.state, reported_at = excluded.reported_at`,
		allocID, state, e.now)
}

// reportAs records an allocation report from the node (pool, node), which
// may not be the one the allocation is placed on.
func (e *env) reportAs(pool, node, allocID, state string) {
	e.t.Helper()
	e.exec(`insert into fleet_allocation_reports (allocation_id, pool, node_id, state, reported_at)
		select id, $4, $5, $2, $3 from fleet_allocations where id = $1 or id like $1 || '.%'
		on conflict (allocation_id, pool, node_id) do update set state = excluded.state, reported_at = excluded.reported_at`,
		allocID, state, e.now, pool, node)
}

// shortID is an allocation id without its random part:
// "<reservation>/<generation>/<n>".
func shortID(id string) string {
	return randomPart.ReplaceAllString(id, "")
}

// randomPart is the random tail of an allocation id, wherever it is in a
// decision id ("<allocation>/freed").
var randomPart = regexp.MustCompile(`\.[0-9a-f]{32}`)

func shortIDs(ids []string) []string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = shortID(id)
	}
	return out
}

type specT = fleetpb.ReservationSpec

type specOpt func(*specT)

func model(m string) specOpt { return func(s *fleetpb.ReservationSpec) { s.Model = m } }
func minMem(m int) specOpt   { return func(s *fleetpb.ReservationSpec) { s.MinGpuMemoryMib = uint64(m) } }
func wholeNodes(n int) specOpt {
	return func(s *fleetpb.ReservationSpec) { s.Gpus, s.Nodes = 0, uint32(n) }
}
func label(k, v string) specOpt {
	return func(s *fleetpb.ReservationSpec) {
		if s.Labels == nil {
			s.Labels = map[string]string{}
		}
		s.Labels[k] = v
	}
}

func (e *env) message(id, pool string, ev *fleetpb.ReservationEvent) *msg {
	ev.ReservationId, ev.At = id, timestamppb.New(e.now)
	data, err := proto.Marshal(ev)
	if err != nil {
		e.t.Fatal(err)
	}
	e.seq++
	e.now = e.now.Add(time.Millisecond)
	m := &msg{subject: subjects.FleetResv(pool), data: data, seq: e.seq, at: e.now, hdr: map[string]string{
		envelope.MsgID: fmt.Sprintf("resv/%d", e.seq), envelope.Schema: envelope.SchemaFleetV1,
		envelope.Kind: envelope.KindReservation, envelope.Pool: pool, envelope.Reservation: id,
	}}
	e.msgs = append(e.msgs, m)
	return m
}

// request makes a Requested message for gpus GPUs (or whole nodes).
func (e *env) request(id, pool string, gpus int, opts ...specOpt) *msg {
	s := &fleetpb.ReservationSpec{Pool: pool, Gpus: uint32(gpus)}
	for _, o := range opts {
		o(s)
	}
	return e.message(id, pool, &fleetpb.ReservationEvent{Owner: "alice",
		Body: &fleetpb.ReservationEvent_Requested{Requested: &fleetpb.ReservationRequested{Spec: s, RequestId: "req-" + id}}})
}

func (e *env) cancel(id, pool string) *msg {
	return e.message(id, pool, &fleetpb.ReservationEvent{Owner: "alice",
		Body: &fleetpb.ReservationEvent_Cancelled{Cancelled: &fleetpb.ReservationCancelled{}}})
}

// apply runs one Apply in its own transaction and tells the projector the
// outcome, as the runner does.
func (e *env) apply(p projection.Projector, ms ...*msg) {
	e.t.Helper()
	if err := e.tryApply(p, ms...); err != nil {
		e.t.Fatalf("apply: %v", err)
	}
}

func (e *env) tryApply(p projection.Projector, ms ...*msg) error {
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return p.Apply(ctx, tx, asMessages(ms)) })
	settle(p, err == nil)
	return err
}

func (e *env) sweep(p *Placer) {
	e.t.Helper()
	if err := e.trySweep(p); err != nil {
		e.t.Fatalf("sweep: %v", err)
	}
}

func (e *env) trySweep(p *Placer) error {
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return p.Sweep(ctx, tx, e.now) })
	settle(p, err == nil)
	return err
}

func settle(p projection.Projector, ok bool) {
	if c, is := p.(projection.Committer); is {
		if ok {
			c.Committed()
		} else {
			c.Aborted()
		}
	}
}

// alloc is a live allocation.
type alloc struct {
	id, rid, node string
	gpus          []int32
}

func (e *env) live() []alloc {
	e.t.Helper()
	rows, err := e.pool.Query(context.Background(),
		`select id, reservation_id, node_id, gpu_indices from fleet_allocations where released_at is null order by id`)
	if err != nil {
		e.t.Fatal(err)
	}
	var out []alloc
	var a alloc
	if _, err := pgx.ForEachRow(rows, []any{&a.id, &a.rid, &a.node, &a.gpus}, func() error {
		out = append(out, a)
		a.gpus = nil
		return nil
	}); err != nil {
		e.t.Fatal(err)
	}
	return out
}

// liveOf returns the live allocations of a reservation as node:gpus.
func (e *env) liveOf(rid string) []string {
	var out []string
	for _, a := range e.live() {
		if a.rid == rid {
			out = append(out, fmt.Sprintf("%s:%v", a.node, a.gpus))
		}
	}
	return out
}

// status reads the user's view of a reservation.
func (e *env) status(rid string) (state, reason string) {
	e.t.Helper()
	err := e.pool.QueryRow(context.Background(), `select state, reason from fleet_reservation_status where id = $1`, rid).Scan(&state, &reason)
	if err != nil {
		e.t.Fatalf("status %s: %v", rid, err)
	}
	return state, reason
}

type outboxRow struct {
	id       int64
	subject  string
	msgID    string
	headers  map[string]string
	decision *fleetpb.PlacementDecision
	body     []byte
}

func (e *env) outbox() []outboxRow {
	e.t.Helper()
	rows, err := e.pool.Query(context.Background(), `select id, subject, msg_id, headers::text, body from outbox order by id`)
	if err != nil {
		e.t.Fatal(err)
	}
	var out []outboxRow
	var r outboxRow
	var h string
	if _, err := pgx.ForEachRow(rows, []any{&r.id, &r.subject, &r.msgID, &h, &r.body}, func() error {
		c := r
		c.headers = map[string]string{}
		if err := json.Unmarshal([]byte(h), &c.headers); err != nil {
			return err
		}
		c.decision = new(fleetpb.PlacementDecision)
		c.body = slices.Clone(r.body)
		if err := proto.Unmarshal(c.body, c.decision); err != nil {
			return err
		}
		out = append(out, c)
		return nil
	}); err != nil {
		e.t.Fatal(err)
	}
	return out
}

// decisions summarises the outbox as "<decision id> <kind> <detail>".
func (e *env) decisions() []string {
	var out []string
	for _, r := range e.outbox() {
		d := r.decision
		switch {
		case d.GetPlaced() != nil:
			var parts []string
			for _, a := range d.GetPlaced().GetAllocations() {
				parts = append(parts, fmt.Sprintf("%s:%v", a.GetNodeId(), a.GetGpuIndices()))
			}
			out = append(out, d.GetDecisionId()+" placed "+strings.Join(parts, " "))
		case d.GetReleased() != nil:
			rel := d.GetReleased()
			out = append(out, fmt.Sprintf("%s released %s requeued=%t %v", d.GetDecisionId(), rel.GetReason(), rel.GetRequeued(), shortIDs(rel.GetAllocationIds())))
		case d.GetFailed() != nil:
			out = append(out, d.GetDecisionId()+" failed "+d.GetFailed().GetReason())
		case d.GetFreed() != nil:
			f := d.GetFreed()
			out = append(out, fmt.Sprintf("%s freed %s %v fenced=%v", shortID(d.GetDecisionId()), f.GetReason(), shortIDs(f.GetAllocationIds()), shortIDs(f.GetFenced())))
		case d.GetUnfenced() != nil:
			u := d.GetUnfenced()
			out = append(out, fmt.Sprintf("%s unfenced %s %v", shortID(d.GetDecisionId()), u.GetNodeId(), shortIDs(u.GetAllocationIds())))
		case d.GetUnbindAgain() != nil:
			var parts []string
			for _, a := range d.GetUnbindAgain().GetAllocations() {
				parts = append(parts, a.GetNodeId()+":"+shortID(a.GetId()))
			}
			out = append(out, fmt.Sprintf("%s unbind-again %s", d.GetReservationId(), strings.Join(parts, " ")))
		}
	}
	return out
}

// outboxMessages turns the outbox into FLEET_PLACE messages, as the relay
// would publish them.
func (e *env) outboxMessages() []*msg {
	var out []*msg
	for i, r := range e.outbox() {
		h := map[string]string{envelope.MsgID: r.msgID}
		for k, v := range r.headers {
			h[k] = v
		}
		out = append(out, &msg{subject: r.subject, data: r.body, hdr: h, seq: uint64(i + 1), at: e.now})
	}
	return out
}

func (e *env) digest() map[string]string {
	e.t.Helper()
	d, err := Digest(context.Background(), e.pool)
	if err != nil {
		e.t.Fatal(err)
	}
	return d
}

// replay rebuilds the placer's tables from the reservation messages and
// the outbox through Requests and Decisions, in batches of batch, and
// returns the digest.
func (e *env) replay(batch int) map[string]string {
	e.t.Helper()
	ctx := context.Background()
	decisions := e.outboxMessages()
	req, dec := NewRequests(), NewDecisions()
	if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error {
		if err := req.Reset(ctx, tx); err != nil {
			return err
		}
		return dec.Reset(ctx, tx)
	}); err != nil {
		e.t.Fatal(err)
	}
	for i := 0; i < len(e.msgs); i += batch {
		e.apply(req, e.msgs[i:min(i+batch, len(e.msgs))]...)
	}
	for i := 0; i < len(decisions); i += batch {
		e.apply(dec, decisions[i:min(i+batch, len(decisions))]...)
	}
	return e.digest()
}

// checkIndex compares the placer's index and queue with a fresh load.
func (e *env) checkIndex(p *Placer) {
	e.t.Helper()
	if p.idx == nil {
		return
	}
	ctx := context.Background()
	fresh := &Placer{cfg: p.cfg, log: p.log}
	if err := pgx.BeginFunc(ctx, e.pool, func(tx pgx.Tx) error { return fresh.prepare(ctx, tx, e.now) }); err != nil {
		e.t.Fatal(err)
	}
	got, want := p.idx.view(), fresh.idx.view()
	for id, w := range want {
		if got[id] != w {
			e.t.Errorf("index node %s:\n got  %s\n want %s", id, got[id], w)
		}
	}
	for id, g := range got {
		if _, ok := want[id]; !ok {
			e.t.Errorf("index has node %s (%s) that a fresh load has not", id, g)
		}
	}
	var gotQ, wantQ []string
	for _, en := range p.queued() {
		gotQ = append(gotQ, fmt.Sprintf("%s gen=%d", en.id, en.gen))
	}
	for _, en := range fresh.queued() {
		wantQ = append(wantQ, fmt.Sprintf("%s gen=%d", en.id, en.gen))
	}
	if !slices.Equal(gotQ, wantQ) {
		e.t.Errorf("pending queue:\n got  %v\n want %v", gotQ, wantQ)
	}
}

// checkInvariants checks the tables: no GPU held twice, bookings exactly
// the live allocations' GPUs, one live placement per reservation, nothing
// held by a cancelled or failed reservation.
func (e *env) checkInvariants() {
	e.t.Helper()
	ctx := context.Background()
	checks := []struct{ what, sql string }{
		{"GPU held by two live allocations", `select pool, node_id, g from fleet_allocations, unnest(gpu_indices) g
			where released_at is null group by 1, 2, 3 having count(*) > 1`},
		{"live allocation GPU without its booking", `select a.id, g from fleet_allocations a, unnest(a.gpu_indices) g
			where a.released_at is null and not exists (select 1 from fleet_bookings b
				where b.pool = a.pool and b.node_id = a.node_id and b.gpu_index = g and b.allocation_id = a.id and b.reservation_id = a.reservation_id)`},
		{"booking without a live or releasing allocation", `select b.node_id, b.gpu_index from fleet_bookings b
			where not exists (select 1 from fleet_allocations a where a.id = b.allocation_id and a.freed_at is null
				and a.pool = b.pool and a.node_id = b.node_id and b.gpu_index = any(a.gpu_indices))`},
		{"releasing allocation GPU without its booking", `select a.id, g from fleet_allocations a, unnest(a.gpu_indices) g
			where a.released_at is not null and a.freed_at is null and not exists (select 1 from fleet_bookings b
				where b.pool = a.pool and b.node_id = a.node_id and b.gpu_index = g and b.allocation_id = a.id)`},
		{"freed before released", `select id from fleet_allocations where freed_at is not null and released_at is null`},
		{"reservation with live allocations of two placements", `select reservation_id from fleet_allocations
			where released_at is null group by 1 having count(distinct decision_id) > 1`},
		{"live allocation without its live placement", `select a.id from fleet_allocations a
			where a.released_at is null and not exists (select 1 from fleet_placements p
				where p.reservation_id = a.reservation_id and p.decision_id = a.decision_id and p.ended_at is null)`},
		{"live placement without live allocations", `select p.reservation_id from fleet_placements p
			where p.ended_at is null and not exists (select 1 from fleet_allocations a
				where a.reservation_id = p.reservation_id and a.decision_id = p.decision_id and a.released_at is null)`},
		{"cancelled reservation holding GPUs", `select a.id from fleet_allocations a join fleet_reservations r on r.id = a.reservation_id
			where r.cancelled_at is not null and a.released_at is null`},
		{"failed reservation placed", `select f.reservation_id from fleet_failures f join fleet_placements p using (reservation_id)`},
	}
	for _, c := range checks {
		rows, err := e.pool.Query(ctx, c.sql)
		if err != nil {
			e.t.Fatalf("%s: %v", c.what, err)
		}
		var bad []string
		for rows.Next() {
			vals, _ := rows.Values()
			bad = append(bad, fmt.Sprint(vals...))
		}
		rows.Close()
		if len(bad) > 0 {
			e.t.Fatalf("invariant broken: %s: %v", c.what, bad)
		}
	}
}

// held records a Connected of the node listing ids, as the liveness
// projector stores it (at the env's clock).
func (e *env) held(node string, ids ...string) {
	e.t.Helper()
	if ids == nil {
		ids = []string{}
	}
	e.exec(`update fleet_nodes set held_allocations = $2, held_at = $3, connected = true, rev = nextval('fleet_rev')
		where node_id = $1`, node, ids, e.now)
}

// allocID is the full id of the allocation whose readable prefix is short.
func (e *env) allocID(short string) string {
	e.t.Helper()
	var id string
	if err := e.pool.QueryRow(context.Background(), `select id from fleet_allocations where id like $1 || '.%'`, short).Scan(&id); err != nil {
		e.t.Fatal(err)
	}
	return id
}
