package fleet

import (
	"context"
	"errors"
	"maps"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// The test files may use streams and NATS: the dependency rule
// (internal/deps) is about what the package itself imports.

// flakyProjector counts the messages it applies and fails its first batch
// with a transient error after applying it, so that the runner rolls the
// transaction back and applies the same batch again.
type flakyProjector struct {
	*Projector
	applied atomic.Int64
	failed  atomic.Bool
	sweeps  atomic.Int64
}

// Sweep counts: an idle runner sweeps, so a sweep says it has looked.
func (p *flakyProjector) Sweep(ctx context.Context, tx pgx.Tx, now time.Time) error {
	p.sweeps.Add(1)
	return p.Projector.Sweep(ctx, tx, now)
}

func (p *flakyProjector) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	if err := p.Projector.Apply(ctx, tx, batch); err != nil {
		return err
	}
	if p.failed.CompareAndSwap(false, true) {
		return errors.New("test: connection reset after apply")
	}
	p.applied.Add(int64(len(batch)))
	return nil
}

func TestRunnerRedelivery(t *testing.T) {
	ctx := context.Background()
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
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	pool, _ := testenv.Pool(t)

	scen := scenario().msgs
	publish := func(msgs []*msg) {
		t.Helper()
		pub := streams.NewPublisher(js, nil)
		for _, m := range msgs {
			nm := nats.NewMsg(m.subject)
			for k, v := range m.hdr {
				nm.Header.Set(k, v)
			}
			nm.Data = m.data
			if err := pub.Publish(ctx, nm); err != nil {
				t.Fatal(err)
			}
		}
	}
	publish(scen)
	last := uint64(len(scen))

	cfg := streams.RunnerConfig{
		Stream:     subjects.StreamFleetNodes,
		Filter:     subjects.FleetNodeFilter,
		Batch:      7,
		MaxWait:    20 * time.Millisecond,
		AckWait:    5 * time.Second,
		RetryMin:   10 * time.Millisecond,
		RetryMax:   50 * time.Millisecond,
		SweepEvery: time.Hour,
	}
	run := func(p projection.Projector) (stop func()) {
		runCtx, cancel := context.WithCancel(ctx)
		r, err := streams.NewRunner(js, pool, p, cfg, streams.NewMetrics(nil))
		if err != nil {
			t.Fatal(err)
		}
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); r.Run(runCtx) }()
		var once sync.Once
		stop = func() { once.Do(func() { cancel(); wg.Wait() }) }
		t.Cleanup(stop)
		return stop
	}
	position := func() uint64 {
		var pos int64
		err := pool.QueryRow(ctx, "select stream_seq from consumer_positions where consumer = $1", ConsumerName).Scan(&pos)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			t.Fatal(err)
		}
		return uint64(pos)
	}
	revs := func() map[string]int64 {
		rows, _ := pool.Query(ctx, "select node_id, rev from fleet_nodes")
		out := map[string]int64{}
		var id string
		var rev int64
		pgx.ForEachRow(rows, []any{&id, &rev}, func() error { out[id] = rev; return nil })
		return out
	}

	// Live: the first batch is applied, rolled back and applied again.
	p := &flakyProjector{Projector: mustNew(Config{})}
	stop := run(p)
	poll.Until(t, "the whole stream applied", func() bool { return position() == last }, poll.Within(20*time.Second))
	stop()
	if !p.failed.Load() || p.applied.Load() != int64(last) {
		t.Fatalf("applied %d messages (failed once: %v), want %d", p.applied.Load(), p.failed.Load(), last)
	}
	live, liveRevs := digestOf(t, pool), revs()

	// The same stored messages (with JetStream's times) applied directly,
	// in one batch, to another database: the same rows.
	stored := storedMessages(t, js, last)
	other, _ := testenv.Pool(t)
	applyAll(t, other, mustNew(Config{}), stored, 1000)
	if d := digestOf(t, other); !maps.Equal(d, live) {
		t.Fatalf("runner and direct apply differ:\n%s\n---\n%s", dump(t, pool), dump(t, other))
	}

	// A crash between commit and ack: a stale durable consumer with every
	// message delivered and none acked. The next runner applies nothing.
	if err := js.DeleteConsumer(ctx, subjects.StreamFleetNodes, ConsumerName); err != nil {
		t.Fatal(err)
	}
	cons, err := js.CreateOrUpdateConsumer(ctx, subjects.StreamFleetNodes,
		streams.ConsumerSpec(ConsumerName, subjects.FleetNodeFilter, 100, time.Minute))
	if err != nil {
		t.Fatal(err)
	}
	fetched, err := cons.Fetch(int(last), jetstream.FetchMaxWait(2*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	for range fetched.Messages() {
	}
	// And a gateway resending everything inside the duplicate window.
	publish(scen)
	info, err := js.Stream(ctx, subjects.StreamFleetNodes)
	if err != nil || info.CachedInfo().State.LastSeq != last {
		t.Fatalf("resend was stored: %v, %v", info.CachedInfo().State.LastSeq, err)
	}
	p2 := &flakyProjector{Projector: mustNew(Config{})}
	p2.failed.Store(true)
	stop = run(p2)
	poll.Until(t, "the runner to go idle", func() bool { return p2.sweeps.Load() > 0 }, poll.Within(20*time.Second))
	if n := p2.applied.Load(); n != 0 {
		t.Fatalf("the runner applied %d messages again after a crash between commit and ack", n)
	}

	// A redelivery the position did not catch: the position moved back
	// over the last batch, which the runner then applies a second time.
	if _, err := pool.Exec(ctx, "update consumer_positions set stream_seq = $1 where consumer = $2", last-7, ConsumerName); err != nil {
		t.Fatal(err)
	}
	stop()
	stop = run(p2)
	poll.Until(t, "the last batch applied again", func() bool { return p2.applied.Load() == 7 && position() == last }, poll.Within(20*time.Second))
	stop()
	if d := digestOf(t, pool); !maps.Equal(d, live) {
		t.Fatalf("redelivery changed the projection:\n%s", dump(t, pool))
	}
	if r := revs(); !maps.Equal(r, liveRevs) {
		t.Fatalf("redelivery of liveness batches moved revs: %v, was %v", r, liveRevs)
	}
}

// storedMessages reads messages 1..last back from FLEET_NODES, with their
// stored times.
func storedMessages(t *testing.T, js jetstream.JetStream, last uint64) []*msg {
	t.Helper()
	ctx := context.Background()
	s, err := js.Stream(ctx, subjects.StreamFleetNodes)
	if err != nil {
		t.Fatal(err)
	}
	out := make([]*msg, 0, last)
	for seq := uint64(1); seq <= last; seq++ {
		raw, err := s.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		h := map[string]string{}
		for k := range raw.Header {
			h[k] = raw.Header.Get(k)
		}
		out = append(out, &msg{subject: raw.Subject, data: raw.Data, hdr: h, seq: raw.Sequence, at: raw.Time})
	}
	return out
}
