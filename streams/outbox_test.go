package streams_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/placer"
	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// addOutbox inserts rows n0..n0+n-1 in one transaction, spread over three
// pools, and notifies the relay as the placer does when notify is set.
func addOutbox(t *testing.T, pool *pgxpool.Pool, n0, n int, notify bool) []string {
	t.Helper()
	var subs, ids, headers []string
	var bodies [][]byte
	for i := n0; i < n0+n; i++ {
		p := fmt.Sprintf("pool-%d", i%3)
		subs = append(subs, subjects.FleetPlace(p))
		ids = append(ids, fmt.Sprintf("m-%05d", i))
		headers = append(headers, fmt.Sprintf(`{"Millrace-Schema": "fleet.v1", "Millrace-Pool": %q}`, p))
		bodies = append(bodies, []byte(fmt.Sprintf("body-%05d", i)))
	}
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `insert into outbox (subject, msg_id, headers, body)
			select u.s, u.m, u.h::jsonb, u.b from unnest($1::text[], $2::text[], $3::text[], $4::bytea[]) with ordinality as u(s, m, h, b, o)
			order by u.o`, subs, ids, headers, bodies)
		if err == nil && notify {
			_, err = tx.Exec(ctx, "select pg_notify($1, '')", streams.OutboxChannel)
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return ids
}

func outboxLeft(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), "select count(*) from outbox").Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// placeMessages returns the Nats-Msg-Id of every message of FLEET_PLACE in
// stream order, checking each one's headers and body.
func placeMessages(t *testing.T, js jetstream.JetStream) []string {
	t.Helper()
	ctx := context.Background()
	s, err := js.Stream(ctx, subjects.StreamFleetPlace)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for seq := info.State.FirstSeq; seq <= info.State.LastSeq && info.State.Msgs > 0; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatalf("get %d: %v", seq, err)
		}
		id := m.Header.Get(envelope.MsgID)
		var i, p int
		if _, err := fmt.Sscanf(id, "m-%05d", &i); err != nil {
			t.Fatalf("message %d has msg id %q", seq, id)
		}
		p = i % 3
		if string(m.Data) != fmt.Sprintf("body-%05d", i) || m.Subject != subjects.FleetPlace(fmt.Sprintf("pool-%d", p)) ||
			m.Header.Get(envelope.Schema) != "fleet.v1" || m.Header.Get(envelope.Pool) != fmt.Sprintf("pool-%d", p) {
			t.Fatalf("message %d: %s %q %v", seq, m.Subject, m.Data, m.Header)
		}
		out = append(out, id)
	}
	return out
}

func streamCount(t *testing.T, js jetstream.JetStream) uint64 {
	t.Helper()
	s, err := js.Stream(context.Background(), subjects.StreamFleetPlace)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(context.Background())
	if err != nil {
		return 0 // the server may be restarting
	}
	return info.State.Msgs
}

func outboxConfig() streams.OutboxConfig {
	return streams.OutboxConfig{Batch: 100, PollEvery: 20 * time.Millisecond, RetryMin: 10 * time.Millisecond,
		RetryMax: 100 * time.Millisecond, StandbyEvery: 50 * time.Millisecond, Logger: quietLog()}
}

func startOutbox(t *testing.T, o *streams.Outbox) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); o.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); wg.Wait() }) }
	t.Cleanup(stop)
	return stop
}

func TestOutboxPublishesInOrder(t *testing.T) {
	e := setup(t)
	want := addOutbox(t, e.pool, 0, 750, false)
	o := newOutbox(t, e.pool, e.pub, outboxConfig())
	startOutbox(t, o)
	poll.Until(t, "the outbox drained", func() bool { return outboxLeft(t, e.pool) == 0 }, waitWithin)
	// Rows written while it runs, woken by NOTIFY.
	want = append(want, addOutbox(t, e.pool, 750, 120, true)...)
	for i := 870; i < 900; i += 10 {
		want = append(want, addOutbox(t, e.pool, i, 10, true)...)
	}
	poll.Until(t, "the outbox drained again", func() bool { return outboxLeft(t, e.pool) == 0 }, waitWithin)
	if got := placeMessages(t, e.js); !slices.Equal(got, want) {
		t.Fatalf("stream holds %d messages, want %d in outbox order", len(got), len(want))
	}
}

func TestOutboxWakes(t *testing.T) {
	e := setup(t)
	cfg := outboxConfig()
	cfg.PollEvery = time.Hour // only a notification can wake it
	o := newOutbox(t, e.pool, e.pub, cfg)
	startOutbox(t, o)
	poll.Until(t, "the relay to lead", func() bool { return advisoryLocks(t, e.pool) == 1 }, waitWithin)
	addOutbox(t, e.pool, 0, 5, true) // NOTIFY from the writer's transaction
	poll.Until(t, "NOTIFY to wake the relay", func() bool { return streamCount(t, e.js) == 5 }, waitWithin)
	addOutbox(t, e.pool, 5, 5, false)
	o.Notify() // in-process
	poll.Until(t, "Notify to wake the relay", func() bool { return streamCount(t, e.js) == 10 }, waitWithin)
	// A transaction that rolls back notifies nobody and leaves nothing.
	ctx := context.Background()
	tx, _ := e.pool.Begin(ctx)
	tx.Exec(ctx, "insert into outbox (subject, msg_id, body) values ('fleet.place.x', 'rolled-back', '')")
	tx.Exec(ctx, "select pg_notify($1, '')", streams.OutboxChannel)
	tx.Rollback(ctx)
	if got := placeMessages(t, e.js); len(got) != 10 {
		t.Errorf("%d messages", len(got))
	}
}

// TestOutboxFailsMidwayThenRecovers: the stream refuses messages part-way
// through (full, discarding new ones), then takes them again.
func TestOutboxFailsMidwayThenRecovers(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	s, err := e.js.Stream(ctx, subjects.StreamFleetPlace)
	if err != nil {
		t.Fatal(err)
	}
	cfg := s.CachedInfo().Config
	full := cfg
	full.MaxMsgs, full.Discard = 150, jetstream.DiscardNew
	if _, err := e.js.UpdateStream(ctx, full); err != nil {
		t.Fatal(err)
	}
	want := addOutbox(t, e.pool, 0, 420, true)
	reg := prometheus.NewRegistry()
	ocfg := outboxConfig()
	ocfg.Registerer = reg
	ocfg.Metrics = streams.NewMetrics(reg)
	o := newOutbox(t, e.pool, e.pub, ocfg)
	startOutbox(t, o)
	poll.Until(t, "the stream to fill", func() bool { return streamCount(t, e.js) == 150 }, waitWithin)
	poll.Until(t, "the rows after the failure kept", func() bool { return outboxLeft(t, e.pool) == 270 }, waitWithin)
	if _, err := e.js.UpdateStream(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the outbox drained", func() bool { return outboxLeft(t, e.pool) == 0 }, waitWithin)
	if got := placeMessages(t, e.js); !slices.Equal(got, want) {
		t.Fatalf("stream holds %d messages, want %d in outbox order", len(got), len(want))
	}
	if n := testenv.Metric(t, reg, "millrace_consumer_batches_total", `kind="outbox"`, `result="error"`); n == 0 {
		t.Error("no failed attempts counted")
	}
	if n := testenv.Metric(t, reg, "millrace_outbox_reordered_total"); n != 0 {
		t.Errorf("%v messages stored out of order", n)
	}
}

// TestOutboxBackboneRestarts: the server goes away in the middle and
// comes back on the same store and port.
func TestOutboxBackboneRestarts(t *testing.T) {
	dir := t.TempDir()
	ns := testenv.NATSAt(t, dir, -1)
	port := ns.Addr().(*net.TCPAddr).Port
	nc, err := streams.Connect(ns.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	ctx := context.Background()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	pool, _ := testenv.Pool(t)
	want := addOutbox(t, pool, 0, 3000, true)
	cfg := outboxConfig()
	cfg.Batch = 200
	o := newOutbox(t, pool, streams.NewPublisher(js, nil), cfg)
	startOutbox(t, o)
	poll.Until(t, "some published", func() bool { return outboxLeft(t, pool) < 2500 }, waitWithin)
	ns.Shutdown()
	ns.WaitForShutdown()
	left := outboxLeft(t, pool)
	testenv.NATSAt(t, dir, port)
	poll.Until(t, "the outbox drained after the restart", func() bool { return outboxLeft(t, pool) == 0 }, waitWithin)
	t.Logf("%d rows left when the server went away", left)
	if got := placeMessages(t, js); !slices.Equal(got, want) {
		t.Fatalf("stream holds %d messages, want %d in outbox order", len(got), len(want))
	}
}

// crashingPublisher publishes, and after `after` publishes kills the relay
// (cancels its context) before it can delete the rows.
type crashingPublisher struct {
	pub    *streams.Publisher
	n      atomic.Int32
	after  int32
	cancel context.CancelFunc
}

func (c *crashingPublisher) LastMsgID(ctx context.Context, subject string) (string, string, error) {
	return c.pub.LastMsgID(ctx, subject)
}

func (c *crashingPublisher) PublishAsync(msg *nats.Msg) (*streams.Future, error) {
	f, err := c.pub.PublishAsync(msg)
	if c.n.Add(1) == c.after {
		c.cancel()
	}
	return f, err
}

func TestOutboxCrashBetweenPublishAndDelete(t *testing.T) {
	e := setup(t)
	want := addOutbox(t, e.pool, 0, 250, false)
	ctx, cancel := context.WithCancel(context.Background())
	crash := &crashingPublisher{pub: e.pub, after: 180, cancel: cancel}
	cfg := outboxConfig()
	cfg.Batch = 250
	first := newOutbox(t, e.pool, crash, cfg)
	if err := first.Run(ctx); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the crashed relay's messages stored", func() bool { return streamCount(t, e.js) >= 180 }, waitWithin)
	if n := outboxLeft(t, e.pool); n != 250 {
		t.Fatalf("%d rows left after the crash, want all 250 (nothing deleted)", n)
	}
	// The next relay publishes everything again; JetStream drops what it
	// has (same Nats-Msg-Id).
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	startOutbox(t, newOutbox(t, e.pool, e.pub, cfg))
	poll.Until(t, "the outbox drained", func() bool { return outboxLeft(t, e.pool) == 0 }, waitWithin)
	if got := placeMessages(t, e.js); !slices.Equal(got, want) {
		t.Fatalf("stream holds %d messages, want %d once each, in order", len(got), len(want))
	}
	if n := testenv.Metric(t, reg, "millrace_outbox_published_total"); n != 250 {
		t.Errorf("%v publishes, want 250", n)
	}
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if mf.GetName() == "millrace_outbox_published_total" && m.GetLabel()[0].GetValue() == "duplicate" && m.GetCounter().GetValue() < 180 {
				t.Errorf("%v duplicates dropped, want the 180 published before the crash", m.GetCounter().GetValue())
			}
		}
	}
}

// advisoryLocks counts the advisory locks granted in the test's own
// database: pg_locks shows the whole cluster's, and other test packages
// running at the same time hold theirs.
func advisoryLocks(t *testing.T, pool *pgxpool.Pool) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `select count(*) from pg_locks where locktype = 'advisory' and granted
		and database = (select oid from pg_database where datname = current_database())`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

func TestOutboxOneRelayAtATime(t *testing.T) {
	e := setup(t)
	var want []string
	relays := 3
	for i := 0; i < relays; i++ {
		startOutbox(t, newOutbox(t, e.pool, e.pub, outboxConfig()))
	}
	poll.Until(t, "a relay to lead", func() bool { return advisoryLocks(t, e.pool) == 1 }, waitWithin)
	for i := 0; i < 40; i++ {
		want = append(want, addOutbox(t, e.pool, i*25, 25, i%2 == 0)...)
	}
	poll.Until(t, "the outbox drained", func() bool { return outboxLeft(t, e.pool) == 0 }, waitWithin)
	if n := advisoryLocks(t, e.pool); n != 1 {
		t.Errorf("%d relays hold the lock", n)
	}
	if got := placeMessages(t, e.js); !slices.Equal(got, want) {
		t.Fatalf("stream holds %d messages, want %d once each, in order", len(got), len(want))
	}
}

func TestOutboxFlush(t *testing.T) {
	e := setup(t)
	want := addOutbox(t, e.pool, 0, 330, false)
	o := newOutbox(t, e.pool, e.pub, outboxConfig())
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := o.Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if n := outboxLeft(t, e.pool); n != 0 {
		t.Errorf("%d rows left after Flush", n)
	}
	if n := advisoryLocks(t, e.pool); n != 0 {
		t.Errorf("Flush kept the lock")
	}
	// With a relay running elsewhere, Flush waits for it.
	want = append(want, addOutbox(t, e.pool, 330, 200, false)...)
	startOutbox(t, newOutbox(t, e.pool, e.pub, outboxConfig()))
	if err := newOutbox(t, e.pool, e.pub, outboxConfig()).Flush(ctx); err != nil {
		t.Fatal(err)
	}
	if n := outboxLeft(t, e.pool); n != 0 {
		t.Errorf("%d rows left after Flush", n)
	}
	if got := placeMessages(t, e.js); !slices.Equal(got, want) {
		t.Fatalf("stream holds %d messages, want %d in order", len(got), len(want))
	}
	if err := (streams.OutboxConfig{Batch: -1}).Validate(); err == nil {
		t.Error("a negative batch is valid")
	}
}

// Flush looks often whether a relay that leads elsewhere has drained the
// rows, whatever its own PollEvery (a safety net that notifications make
// long).
func TestOutboxFlushWaitsForTheLeaderBriefly(t *testing.T) {
	e := setup(t)
	cfg := outboxConfig()
	cfg.PollEvery = time.Hour
	leader := newOutbox(t, e.pool, e.pub, cfg)
	startOutbox(t, leader)
	poll.Until(t, "the relay to lead", func() bool { return advisoryLocks(t, e.pool) == 1 }, waitWithin)
	want := addOutbox(t, e.pool, 0, 20, false) // no NOTIFY: the leader does not see them yet
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	flusher := newOutbox(t, e.pool, e.pub, cfg)
	flushed := make(chan error, 1)
	go func() { flushed <- flusher.Flush(ctx) }()
	// The leader comes to them late (a sleep that slows it, not a wait
	// for Flush): by then Flush has found them locked and waits.
	time.Sleep(300 * time.Millisecond)
	leader.Notify()
	if err := <-flushed; err != nil {
		t.Fatalf("Flush: %v", err)
	}
	if got := placeMessages(t, e.js); !slices.Equal(got, want) {
		t.Fatalf("stream holds %d messages, want %d in order", len(got), len(want))
	}
}

func quietLog() *slog.Logger { return slog.New(slog.NewTextHandler(io.Discard, nil)) }

// TestPlacerThroughTheBackbone runs the placer under the consumer runner
// on FLEET_RESV, relays its outbox to FLEET_PLACE, and replays both streams
// into the tables with the runner's Replay: the rows equal the live run's.
func TestPlacerThroughTheBackbone(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	for i := 0; i < 8; i++ {
		_, err := e.pool.Exec(ctx, `insert into fleet_nodes (node_id, pool, connected, state, state_since, first_seen, last_seen)
			values ($1, $2, true, 'healthy', now(), now(), now())`, fmt.Sprintf("n%d", i), fmt.Sprintf("p%d", i%2))
		if err == nil {
			_, err = e.pool.Exec(ctx, `insert into fleet_devices (pool, node_id, gpu_index, model, memory_mib)
				select $2, $1, g, 'H100', 81920 from generate_series(0, 3) g`, fmt.Sprintf("n%d", i), fmt.Sprintf("p%d", i%2))
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	publish := func(id, pool string, ev *fleetpb.ReservationEvent) {
		ev.ReservationId, ev.At = id, timestamppb.Now()
		msg := nats.NewMsg(subjects.FleetResv(pool))
		msg.Header.Set(envelope.MsgID, fmt.Sprintf("%s/%T", id, ev.Body))
		msg.Header.Set(envelope.Schema, envelope.SchemaFleetV1)
		msg.Header.Set(envelope.Kind, envelope.KindReservation)
		msg.Header.Set(envelope.Pool, pool)
		msg.Header.Set(envelope.Reservation, id)
		msg.Data, _ = proto.Marshal(ev)
		if err := e.pub.Publish(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	request := func(id, pool string, gpus int) {
		publish(id, pool, &fleetpb.ReservationEvent{Body: &fleetpb.ReservationEvent_Requested{Requested: &fleetpb.ReservationRequested{
			Spec: &fleetpb.ReservationSpec{Pool: pool, Gpus: uint32(gpus)}}}})
	}
	cancel := func(id, pool string) {
		publish(id, pool, &fleetpb.ReservationEvent{Body: &fleetpb.ReservationEvent_Cancelled{Cancelled: &fleetpb.ReservationCancelled{}}})
	}

	p, err := placer.New(placer.Config{Logger: quietLog()})
	if err != nil {
		t.Fatal(err)
	}
	cfg := streams.RunnerConfig{Stream: subjects.StreamFleetResv, Filter: subjects.FleetResvFilter, Batch: 50,
		MaxWait: 20 * time.Millisecond, RetryMin: 10 * time.Millisecond, RetryMax: 50 * time.Millisecond,
		SweepEvery: 100 * time.Millisecond, Logger: quietLog()}
	stopRunner := start(t, e, p, cfg)
	stopRelay := startOutbox(t, newOutbox(t, e.pool, e.pub, outboxConfig()))

	const n = 120
	for i := 0; i < n; i++ {
		pool := fmt.Sprintf("p%d", i%2)
		request(fmt.Sprintf("r%03d", i), pool, 1+i%4)
		if i%3 == 2 {
			cancel(fmt.Sprintf("r%03d", i-2), fmt.Sprintf("p%d", (i-2)%2))
		}
	}
	rs, err := e.js.Stream(ctx, subjects.StreamFleetResv)
	if err != nil {
		t.Fatal(err)
	}
	end := rs.CachedInfo().State.LastSeq
	poll.Until(t, "every reservation event applied and the outbox drained", func() bool {
		var left int
		e.pool.QueryRow(ctx, "select count(*) from outbox").Scan(&left)
		return e.position(t, placer.ConsumerName) == end && left == 0
	}, waitWithin)

	stopRunner()
	// A sweep may have decided more since: publish everything first, as
	// `millrace replay fleet` must before it resets the tables.
	fctx, fcancel := context.WithTimeout(ctx, 20*time.Second)
	defer fcancel()
	if err := newOutbox(t, e.pool, e.pub, outboxConfig()).Flush(fctx); err != nil {
		t.Fatal(err)
	}
	stopRelay()
	var placed, decisions int
	e.pool.QueryRow(ctx, "select count(*) from fleet_placements").Scan(&placed)
	s, _ := e.js.Stream(ctx, subjects.StreamFleetPlace)
	info, _ := s.Info(ctx)
	decisions = int(info.State.Msgs)
	if placed == 0 || decisions < placed {
		t.Fatalf("%d placements, %d decisions published", placed, decisions)
	}
	live, err := placer.Digest(ctx, e.pool)
	if err != nil {
		t.Fatal(err)
	}

	rcfg := cfg
	if err := newRunner(t, e.js, e.pool, placer.NewRequests(), rcfg, streams.NewMetrics(nil)).Replay(ctx); err != nil {
		t.Fatal(err)
	}
	dcfg := cfg
	dcfg.Stream, dcfg.Filter = subjects.StreamFleetPlace, subjects.FleetPlaceFilter
	if err := newRunner(t, e.js, e.pool, placer.NewDecisions(), dcfg, streams.NewMetrics(nil)).Replay(ctx); err != nil {
		t.Fatal(err)
	}
	replayed, err := placer.Digest(ctx, e.pool)
	if err != nil {
		t.Fatal(err)
	}
	for table, sum := range live {
		if replayed[table] != sum {
			t.Errorf("%s differs after replay", table)
		}
	}
	t.Logf("%d decisions, %d placements", decisions, placed)
}

// A relay that stopped between publish and delete for longer than the
// stream's duplicate window: JetStream no longer knows the msg ids of what
// it stored, so the next relay must find them stored (the stream's last
// message is one of its rows) and skip them, not store them again.
func TestOutboxResumesAfterTheDuplicateWindow(t *testing.T) {
	e := setup(t)
	ctx := context.Background()
	window := 200 * time.Millisecond
	if err := streams.Apply(ctx, e.js, streams.StreamSpecs(streams.Config{DuplicateWindow: window})); err != nil {
		t.Fatal(err)
	}
	want := addOutbox(t, e.pool, 0, 250, false)
	crashCtx, cancel := context.WithCancel(ctx)
	crash := &crashingPublisher{pub: e.pub, after: 180, cancel: cancel}
	cfg := outboxConfig()
	cfg.Batch = 250
	if err := newOutbox(t, e.pool, crash, cfg).Run(crashCtx); err != nil {
		t.Fatal(err)
	}
	// The relay may hand a few more rows to the publisher after the
	// crash's cancel, before it notices: wait for every one it handed
	// over (Run has returned, so the count is final) to be stored, or a
	// late one would land after the count below and look like the probe's.
	handed := uint64(crash.n.Load())
	poll.Until(t, "the crashed relay's messages stored", func() bool { return streamCount(t, e.js) == handed }, waitWithin)
	stored := streamCount(t, e.js)
	// Wait until JetStream has forgotten the first row's msg id: a probe
	// with that id and an expected last msg id that cannot match is a
	// duplicate (nothing stored) while the id is remembered, and refused
	// (nothing stored either) once it is not.
	poll.Until(t, "the duplicate window to pass", func() bool {
		probe := nats.NewMsg(subjects.FleetPlace("pool-0"))
		probe.Header.Set(envelope.MsgID, want[0])
		probe.Header.Set(jetstream.ExpectedLastMsgIDHeader, "no-such-message")
		_, err := e.js.PublishMsg(ctx, probe)
		return err != nil
	}, waitWithin)

	if n := streamCount(t, e.js); n != stored {
		t.Fatalf("the probe stored a message: %d, want %d", n, stored)
	}
	reg := prometheus.NewRegistry()
	cfg.Registerer = reg
	startOutbox(t, newOutbox(t, e.pool, e.pub, cfg))
	poll.Until(t, "the outbox drained", func() bool { return outboxLeft(t, e.pool) == 0 }, waitWithin)
	if got := placeMessages(t, e.js); !slices.Equal(got, want) {
		t.Fatalf("stream holds %d messages, want %d once each, in order", len(got), len(want))
	}
	if n := testenv.Metric(t, reg, "millrace_outbox_published_total"); n != 250 {
		t.Errorf("%v rows relayed, want 250", n)
	}
}
