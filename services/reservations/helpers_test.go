package reservations

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/encoding/prototext"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The tests run the API against a real PostgreSQL database (one per test,
// migrated) and an embedded JetStream server. No projector runs: a test
// plays the projectors and the placer by writing their rows directly and
// publishing placement decisions itself.

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.DropTemplate()
	os.Exit(code)
}

const (
	aliceKey = "alice-key-0123456789"
	bobKey   = "bob-key-0123456789xyz"
	carolKey = "carol-key-0123456789" // only pools a100 and h100
)

func testKeys(t testing.TB) Keys {
	t.Helper()
	k, err := ParseKeys("alice=" + aliceKey + ",bob=" + bobKey + "\ncarol:a100|h100=" + carolKey)
	if err != nil {
		t.Fatal(err)
	}
	return k
}

type env struct {
	t      *testing.T
	db     *pgxpool.Pool
	nc     *nats.Conn
	js     jetstream.JetStream
	srv    *Server
	client fleetpb.ReservationsClient
	web    *httptest.Server
}

// newEnv starts the API on a fresh database and backbone. SettleTimeout
// defaults to 200 ms here, since most tests run no projector to settle.
func newEnv(t *testing.T, cfg Config) *env {
	t.Helper()
	if cfg.Keys.Table == nil {
		cfg.Keys = testKeys(t)
	}
	if cfg.SettleTimeout == 0 {
		cfg.SettleTimeout = 200 * time.Millisecond
	}
	db, _ := testenv.Pool(t)
	ns := testenv.NATS(t)
	nc, err := streams.Connect(ns.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncTimeout(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	ctx := testCtx(t)
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	srv, err := New(cfg, db, js, nc, NewMetrics(nil), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Close)

	g := grpc.NewServer()
	srv.Register(g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })

	web := httptest.NewServer(srv.Handler())
	t.Cleanup(web.Close)
	return &env{t: t, db: db, nc: nc, js: js, srv: srv, client: fleetpb.NewReservationsClient(conn), web: web}
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// as is a context whose calls carry key as a bearer token.
func as(t testing.TB, key string) context.Context {
	return metadata.AppendToOutgoingContext(testCtx(t), "authorization", "Bearer "+key)
}

// --- the streams ---

// resvMsgs returns every message stored in FLEET_RESV.
func (e *env) resvMsgs() []*jetstream.RawStreamMsg {
	e.t.Helper()
	msgs, err := e.tryResvMsgs()
	if err != nil {
		e.t.Fatal(err)
	}
	return msgs
}

// tryResvMsgs is resvMsgs for goroutines other than the test's.
func (e *env) tryResvMsgs() ([]*jetstream.RawStreamMsg, error) {
	ctx := testCtx(e.t)
	st, err := e.js.Stream(ctx, subjects.StreamFleetResv)
	if err != nil {
		return nil, err
	}
	info, err := st.Info(ctx)
	if err != nil {
		return nil, err
	}
	var out []*jetstream.RawStreamMsg
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := st.GetMsg(ctx, seq)
		if err != nil {
			return nil, err
		}
		out = append(out, m)
	}
	return out, nil
}

// waitResvMsgs waits until FLEET_RESV holds n messages and returns them.
func (e *env) waitResvMsgs(n int) []*jetstream.RawStreamMsg {
	e.t.Helper()
	var msgs []*jetstream.RawStreamMsg
	poll.Until(e.t, "reservation events in the stream", func() bool {
		msgs = e.resvMsgs()
		return len(msgs) >= n
	}, poll.Within(20*time.Second))
	if len(msgs) != n {
		e.t.Fatalf("FLEET_RESV holds %d messages, want %d", len(msgs), n)
	}
	return msgs
}

func decodeEvent(t testing.TB, m *jetstream.RawStreamMsg) *fleetpb.ReservationEvent {
	t.Helper()
	ev := &fleetpb.ReservationEvent{}
	if err := proto.Unmarshal(m.Data, ev); err != nil {
		t.Fatalf("decode reservation event: %v", err)
	}
	return ev
}

// checkHeaders checks the envelope of a reservation event.
func checkHeaders(t testing.TB, m *jetstream.RawStreamMsg, id, what, pool string) {
	t.Helper()
	want := map[string]string{
		envelope.MsgID:       id + "/" + what,
		envelope.Schema:      envelope.SchemaFleetV1,
		envelope.Kind:        envelope.KindReservation,
		envelope.Pool:        pool,
		envelope.Reservation: id,
	}
	for k, v := range want {
		if got := m.Header.Get(k); got != v {
			t.Errorf("header %s = %q, want %q", k, got, v)
		}
	}
	if want := subjects.FleetResv(pool); m.Subject != want {
		t.Errorf("subject %q, want %q", m.Subject, want)
	}
}

// tryDecide publishes a placement decision as the placer does.
func (e *env) tryDecide(d *fleetpb.PlacementDecision) error {
	data, err := proto.Marshal(d)
	if err != nil {
		return err
	}
	msg := &nats.Msg{Subject: subjects.FleetPlace(d.Pool), Data: data, Header: nats.Header{
		envelope.MsgID:       {d.DecisionId},
		envelope.Schema:      {envelope.SchemaFleetV1},
		envelope.Kind:        {envelope.KindDecision},
		envelope.Pool:        {d.Pool},
		envelope.Reservation: {d.ReservationId},
	}}
	_, err = e.js.PublishMsg(testCtx(e.t), msg)
	return err
}

// --- the projections, as the projectors and the placer write them ---

var t0 = time.Date(2025, 3, 1, 12, 0, 0, 0, time.UTC)

func (e *env) exec(sql string, args ...any) {
	e.t.Helper()
	if _, err := e.db.Exec(testCtx(e.t), sql, args...); err != nil {
		e.t.Fatalf("%s: %v", strings.Fields(sql)[0:3], err)
	}
}

// reservation writes a reservation as the FLEET_RESV projector does.
func (e *env) reservation(id, owner string, spec *fleetpb.ReservationSpec, at time.Time) {
	e.t.Helper()
	labels, _ := json.Marshal(spec.GetLabels())
	if spec.GetLabels() == nil {
		labels = []byte("{}")
	}
	e.exec(`insert into fleet_reservations (id, pool, gpus, nodes, model, labels, min_gpu_memory_mib, owner, requested_at)
		values ($1, $2, $3, $4, $5, $6, $7, $8, $9)`,
		id, spec.GetPool(), int(spec.GetGpus()), int(spec.GetNodes()), spec.GetModel(), labels, int64(spec.GetMinGpuMemoryMib()), owner, at)
}

type alloc struct {
	id, node string
	gpus     []int32
	whole    bool
}

// place writes a placement and its allocations as the placer does.
func (e *env) place(resID, pool string, at time.Time, allocs ...alloc) {
	e.t.Helper()
	e.exec(`insert into fleet_placements (reservation_id, decision_id, placed_at) values ($1, $2, $3)`, resID, "d-"+resID, at)
	for _, a := range allocs {
		e.exec(`insert into fleet_allocations (id, reservation_id, pool, node_id, gpu_indices, whole_node, decision_id, placed_at)
			values ($1, $2, $3, $4, $5, $6, $7, $8)`, a.id, resID, pool, a.node, a.gpus, a.whole, "d-"+resID, at)
	}
}

// report writes what a node said of an allocation. The node is of the
// allocation's pool, or of a100 when the allocation is not placed yet.
func (e *env) report(allocID, node, state string, at time.Time) {
	e.t.Helper()
	e.exec(`insert into fleet_allocation_reports (allocation_id, pool, node_id, state, reported_at)
		select $1, coalesce((select pool from fleet_allocations where id = $1), 'a100'), $2, $3, $4
		on conflict (allocation_id, pool, node_id) do update set state = excluded.state, reported_at = excluded.reported_at`, allocID, node, state, at)
}

func (e *env) fail(resID, reason string, at time.Time) {
	e.t.Helper()
	e.exec(`insert into fleet_failures (reservation_id, decision_id, failed_at, reason) values ($1, $2, $3, $4)`, resID, "f-"+resID, at, reason)
}

func (e *env) cancelled(resID string, at time.Time) {
	e.t.Helper()
	e.exec(`update fleet_reservations set cancelled_at = $2 where id = $1`, resID, at)
}

// --- HTTP ---

type httpResult struct {
	status int
	header http.Header
	body   []byte
}

func (e *env) do(method, path, key string, body []byte, hdr ...string) httpResult {
	e.t.Helper()
	req, err := http.NewRequestWithContext(testCtx(e.t), method, e.web.URL+path, bytes.NewReader(body))
	if err != nil {
		e.t.Fatal(err)
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	if body != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(hdr); i += 2 {
		req.Header.Set(hdr[i], hdr[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		e.t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		e.t.Fatal(err)
	}
	return httpResult{status: resp.StatusCode, header: resp.Header, body: b}
}

// apiError decodes an HTTP error body.
func (r httpResult) apiError(t testing.TB) (msg, code string) {
	t.Helper()
	var v struct{ Error, Code string }
	if err := json.Unmarshal(r.body, &v); err != nil {
		t.Fatalf("error body %q is not JSON: %v", r.body, err)
	}
	if v.Error == "" || v.Code == "" {
		t.Fatalf("error body %q lacks error or code", r.body)
	}
	return v.Error, v.Code
}

func (r httpResult) reservation(t testing.TB) *fleetpb.Reservation {
	t.Helper()
	if r.status != http.StatusOK {
		t.Fatalf("HTTP %d: %s", r.status, r.body)
	}
	res := &fleetpb.Reservation{}
	if err := jsonIn.Unmarshal(r.body, res); err != nil {
		t.Fatalf("decode %s: %v", r.body, err)
	}
	return res
}

func spec(pool string, gpus uint32) *fleetpb.ReservationSpec {
	return &fleetpb.ReservationSpec{Pool: pool, Gpus: gpus}
}

// protoDiff is "" when want and got are equal, else both in text form.
func protoDiff(want, got proto.Message) string {
	if proto.Equal(want, got) {
		return ""
	}
	return "want " + prototext.Format(want) + "\n got " + prototext.Format(got)
}

func tsAt(t time.Time) *timestamppb.Timestamp { return timestamppb.New(t) }
