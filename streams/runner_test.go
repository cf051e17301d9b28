package streams_test

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.DropTemplate()
	os.Exit(code)
}

// rowsProjector writes one row per message. Bodies steer it: "poison" is
// refused as a poison message, "bad" breaks a CHECK constraint (a data
// error the runner must isolate), "flaky" fails transiently the first
// `flaky` times it is seen.
type rowsProjector struct {
	name     string
	flaky    atomic.Int32
	applies  atomic.Int32
	resets   atomic.Int32
	slowdown time.Duration
}

func (p *rowsProjector) Name() string { return p.name }

func (p *rowsProjector) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	p.applies.Add(1)
	if p.slowdown > 0 {
		time.Sleep(p.slowdown)
	}
	seqs := make([]int64, 0, len(batch))
	bodies := make([]string, 0, len(batch))
	for _, m := range batch {
		switch string(m.Data()) {
		case "poison":
			return projection.Poison(m, errors.New("test poison"))
		case "flaky":
			if p.flaky.Add(-1) >= 0 {
				return errors.New("transient test failure")
			}
		}
		seqs = append(seqs, int64(m.Seq()))
		bodies = append(bodies, string(m.Data()))
	}
	_, err := tx.Exec(ctx, `insert into runner_rows (consumer, seq, body) select $1, * from unnest($2::bigint[], $3::text[])`, p.name, seqs, bodies)
	return err
}

func (p *rowsProjector) Reset(ctx context.Context, tx pgx.Tx) error {
	p.resets.Add(1)
	_, err := tx.Exec(ctx, "delete from runner_rows where consumer = $1", p.name)
	return err
}

type env struct {
	js   jetstream.JetStream
	nc   *nats.Conn
	pool *pgxpool.Pool
	pub  *streams.Publisher
}

func setup(t *testing.T) *env {
	t.Helper()
	ns := testenv.NATS(t)
	nc, err := streams.Connect(ns.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	pool, _ := testenv.Pool(t)
	// The primary key makes a double apply fail loudly.
	_, err = pool.Exec(ctx, `create table runner_rows (consumer text, seq bigint, body text check (body <> 'bad'), primary key (consumer, seq))`)
	if err != nil {
		t.Fatal(err)
	}
	return &env{js: js, nc: nc, pool: pool, pub: streams.NewPublisher(js, nil)}
}

func (e *env) publish(t *testing.T, bodies ...string) {
	t.Helper()
	ctx := context.Background()
	for i, b := range bodies {
		msg := nats.NewMsg(subjects.BES("p", "inv"))
		msg.Header.Set(envelope.MsgID, fmt.Sprintf("%s-%d-%d", t.Name(), time.Now().UnixNano(), i))
		msg.Data = []byte(b)
		if err := e.pub.Publish(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
}

func (e *env) rows(t *testing.T, consumer string) []string {
	t.Helper()
	rows, err := e.pool.Query(context.Background(), "select body from runner_rows where consumer = $1 order by seq", consumer)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func (e *env) position(t *testing.T, consumer string) uint64 {
	var pos int64
	err := e.pool.QueryRow(context.Background(), "select stream_seq from consumer_positions where consumer = $1", consumer).Scan(&pos)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0
	}
	if err != nil {
		t.Fatal(err)
	}
	return uint64(pos)
}

// newRunner, newOutbox and newExportRunner make a consumer of a config
// the test means to be valid.
func newRunner(t testing.TB, js jetstream.JetStream, pool *pgxpool.Pool, p projection.Projector, cfg streams.RunnerConfig, m *streams.Metrics) *streams.Runner {
	t.Helper()
	r, err := streams.NewRunner(js, pool, p, cfg, m)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func newOutbox(t testing.TB, pool *pgxpool.Pool, pub streams.OutboxPublisher, cfg streams.OutboxConfig) *streams.Outbox {
	t.Helper()
	o, err := streams.NewOutbox(pool, pub, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return o
}

func newExportRunner(t testing.TB, js jetstream.JetStream, exp projection.Exporter, cfg streams.ExportConfig, m *streams.ExportMetrics) *streams.ExportRunner {
	t.Helper()
	r, err := streams.NewExportRunner(js, exp, cfg, m)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func runnerConfig() streams.RunnerConfig {
	return streams.RunnerConfig{
		Stream:     subjects.StreamBES,
		Filter:     subjects.BESFilter,
		Batch:      50,
		MaxWait:    50 * time.Millisecond,
		AckWait:    5 * time.Second,
		RetryMin:   10 * time.Millisecond,
		RetryMax:   50 * time.Millisecond,
		SweepEvery: time.Hour,
	}
}

// start runs a runner until the returned stop is called.
func start(t *testing.T, e *env, p projection.Projector, cfg streams.RunnerConfig) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := newRunner(t, e.js, e.pool, p, cfg, streams.NewMetrics(nil))
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); r.Run(ctx) }()
	var once sync.Once
	stop = func() { once.Do(func() { cancel(); wg.Wait() }) }
	t.Cleanup(stop)
	return stop
}

// waitWithin is the deadline of this package's polls.
var waitWithin = poll.Within(20 * time.Second)

func bodies(n int, prefix string) []string {
	out := make([]string, n)
	for i := range out {
		out[i] = prefix + strconv.Itoa(i)
	}
	return out
}

func TestRunnerAppliesInOrderOnce(t *testing.T) {
	e := setup(t)
	p := &rowsProjector{name: "rows"}
	want := bodies(230, "m")
	e.publish(t, want[:100]...)
	stop := start(t, e, p, runnerConfig())
	e.publish(t, want[100:]...)
	poll.Until(t, "230 rows", func() bool { return len(e.rows(t, "rows")) == 230 }, waitWithin)
	stop()
	got := e.rows(t, "rows")
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("row %d = %q, want %q", i, got[i], want[i])
		}
	}
	if pos := e.position(t, "rows"); pos != 230 {
		t.Fatalf("position %d, want 230", pos)
	}
	// Everything is acked: nothing pending for the consumer.
	c, err := e.js.Consumer(context.Background(), subjects.StreamBES, "rows")
	if err != nil {
		t.Fatal(err)
	}
	info, err := c.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if info.NumAckPending != 0 || info.NumPending != 0 {
		t.Fatalf("consumer has %d unacked, %d pending", info.NumAckPending, info.NumPending)
	}
}

// A batch committed but never acked (the process died between commit and
// ack) is not applied twice by the next runner.
func TestRunnerCommittedButUnackedIsNotAppliedTwice(t *testing.T) {
	e := setup(t)
	e.publish(t, bodies(40, "a")...)
	// Commit rows 1..40 and the position as a runner would, without acking.
	ctx := context.Background()
	tx, err := e.pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for i := 1; i <= 40; i++ {
		tx.Exec(ctx, "insert into runner_rows values ('rows', $1, $2)", i, "a"+strconv.Itoa(i-1))
	}
	tx.Exec(ctx, "insert into consumer_positions (consumer, stream, stream_seq) values ('rows', 'BES', 40)")
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	// A stale durable consumer with everything delivered and unacked.
	cons, err := e.js.CreateOrUpdateConsumer(ctx, subjects.StreamBES, streams.ConsumerSpec("rows", subjects.BESFilter, 50, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := cons.Fetch(40, jetstream.FetchMaxWait(time.Second))
	for range b.Messages() {
	}
	e.publish(t, bodies(10, "b")...)
	p := &rowsProjector{name: "rows"}
	start(t, e, p, runnerConfig())
	poll.Until(t, "50 rows", func() bool { return len(e.rows(t, "rows")) == 50 }, waitWithin)
	poll.Until(t, "position 50", func() bool { return e.position(t, "rows") == 50 }, waitWithin)
}

func TestRunnerPoisonGoesToDeadLetters(t *testing.T) {
	e := setup(t)
	e.publish(t, "ok1", "poison", "ok2", "bad", "ok3")
	start(t, e, &rowsProjector{name: "rows"}, runnerConfig())
	poll.Until(t, "3 rows", func() bool { return len(e.rows(t, "rows")) == 3 }, waitWithin)
	poll.Until(t, "position 5", func() bool { return e.position(t, "rows") == 5 }, waitWithin)
	if got := e.rows(t, "rows"); fmt.Sprint(got) != "[ok1 ok2 ok3]" {
		t.Fatalf("rows %v", got)
	}
	ctx := context.Background()
	dead, err := e.js.Stream(ctx, subjects.StreamDead)
	if err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "2 dead letters", func() bool {
		info, _ := dead.Info(ctx)
		return info != nil && info.State.Msgs == 2
	}, waitWithin)

	for seq, want := range map[uint64]string{1: "poison", 2: "bad"} {
		m, err := dead.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		if string(m.Data) != want || m.Subject != subjects.Dead("rows") {
			t.Fatalf("dead letter %d: %s %q", seq, m.Subject, m.Data)
		}
		if m.Header.Get(envelope.Reason) == "" || m.Header.Get(envelope.Origin) == "" {
			t.Fatalf("dead letter %d lacks reason or origin: %v", seq, m.Header)
		}
	}
}

func TestRunnerRetriesTransientErrorsInOrder(t *testing.T) {
	e := setup(t)
	p := &rowsProjector{name: "rows"}
	p.flaky.Store(3)
	e.publish(t, "x1", "flaky", "x2")
	start(t, e, p, runnerConfig())
	poll.Until(t, "3 rows", func() bool { return len(e.rows(t, "rows")) == 3 }, waitWithin)
	if got := e.rows(t, "rows"); fmt.Sprint(got) != "[x1 flaky x2]" {
		t.Fatalf("rows %v", got)
	}
	if n := p.applies.Load(); n < 4 {
		t.Fatalf("applied %d times, want at least 4 (3 failures, then success)", n)
	}
}

// Two runners of one projector: one applies, the other stands by and takes
// over when the first stops; nothing is lost or applied twice.
func TestRunnerStandbyTakesOver(t *testing.T) {
	e := setup(t)
	p1 := &rowsProjector{name: "rows"}
	p2 := &rowsProjector{name: "rows"}
	stop1 := start(t, e, p1, runnerConfig())
	e.publish(t, bodies(100, "a")...)
	poll.Until(t, "100 rows", func() bool { return len(e.rows(t, "rows")) == 100 }, waitWithin)
	start(t, e, p2, runnerConfig())
	e.publish(t, bodies(50, "b")...)
	poll.Until(t, "150 rows", func() bool { return len(e.rows(t, "rows")) == 150 }, waitWithin)
	if p2.applies.Load() != 0 {
		t.Fatal("the standby applied while the leader ran")
	}
	stop1()
	e.publish(t, bodies(50, "c")...)
	poll.Until(t, "200 rows", func() bool { return len(e.rows(t, "rows")) == 200 }, waitWithin)
	if p2.applies.Load() == 0 {
		t.Fatal("the standby never took over")
	}
}

// A runner stopped mid-batch (its transaction rolled back) loses nothing.
func TestRunnerStoppedMidBatch(t *testing.T) {
	e := setup(t)
	e.publish(t, bodies(300, "m")...)
	p := &rowsProjector{name: "rows", slowdown: 30 * time.Millisecond}
	stop := start(t, e, p, runnerConfig())
	poll.Until(t, "some rows", func() bool { return len(e.rows(t, "rows")) > 0 }, waitWithin)
	stop()
	p2 := &rowsProjector{name: "rows"}
	start(t, e, p2, runnerConfig())
	poll.Until(t, "300 rows", func() bool { return len(e.rows(t, "rows")) == 300 }, waitWithin)
}

func TestReplayRebuilds(t *testing.T) {
	e := setup(t)
	e.publish(t, bodies(120, "r")...)
	stop := start(t, e, &rowsProjector{name: "rows"}, runnerConfig())
	poll.Until(t, "120 rows", func() bool { return len(e.rows(t, "rows")) == 120 }, waitWithin)
	// Replay refuses while the projector runs.
	r := newRunner(t, e.js, e.pool, &rowsProjector{name: "rows"}, runnerConfig(), nil)
	if err := r.Replay(context.Background()); !errors.Is(err, streams.ErrLocked) {
		t.Fatalf("replay beside a running projector: %v, want ErrLocked", err)
	}
	stop()
	e.pool.Exec(context.Background(), "update runner_rows set body = 'tampered'")
	p := &rowsProjector{name: "rows"}
	if err := newRunner(t, e.js, e.pool, p, runnerConfig(), nil).Replay(context.Background()); err != nil {
		t.Fatal(err)
	}
	if p.resets.Load() != 1 {
		t.Fatal("replay did not reset the projection")
	}
	got := e.rows(t, "rows")
	if len(got) != 120 || got[0] != "r0" || got[119] != "r119" {
		t.Fatalf("after replay: %d rows, first %q", len(got), got[0])
	}
	// The live projector carries on from the replay's position.
	start(t, e, &rowsProjector{name: "rows"}, runnerConfig())
	e.publish(t, "after")
	poll.Until(t, "121 rows", func() bool { return len(e.rows(t, "rows")) == 121 }, waitWithin)
}

type panicky struct{ rowsProjector }

func (p *panicky) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	for _, m := range batch {
		if string(m.Data()) == "panic" {
			panic("decoder bug")
		}
	}
	return p.rowsProjector.Apply(ctx, tx, batch)
}

// A projector that panics on one message parks that message and goes on.
func TestRunnerSurvivesProjectorPanic(t *testing.T) {
	e := setup(t)
	e.publish(t, "a", "panic", "b")
	start(t, e, &panicky{rowsProjector{name: "rows"}}, runnerConfig())
	poll.Until(t, "2 rows", func() bool { return len(e.rows(t, "rows")) == 2 }, waitWithin)
	poll.Until(t, "position 3", func() bool { return e.position(t, "rows") == 3 }, waitWithin)
	dead, _ := e.js.Stream(context.Background(), subjects.StreamDead)
	poll.Until(t, "1 dead letter", func() bool {
		info, _ := dead.Info(context.Background())
		return info != nil && info.State.Msgs == 1
	}, waitWithin)

}

// cachingProjector counts the runner's Committed and Aborted calls.
type cachingProjector struct {
	rowsProjector
	committed, aborted atomic.Int32
}

func (p *cachingProjector) Committed() { p.committed.Add(1) }
func (p *cachingProjector) Aborted()   { p.aborted.Add(1) }

// A projector with a cache hears Aborted when it starts to lead and after
// each rolled-back attempt, and Committed after each commit: a transient
// failure must never leave it believing the failed attempt's writes.
func TestRunnerTellsCommitterTheOutcome(t *testing.T) {
	e := setup(t)
	p := &cachingProjector{rowsProjector: rowsProjector{name: "cache"}}
	p.flaky.Store(2)
	start(t, e, p, runnerConfig())
	poll.Until(t, "the lead", func() bool { return p.aborted.Load() >= 1 }, waitWithin)
	e.publish(t, "a", "flaky", "b")
	poll.Until(t, "3 rows", func() bool { return len(e.rows(t, "cache")) == 3 }, waitWithin)
	poll.Until(t, "a commit", func() bool { return p.committed.Load() >= 1 }, waitWithin)
	// One Aborted for taking the lead, one per failed attempt.
	if got := p.aborted.Load(); got < 3 {
		t.Fatalf("Aborted called %d times, want at least 3 (lead + 2 failed attempts)", got)
	}
}

// sweepCounter counts sweeps.
type sweepCounter struct {
	rowsProjector
	sweeps atomic.Int32
}

func (p *sweepCounter) Sweep(ctx context.Context, tx pgx.Tx, now time.Time) error {
	p.sweeps.Add(1)
	return nil
}

// A stream that is never idle (a message every few milliseconds) must still
// be swept: the placer's bind and pending timeouts depend on it.
func TestRunnerSweepsABusyStream(t *testing.T) {
	e := setup(t)
	p := &sweepCounter{rowsProjector: rowsProjector{name: "busy"}}
	cfg := runnerConfig()
	cfg.MaxWait = 5 * time.Millisecond
	cfg.SweepEvery = 50 * time.Millisecond
	start(t, e, p, cfg)
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			e.publish(t, "t"+strconv.Itoa(i))
			time.Sleep(time.Millisecond)
		}
	}()
	defer func() { close(stop); <-done }()
	poll.Until(t, "3 sweeps while messages keep coming", func() bool { return p.sweeps.Load() >= 3 }, waitWithin)
}

// heldMessage is a message kept outside the stream, as the archive keeps
// builds' events.
type heldMessage struct {
	seq  uint64
	data string
}

func (m heldMessage) Subject() string      { return subjects.BES("p", "inv") }
func (m heldMessage) Data() []byte         { return []byte(m.data) }
func (m heldMessage) Header(string) string { return "" }
func (m heldMessage) Seq() uint64          { return m.seq }
func (m heldMessage) Time() time.Time      { return time.Unix(int64(m.seq), 0) }

// A replay by plan applies its prelude, then the stream less what Skip
// names: messages that left the stream come back from the prelude, the
// ones both hold are applied once (the table's key would refuse a second),
// and poison in the prelude is left out.
func TestReplayWithPlanAppliesPreludeThenStream(t *testing.T) {
	e := setup(t)
	e.publish(t, bodies(100, "r")...)
	stop := start(t, e, &rowsProjector{name: "rows"}, runnerConfig())
	poll.Until(t, "100 rows", func() bool { return len(e.rows(t, "rows")) == 100 }, waitWithin)
	stop()
	ctx := context.Background()
	st, err := e.js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	// The first 40 leave the stream; the prelude holds the first 50 and a
	// poison message the live run had parked.
	if err := st.Purge(ctx, jetstream.WithPurgeSequence(41)); err != nil {
		t.Fatal(err)
	}
	var held []projection.Message
	for i := range 50 {
		held = append(held, heldMessage{seq: uint64(i + 1), data: fmt.Sprintf("r%d", i)})
		if i == 20 {
			held = append(held, heldMessage{seq: 1000, data: "poison"})
		}
	}
	p := &rowsProjector{name: "rows"}
	var resets int
	plan := projection.ReplayPlan{
		Reset: func(ctx context.Context, tx pgx.Tx) error {
			resets++
			_, err := tx.Exec(ctx, "delete from runner_rows where consumer = 'rows'")
			return err
		},
		Prelude: func(ctx context.Context, apply func([]projection.Message) error) error {
			for i := 0; i < len(held); i += 15 {
				if err := apply(held[i:min(i+15, len(held))]); err != nil {
					return err
				}
			}
			return nil
		},
		Skip: func(m projection.Message) bool { return m.Seq() <= 50 },
	}
	if err := newRunner(t, e.js, e.pool, p, runnerConfig(), nil).ReplayWith(ctx, plan); err != nil {
		t.Fatal(err)
	}
	if resets != 1 || p.resets.Load() != 0 {
		t.Fatalf("plan reset %d times, projector's Reset %d: want the plan's once", resets, p.resets.Load())
	}
	got := e.rows(t, "rows")
	if len(got) != 100 || got[0] != "r0" || got[49] != "r49" || got[50] != "r50" || got[99] != "r99" {
		t.Fatalf("after replay: %d rows (%v ... %v)", len(got), got[:min(3, len(got))], got[max(0, len(got)-3):])
	}
	if pos := e.position(t, "rows"); pos != 100 {
		t.Fatalf("position %d after replay, want 100", pos)
	}
	// A message applied twice would have failed on the key and been parked.
	dead, err := e.js.Stream(ctx, subjects.StreamDead)
	if err != nil {
		t.Fatal(err)
	}
	if info, err := dead.Info(ctx); err != nil || info.State.Msgs != 0 {
		t.Fatalf("dead letters after replay: %v (err %v), want none", info.State.Msgs, err)
	}
}

// A replay ends though the last messages stored when it began are gone
// (trimmed from the stream once archived): it does not wait for a
// sequence the stream no longer holds.
func TestReplayEndsWhenTheTailIsDeleted(t *testing.T) {
	e := setup(t)
	e.publish(t, bodies(10, "r")...)
	ctx := context.Background()
	s, err := e.js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	for seq := uint64(8); seq <= 10; seq++ {
		if err := s.DeleteMsg(ctx, seq); err != nil {
			t.Fatal(err)
		}
	}
	cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := newRunner(t, e.js, e.pool, &rowsProjector{name: "rows"}, runnerConfig(), nil).Replay(cctx); err != nil {
		t.Fatalf("replay: %v", err)
	}
	if got := e.rows(t, "rows"); len(got) != 7 || got[6] != "r6" {
		t.Fatalf("after replay: %v, want r0..r6", got)
	}
	if pos := e.position(t, "rows"); pos != 10 {
		t.Fatalf("position %d after the replay, want 10 (over the messages gone)", pos)
	}
}
