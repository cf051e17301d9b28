package streams_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/internal/devdb"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/migrations"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// The fault suite of the consumer core: every fault, against every user
// of the core (the runner, the outbox relay, the export, the commit log's
// fold), with the same
// checks afterwards: nothing lost, nothing effected twice (beyond the
// resends a user's contract allows: the export sends again what was in
// flight when it stopped), effects in order, and the position, read where
// it lives, never going back.

// faultEnv is one case's world: a JetStream server that can be restarted
// on its store and port, and a database (on a private PostgreSQL cluster
// when the case restarts it).
type faultEnv struct {
	t    *testing.T
	dir  string
	port int
	ns   *server.Server
	js   jetstream.JetStream
	pool *pgxpool.Pool
	pg   *devdb.Server
	kv   jetstream.KeyValue
	pub  *streams.Publisher
}

func newFaultEnv(t *testing.T, privatePG bool) *faultEnv {
	t.Helper()
	e := &faultEnv{t: t, dir: t.TempDir()}
	e.ns = testenv.NATSAt(t, e.dir, -1)
	e.port = e.ns.Addr().(*net.TCPAddr).Port
	nc, err := streams.Connect(e.ns.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	e.js, _ = jetstream.New(nc)
	ctx := context.Background()
	if err := streams.Apply(ctx, e.js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	e.kv = leaseBucket(t, e.js)
	e.pub = streams.NewPublisher(e.js, nil)
	if privatePG {
		e.pg, e.pool = privatePool(t)
	} else {
		e.pool, _ = testenv.Pool(t)
	}
	if _, err := e.pool.Exec(ctx, `create table runner_rows (consumer text, seq bigint, body text check (body <> 'bad'), primary key (consumer, seq))`); err != nil {
		t.Fatal(err)
	}
	return e
}

func privatePool(t *testing.T) (*devdb.Server, *pgxpool.Pool) {
	t.Helper()
	ctx := context.Background()
	pg, err := devdb.StartPrivate(ctx, filepath.Join(t.TempDir(), "pg"))
	if err != nil {
		t.Fatalf("private postgres: %v", err)
	}
	t.Cleanup(func() { pg.Stop(context.Background()) })
	if _, _, err := migrations.ApplyURL(ctx, pg.URL); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pg, pool
}

func (e *faultEnv) restartNATS() {
	e.ns.Shutdown()
	e.ns.WaitForShutdown()
	e.ns = testenv.NATSAt(e.t, e.dir, e.port)
}

func (e *faultEnv) restartPG() {
	ctx := context.Background()
	if err := e.pg.Stop(ctx); err != nil {
		e.t.Fatal(err)
	}
	if err := e.pg.Start(ctx); err != nil {
		e.t.Fatal(err)
	}
}

// gate holds the first effect after arm until open: a batch in flight.
type gate struct {
	mu      sync.Mutex
	armed   bool
	blocked chan struct{}
	opened  chan struct{}
}

func (g *gate) arm() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.armed, g.blocked, g.opened = true, make(chan struct{}), make(chan struct{})
}

// pass blocks the first caller after arm until open.
func (g *gate) pass() {
	g.mu.Lock()
	if !g.armed {
		g.mu.Unlock()
		return
	}
	g.armed = false
	blocked, opened := g.blocked, g.opened
	g.mu.Unlock()
	close(blocked)
	<-opened
}

func (g *gate) waitBlocked(t *testing.T) {
	t.Helper()
	select {
	case <-g.blocked:
	case <-time.After(20 * time.Second):
		t.Fatal("nothing reached the gate")
	}
}

func (g *gate) open() { close(g.opened) }

// instance is one process of a user.
type instance struct {
	stop func()
	reg  *prometheus.Registry
}

func (i instance) active(t *testing.T) float64 {
	return testenv.Metric(t, i.reg, "millrace_consumer_active")
}

// faultUser is a user of the core as the suite drives it.
type faultUser interface {
	start(t *testing.T, e *faultEnv) instance
	// feed adds n items to consume.
	feed(t *testing.T, e *faultEnv, n int)
	// want is every item fed, in order; effects what was effected, in
	// order, repeats included.
	want() []string
	effects(t *testing.T, e *faultEnv) []string
	// position is read where the user's position lives (false: unreadable
	// now).
	position(e *faultEnv) (uint64, bool)
	// durable is the user's durable consumer ("" for the outbox).
	durable() (stream, name string)
	// kill makes the holder lose its lease; take has another holder take
	// it, until the function it returns gives it back.
	kill(t *testing.T, e *faultEnv)
	take(t *testing.T, e *faultEnv) (giveBack func())
	gate() *gate
	// beforeFault is called just before a fault; mayRepeat says whether
	// item x may be effected again after it (the export sends again what
	// was above its position, never what was at or below it).
	beforeFault(e *faultEnv)
	mayRepeat(x string) bool
	check(t *testing.T, e *faultEnv)
}

// heldBackend is the backend holding the test database's one advisory lock.
func heldBackend(t *testing.T, e *faultEnv) (int, bool) {
	var pid int
	err := e.pool.QueryRow(context.Background(), `select pid from pg_locks where locktype = 'advisory' and granted
		and database = (select oid from pg_database where datname = current_database())`).Scan(&pid)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return pid, true
}

func pgKill(t *testing.T, e *faultEnv) int {
	t.Helper()
	var pid int
	poll.Until(t, "a holder of the lock", func() bool {
		var ok bool
		pid, ok = heldBackend(t, e)
		return ok
	}, waitWithin)

	if _, err := e.pool.Exec(context.Background(), "select pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	return pid
}

// pgTake terminates the holder's backend and takes the lock itself.
func pgTake(t *testing.T, e *faultEnv, key string) func() {
	t.Helper()
	pgKill(t, e)
	var h *streams.PGHeld
	poll.Until(t, "the lock taken by another holder", func() bool {
		var err error
		h, err = streams.NewPGLease(e.pool, key).AcquirePG(context.Background())
		return err == nil
	}, waitWithin)

	return func() { h.Release(context.Background()) }
}

// runnerUser: the runner with a projector writing runner_rows.
type runnerUser struct {
	g   gate
	fed []string
}

type gatedRows struct {
	rowsProjector
	g *gate
}

func (p *gatedRows) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	p.g.pass()
	return p.rowsProjector.Apply(ctx, tx, batch)
}

func (u *runnerUser) start(t *testing.T, e *faultEnv) instance {
	reg := prometheus.NewRegistry()
	cfg := runnerConfig()
	cfg.StandbyEvery, cfg.Logger = 50*time.Millisecond, quietLog()
	r := newRunner(t, e.js, e.pool, &gatedRows{rowsProjector{name: "rows"}, &u.g}, cfg, streams.NewMetrics(reg))
	return run(t, reg, r.Run)
}

func run(t *testing.T, reg *prometheus.Registry, f func(context.Context) error) instance {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); f(ctx) }()
	var once sync.Once
	stop := func() { once.Do(func() { cancel(); <-done }) }
	t.Cleanup(stop)
	return instance{stop: stop, reg: reg}
}

func (u *runnerUser) feed(t *testing.T, e *faultEnv, n int) {
	t.Helper()
	for range n {
		b := "r" + strconv.Itoa(len(u.fed))
		msg := nats.NewMsg(subjects.BES("p", "inv"))
		msg.Header.Set("Nats-Msg-Id", t.Name()+"/"+b)
		msg.Data = []byte(b)
		poll.Until(t, "a publish", func() bool { return e.pub.Publish(context.Background(), msg) == nil }, waitWithin)
		u.fed = append(u.fed, b)
	}
}

func (u *runnerUser) want() []string { return u.fed }

func (u *runnerUser) effects(t *testing.T, e *faultEnv) []string {
	rows, err := e.pool.Query(context.Background(), "select body from runner_rows where consumer = 'rows' order by seq")
	if err != nil {
		return nil // the database may be restarting
	}
	out, _ := pgx.CollectRows(rows, pgx.RowTo[string])
	return out
}

func (u *runnerUser) position(e *faultEnv) (uint64, bool) {
	var pos int64
	err := e.pool.QueryRow(context.Background(), "select stream_seq from consumer_positions where consumer = 'rows'").Scan(&pos)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, true
	}
	return uint64(pos), err == nil
}

func (u *runnerUser) durable() (string, string)      { return subjects.StreamBES, "rows" }
func (u *runnerUser) kill(t *testing.T, e *faultEnv) { pgKill(t, e) }
func (u *runnerUser) take(t *testing.T, e *faultEnv) func() {
	return pgTake(t, e, "millrace.consumer.rows")
}
func (u *runnerUser) gate() *gate           { return &u.g }
func (u *runnerUser) beforeFault(*faultEnv) {}
func (u *runnerUser) mayRepeat(string) bool { return false }
func (u *runnerUser) check(t *testing.T, e *faultEnv) {
	// A message applied twice breaks runner_rows' primary key, a data
	// error that would park it in DEAD.
	if d := deadLetters(t, e.js, "rows"); len(d) != 0 {
		t.Errorf("dead letters %v, want none", d)
	}
}

// outboxUser: the relay of outbox rows to FLEET_PLACE.
type outboxUser struct {
	g   gate
	fed []string
	mu  sync.Mutex
	top int64 // the highest row id fed
}

type gatedPublisher struct {
	pub *streams.Publisher
	g   *gate
}

func (p *gatedPublisher) LastMsgID(ctx context.Context, subject string) (string, string, error) {
	return p.pub.LastMsgID(ctx, subject)
}

func (p *gatedPublisher) PublishAsync(msg *nats.Msg) (*streams.Future, error) {
	p.g.pass()
	return p.pub.PublishAsync(msg)
}

func (u *outboxUser) start(t *testing.T, e *faultEnv) instance {
	reg := prometheus.NewRegistry()
	cfg := outboxConfig()
	cfg.Batch, cfg.Metrics = 20, streams.NewMetrics(reg)
	o := newOutbox(t, e.pool, &gatedPublisher{e.pub, &u.g}, cfg)
	return run(t, reg, o.Run)
}

func (u *outboxUser) feed(t *testing.T, e *faultEnv, n int) {
	t.Helper()
	var ids []string
	poll.Until(t, "rows written", func() bool {
		defer func() { recover() }()
		ids = addOutboxTx(e.pool, len(u.fed), n)
		return ids != nil
	}, waitWithin)

	u.fed = append(u.fed, ids...)
	var top int64
	e.pool.QueryRow(context.Background(), "select coalesce(max(id), 0) from outbox").Scan(&top)
	u.mu.Lock()
	u.top = max(u.top, top)
	u.mu.Unlock()
}

// addOutboxTx is addOutbox returning nil rather than failing (the database
// may be restarting).
func addOutboxTx(pool *pgxpool.Pool, n0, n int) []string {
	var subs, ids, headers []string
	var bodies [][]byte
	for i := n0; i < n0+n; i++ {
		subs = append(subs, subjects.FleetPlace("pool-"+strconv.Itoa(i%3)))
		ids = append(ids, fmt.Sprintf("m-%05d", i))
		headers = append(headers, `{"Millrace-Schema": "fleet.v1"}`)
		bodies = append(bodies, []byte(fmt.Sprintf("body-%05d", i)))
	}
	ctx := context.Background()
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `insert into outbox (subject, msg_id, headers, body)
			select u.s, u.m, u.h::jsonb, u.b from unnest($1::text[], $2::text[], $3::text[], $4::bytea[]) with ordinality as u(s, m, h, b, o)
			order by u.o`, subs, ids, headers, bodies)
		if err == nil {
			_, err = tx.Exec(ctx, "select pg_notify($1, '')", streams.OutboxChannel)
		}
		return err
	})
	if err != nil {
		return nil
	}
	return ids
}

func (u *outboxUser) want() []string { return u.fed }

func (u *outboxUser) effects(t *testing.T, e *faultEnv) []string {
	ctx := context.Background()
	s, err := e.js.Stream(ctx, subjects.StreamFleetPlace)
	if err != nil {
		return nil
	}
	info, err := s.Info(ctx)
	if err != nil {
		return nil
	}
	var out []string
	for seq := info.State.FirstSeq; seq > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if err != nil {
			return nil
		}
		out = append(out, m.Header.Get("Nats-Msg-Id"))
	}
	return out
}

// position: every row up to it is deleted (published).
func (u *outboxUser) position(e *faultEnv) (uint64, bool) {
	u.mu.Lock()
	top := u.top
	u.mu.Unlock()
	var pos int64
	err := e.pool.QueryRow(context.Background(), "select coalesce((select min(id) from outbox) - 1, $1)", top).Scan(&pos)
	return uint64(pos), err == nil
}

func (u *outboxUser) durable() (string, string)             { return "", "" }
func (u *outboxUser) kill(t *testing.T, e *faultEnv)        { pgKill(t, e) }
func (u *outboxUser) take(t *testing.T, e *faultEnv) func() { return pgTake(t, e, "millrace.outbox") }
func (u *outboxUser) gate() *gate                           { return &u.g }
func (u *outboxUser) beforeFault(*faultEnv)                 {}
func (u *outboxUser) mayRepeat(string) bool                 { return false }
func (u *outboxUser) check(t *testing.T, e *faultEnv) {
	// Stored, then deleted: the rows go a moment after the last is stored.
	poll.Until(t, "every row deleted", func() bool { return outboxLeft(t, e.pool) == 0 }, waitWithin)
}

// exportUser: the export of BES to an exporter that records what it is
// sent, acknowledging at once unless gated.
type exportUser struct {
	g     gate
	fed   []string
	exp   recordingExporter
	floor uint64 // the position before the fault
}

type recordingExporter struct {
	mu   sync.Mutex
	sent []string
	g    *gate
	held []func(error)
	hold bool
}

func (x *recordingExporter) Send(ctx context.Context, r *projection.Record, done func(error)) error {
	x.mu.Lock()
	x.sent = append(x.sent, strconv.FormatUint(r.Seq, 10))
	x.g.mu.Lock()
	armed := x.g.armed
	if armed {
		x.g.armed, x.hold = false, true
		close(x.g.blocked)
	}
	x.g.mu.Unlock()
	if x.hold {
		x.held = append(x.held, done)
		x.mu.Unlock()
		return nil
	}
	x.mu.Unlock()
	done(nil)
	return nil
}

// release acknowledges what was held, in order, and stops holding.
func (x *recordingExporter) release() {
	x.mu.Lock()
	held := x.held
	x.held, x.hold = nil, false
	x.mu.Unlock()
	for _, done := range held {
		done(nil)
	}
}

func newExportUser() *exportUser {
	u := &exportUser{}
	u.exp.g = &u.g
	return u
}

func (u *exportUser) start(t *testing.T, e *faultEnv) instance {
	reg := prometheus.NewRegistry()
	r := newExportRunner(t, e.js, &u.exp, streams.ExportConfig{Stream: subjects.StreamBES, MaxInFlight: 100,
		RetryMin: 10 * time.Millisecond, RetryMax: 100 * time.Millisecond, StandbyEvery: 50 * time.Millisecond,
		Metrics: streams.NewMetrics(reg), Logger: quietLog()}, nil)
	return run(t, reg, r.Run)
}

func (u *exportUser) feed(t *testing.T, e *faultEnv, n int) {
	t.Helper()
	for range n {
		msg := nats.NewMsg(subjects.BES("p", "inv"))
		msg.Header.Set("Nats-Msg-Id", t.Name()+"/"+strconv.Itoa(len(u.fed)))
		var ack *jetstream.PubAck
		poll.Until(t, "a publish", func() bool {
			var err error
			ack, err = e.js.PublishMsg(context.Background(), msg)
			return err == nil
		}, waitWithin)

		u.fed = append(u.fed, strconv.FormatUint(ack.Sequence, 10))
	}
}

func (u *exportUser) want() []string { return u.fed }

func (u *exportUser) effects(t *testing.T, e *faultEnv) []string {
	u.exp.mu.Lock()
	defer u.exp.mu.Unlock()
	return slices.Clone(u.exp.sent)
}

// position is the consumer's ack floor. Deleting the consumer deletes the
// position with it: a consumer just made again, before Attach moved it to
// where the export had acked (floor and deliveries 0), holds none yet.
func (u *exportUser) position(e *faultEnv) (uint64, bool) {
	c, err := e.js.Consumer(context.Background(), subjects.StreamBES, "export-bes")
	if err != nil {
		return 0, false
	}
	ci := c.CachedInfo()
	return ci.AckFloor.Stream, ci.AckFloor.Stream != 0 || ci.Delivered.Stream != 0
}

func (u *exportUser) durable() (string, string) { return subjects.StreamBES, "export-bes" }
func (u *exportUser) kill(t *testing.T, e *faultEnv) {
	kvKill(t, e, streams.ExportLeaseKey("export-bes"))
}
func (u *exportUser) take(t *testing.T, e *faultEnv) func() {
	return kvTake(t, e, streams.ExportLeaseKey("export-bes"))
}
func (u *exportUser) gate() *gate { return &u.g }
func (u *exportUser) beforeFault(e *faultEnv) {
	if p, ok := u.position(e); ok && u.floor == 0 {
		u.floor = p
	}
}
func (u *exportUser) mayRepeat(x string) bool {
	seq, _ := strconv.ParseUint(x, 10, 64)
	return seq > u.floor
}
func (u *exportUser) check(*testing.T, *faultEnv) {}

func kvKill(t *testing.T, e *faultEnv, key string) {
	t.Helper()
	poll.Until(t, "a holder of the lease", func() bool { _, err := e.kv.Get(context.Background(), key); return err == nil }, waitWithin)
	if err := e.kv.Delete(context.Background(), key); err != nil {
		t.Fatal(err)
	}
}

func kvTake(t *testing.T, e *faultEnv, key string) func() {
	t.Helper()
	ctx := context.Background()
	if _, err := e.kv.Put(ctx, key, []byte("another holder")); err != nil {
		t.Fatal(err)
	}
	// Kept alive, as its holder would.
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(leaseTTL / 4):
				e.kv.Put(ctx, key, []byte("another holder"))
			}
		}
	}()
	return func() {
		close(stop)
		<-done
		e.kv.Delete(ctx, key)
	}
}

// monitor samples the position until stop, and reports a step back.
func monitor(t *testing.T, e *faultEnv, u faultUser) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	var back error
	wg.Add(1)
	go func() {
		defer wg.Done()
		var last uint64
		for {
			select {
			case <-done:
				return
			case <-time.After(5 * time.Millisecond):
			}
			if p, ok := u.position(e); ok {
				if p < last && back == nil {
					back = fmt.Errorf("the position went back from %d to %d", last, p)
				}
				last = max(last, p)
			}
		}
	}()
	return func() {
		close(done)
		wg.Wait()
		if back != nil {
			t.Error(back)
		}
	}
}

func waitAll(t *testing.T, e *faultEnv, u faultUser) {
	t.Helper()
	poll.Until(t, "every item effected", func() bool {
		have := map[string]bool{}
		for _, x := range u.effects(t, e) {
			have[x] = true
		}
		for _, x := range u.want() {
			if !have[x] {
				return false
			}
		}
		return true
	}, waitWithin)

}

// verify: nothing lost, nothing twice but what the user may resend, in
// order of first effect.
func verify(t *testing.T, e *faultEnv, u faultUser) {
	t.Helper()
	waitAll(t, e, u)
	got := u.effects(t, e)
	seen := map[string]bool{}
	var first []string
	for _, x := range got {
		if seen[x] && !u.mayRepeat(x) {
			t.Errorf("%s effected twice", x)
		}
		if !seen[x] {
			first = append(first, x)
		}
		seen[x] = true
	}
	if !slices.Equal(first, u.want()) {
		t.Errorf("effected %d items (%d distinct), want the %d fed in order", len(got), len(first), len(u.want()))
	}
	u.check(t, e)
}

type faultCase struct {
	name      string
	privatePG bool
	// skip says why the fault does not apply to u ("": it does).
	skip func(u faultUser) string
	run  func(t *testing.T, e *faultEnv, u faultUser)
}

func always(faultUser) string { return "" }

func hasDurable(u faultUser) string {
	if _, name := u.durable(); name == "" {
		return "the outbox reads no stream"
	}
	return ""
}

func inPostgres(u faultUser) string {
	switch u.(type) {
	case *exportUser:
		return "the export's position is not in PostgreSQL"
	case *foldUser:
		return "the fold's position is not in PostgreSQL"
	}
	return ""
}

var faultCases = []faultCase{
	{"durable consumer deleted", false, hasDurable, func(t *testing.T, e *faultEnv, u faultUser) {
		stream, name := u.durable()
		u.start(t, e)
		u.feed(t, e, 150)
		poll.Until(t, "some effected", func() bool { return len(u.effects(t, e)) > 0 }, waitWithin)
		u.beforeFault(e)
		if err := e.js.DeleteConsumer(context.Background(), stream, name); err != nil {
			t.Fatal(err)
		}
		u.feed(t, e, 50)
	}},
	{"lease lost", false, always, func(t *testing.T, e *faultEnv, u faultUser) {
		u.start(t, e)
		u.feed(t, e, 150)
		poll.Until(t, "some effected", func() bool { return len(u.effects(t, e)) > 0 }, waitWithin)
		u.beforeFault(e)
		u.kill(t, e)
		u.feed(t, e, 50)
	}},
	{"lease taken by another holder", false, always, func(t *testing.T, e *faultEnv, u faultUser) {
		in := u.start(t, e)
		u.feed(t, e, 20)
		waitAll(t, e, u)
		g := u.gate()
		g.arm()
		u.feed(t, e, 30)
		g.waitBlocked(t)
		if _, ok := u.(*exportUser); ok {
			// What came before the gated record is acknowledged already,
			// and is acked on the stream within AckEvery.
			poll.Until(t, "the records before the gate acked", func() bool { p, _ := u.position(e); return p == 20 }, waitWithin)
		}
		before, _ := u.position(e)
		u.beforeFault(e)
		giveBack := u.take(t, e)
		g.open()
		if x, ok := any(u).(*exportUser); ok {
			x.exp.release() // the other system acknowledges what it was sent
		}
		poll.Until(t, "the holder to stand down", func() bool { return in.active(t) == 0 }, waitWithin)
		if p, _ := u.position(e); p != before {
			t.Errorf("the position moved from %d to %d after another holder took the lease", before, p)
		}
		giveBack()
		u.feed(t, e, 20)
		poll.Until(t, "the holder to lead again", func() bool { return in.active(t) == 1 }, waitWithin)
	}},
	{"backbone restarted", false, always, func(t *testing.T, e *faultEnv, u faultUser) {
		u.start(t, e)
		u.feed(t, e, 150)
		poll.Until(t, "some effected", func() bool { return len(u.effects(t, e)) > 0 }, waitWithin)
		u.beforeFault(e)
		e.restartNATS()
		u.feed(t, e, 50)
	}},
	{"database restarted", true, inPostgres, func(t *testing.T, e *faultEnv, u faultUser) {
		u.start(t, e)
		u.feed(t, e, 150)
		poll.Until(t, "some effected", func() bool { return len(u.effects(t, e)) > 0 }, waitWithin)
		u.beforeFault(e)
		e.restartPG()
		u.feed(t, e, 50)
	}},
	{"shutdown mid-batch", false, always, func(t *testing.T, e *faultEnv, u faultUser) {
		first := u.start(t, e)
		g := u.gate()
		g.arm()
		u.feed(t, e, 60)
		g.waitBlocked(t)
		u.beforeFault(e)
		stopped := make(chan struct{})
		go func() { first.stop(); close(stopped) }()
		if x, ok := any(u).(*exportUser); ok {
			<-stopped // the export does not wait for the other system to stop
			x.exp.release()
		} else {
			g.open()
			<-stopped
		}
		u.start(t, e)
		u.feed(t, e, 20)
	}},
	{"two instances at once", false, always, func(t *testing.T, e *faultEnv, u faultUser) {
		a, b := u.start(t, e), u.start(t, e)
		u.feed(t, e, 100)
		waitAll(t, e, u)
		if n := a.active(t) + b.active(t); n != 1 {
			t.Fatalf("%v instances lead, want 1", n)
		}
		leader, standby := a, b
		if b.active(t) == 1 {
			leader, standby = b, a
		}
		u.feed(t, e, 100)
		u.beforeFault(e)
		leader.stop()
		poll.Until(t, "the standby to lead", func() bool { return standby.active(t) == 1 }, waitWithin)
		u.feed(t, e, 20)
	}},
}

// TestConsumerCoreFaults runs every fault against every user of the core.
func TestConsumerCoreFaults(t *testing.T) {
	users := []struct {
		name string
		make func() faultUser
	}{
		{"runner", func() faultUser { return &runnerUser{} }},
		{"outbox", func() faultUser { return &outboxUser{} }},
		{"export", func() faultUser { return newExportUser() }},
		{"fold", func() faultUser { return newFoldUser() }},
	}
	for _, fc := range faultCases {
		for _, us := range users {
			t.Run(fc.name+"/"+us.name, func(t *testing.T) {
				u := us.make()
				if why := fc.skip(u); why != "" {
					t.Skip(why)
				}
				if fc.privatePG && testing.Short() {
					t.Skip("starts a private PostgreSQL cluster")
				}
				e := newFaultEnv(t, fc.privatePG)
				stop := monitor(t, e, u)
				fc.run(t, e, u)
				verify(t, e, u)
				stop()
			})
		}
	}
}
