package fleet

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
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

var t0 = time.Date(2024, 5, 6, 7, 0, 0, 0, time.UTC)

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

// stream numbers messages as JetStream would and stamps their stored time.
// Gateways stamp `at` with their own clock, which is deliberately off by
// a minute here: the projection must not read it.
type stream struct {
	seq  uint64
	now  time.Time
	msgs []*msg
}

func newStream() *stream { return &stream{now: t0} }

// at moves the stream's clock to t0+d (never backwards).
func (s *stream) at(d time.Duration) *stream {
	if t := t0.Add(d); t.After(s.now) {
		s.now = t
	}
	return s
}

func (s *stream) add(subject, kind string, body proto.Message, hdr map[string]string) *msg {
	data, err := proto.Marshal(body)
	if err != nil {
		panic(err)
	}
	h := map[string]string{envelope.Schema: envelope.SchemaFleetV1, envelope.Kind: kind}
	for k, v := range hdr {
		h[k] = v
	}
	s.seq++
	m := &msg{subject: subject, data: data, hdr: h, seq: s.seq, at: s.now}
	h[envelope.MsgID] = fmt.Sprintf("test/%d", s.seq)
	s.msgs = append(s.msgs, m)
	return m
}

func (s *stream) node(pool, node, gw, session string, ev *fleetpb.NodeEvent) *msg {
	ev.NodeId, ev.Pool, ev.GatewayId, ev.SessionId = node, pool, gw, session
	ev.At = timestamppb.New(s.now.Add(-time.Minute))
	return s.add(subjects.FleetNode(pool, node), envelope.KindNode, ev, map[string]string{
		envelope.Pool: pool, envelope.Node: node, envelope.Gateway: gw})
}

func (s *stream) connect(pool, node, gw, session string, labels map[string]string, gpus ...*fleetpb.Gpu) *msg {
	return s.node(pool, node, gw, session, &fleetpb.NodeEvent{Body: &fleetpb.NodeEvent_Connected{
		Connected: &fleetpb.NodeConnected{Labels: labels, Gpus: gpus, AgentVersion: "agent/1.4.2"}}})
}

func (s *stream) disconnect(pool, node, gw, session, reason string) *msg {
	return s.node(pool, node, gw, session, &fleetpb.NodeEvent{Body: &fleetpb.NodeEvent_Disconnected{
		Disconnected: &fleetpb.NodeDisconnected{Reason: reason}}})
}

func (s *stream) status(pool, node, gw, session, hash string, gpus []*fleetpb.GpuState, conds ...*fleetpb.Condition) *msg {
	return s.node(pool, node, gw, session, &fleetpb.NodeEvent{Body: &fleetpb.NodeEvent_StatusChanged{
		StatusChanged: &fleetpb.NodeStatusChanged{StatusHash: hash, Gpus: gpus, Conditions: conds}}})
}

func (s *stream) alloc(pool, node, gw, session, id string, state fleetpb.AllocationState, errText string) *msg {
	return s.node(pool, node, gw, session, &fleetpb.NodeEvent{Body: &fleetpb.NodeEvent_Allocation{
		Allocation: &fleetpb.AllocationReport{AllocationId: id, State: state, Error: errText}}})
}

// heard is one liveness entry: node, session, age in ms.
type heard struct {
	node, session string
	ageMs         uint32
}

func (s *stream) liveness(pool, gw string, nodes ...heard) *msg {
	b := &fleetpb.LivenessBatch{GatewayId: gw, Pool: pool, ObservedAt: timestamppb.New(s.now.Add(-time.Minute))}
	for _, h := range nodes {
		b.Nodes = append(b.Nodes, &fleetpb.NodeAge{NodeId: h.node, SessionId: h.session, AgeMs: h.ageMs})
	}
	return s.add(subjects.FleetLiveness(pool), envelope.KindLiveness, b, map[string]string{
		envelope.Pool: pool, envelope.Gateway: gw})
}

func gpu(i uint32, model string, mib uint64, h fleetpb.GpuHealth) *fleetpb.Gpu {
	return &fleetpb.Gpu{Index: i, Model: model, MemoryMib: mib, Health: h, Uuid: fmt.Sprintf("GPU-%s-%d", model, i)}
}

func toMessages(msgs []*msg) []projection.Message {
	out := make([]projection.Message, len(msgs))
	for i, m := range msgs {
		out[i] = m
	}
	return out
}

// applyAll applies msgs in batches of n, each in its own transaction, as
// the runner does.
func applyAll(t testing.TB, pool *pgxpool.Pool, p *Projector, msgs []*msg, n int) Stats {
	t.Helper()
	var total Stats
	for i := 0; i < len(msgs); i += n {
		st := applyBatch(t, pool, p, msgs[i:min(i+n, len(msgs))])
		total.Messages += st.Messages
		total.Liveness += st.Liveness
		total.IgnoredLiveness += st.IgnoredLiveness
		total.IgnoredEvents += st.IgnoredEvents
	}
	return total
}

func applyBatch(t testing.TB, pool *pgxpool.Pool, p *Projector, msgs []*msg) Stats {
	t.Helper()
	ctx := context.Background()
	var st Stats
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		st, err = p.ApplyStats(ctx, tx, toMessages(msgs))
		return err
	})
	if err != nil {
		t.Fatalf("apply batch from seq %d: %v", msgs[0].seq, err)
	}
	return st
}

func sweep(t testing.TB, pool *pgxpool.Pool, p *Projector, now time.Time) {
	t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.Sweep(ctx, tx, now) }); err != nil {
		t.Fatalf("sweep: %v", err)
	}
}

func digestOf(t testing.TB, q Querier) map[string]string {
	t.Helper()
	d, err := Digest(context.Background(), q)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func truncate(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	if _, err := pool.Exec(context.Background(), `truncate fleet_nodes, fleet_devices, fleet_allocation_reports, fleet_clock`); err != nil {
		t.Fatal(err)
	}
}

// show is Show of the one node named id (tests that name a node in two
// pools use Show).
func show(t testing.TB, q Querier, id string) *Node {
	t.Helper()
	var poolName string
	if err := q.QueryRow(context.Background(), "select pool from fleet_nodes where node_id = $1", id).Scan(&poolName); err != nil {
		t.Fatalf("show %s: %v", id, err)
	}
	n, err := Show(context.Background(), q, poolName, id)
	if err != nil {
		t.Fatalf("show %s: %v", id, err)
	}
	return n
}

// rel renders a time as an offset from t0, for golden files.
func rel(tm time.Time) string {
	d := tm.Sub(t0)
	if d >= 0 {
		return "+" + d.String()
	}
	return d.String()
}

// dump renders the whole projection (but revs) for golden files.
func dump(t testing.TB, q Querier) []byte {
	t.Helper()
	ctx := context.Background()
	var buf bytes.Buffer
	nodes, err := Nodes(ctx, q, "")
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range nodes {
		full := show(t, q, n.ID)
		labels, _ := json.Marshal(full.Labels)
		conds, _ := json.Marshal(full.Conditions)
		fmt.Fprintf(&buf, "node %s pool=%s state=%s since=%s first=%s last=%s connected=%v session=%q gateway=%q agent=%q\n",
			n.ID, n.Pool, n.State, rel(n.StateSince), rel(n.FirstSeen), rel(n.LastSeen), n.Connected, n.SessionID,
			n.GatewayID, n.AgentVersion)
		fmt.Fprintf(&buf, "  labels=%s status_hash=%q conditions=%s\n", labels, n.StatusHash, conds)
		for _, d := range full.Devices {
			fmt.Fprintf(&buf, "  gpu %d %s %d MiB %s %s\n", d.Index, d.Model, d.MemoryMiB, d.UUID, d.Health)
		}
	}
	rows, err := q.Query(ctx, `select allocation_id, node_id, state, error, reported_at from fleet_allocation_reports order by 1`)
	if err != nil {
		t.Fatal(err)
	}
	var (
		id, node, state, e string
		at                 time.Time
	)
	if _, err := pgx.ForEachRow(rows, []any{&id, &node, &state, &e, &at}, func() error {
		fmt.Fprintf(&buf, "allocation %s node=%s state=%s error=%q reported=%s\n", id, node, state, e, rel(at))
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	var clock time.Time
	var resumed *time.Time
	if err := q.QueryRow(ctx, `select liveness_time, resumed_at from fleet_clock`).Scan(&clock, &resumed); err == nil {
		r := "null"
		if resumed != nil {
			r = rel(*resumed)
		}
		fmt.Fprintf(&buf, "clock liveness=%s resumed=%s\n", rel(clock), r)
	} else if err != pgx.ErrNoRows {
		t.Fatal(err)
	}
	counts, err := Counts(ctx, q)
	if err != nil {
		t.Fatal(err)
	}
	js, _ := json.Marshal(counts)
	fmt.Fprintf(&buf, "counts %s\n", js)
	return buf.Bytes()
}
