package commitlog_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/commitlog/layout"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/compactor"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// foldEnv is a JetStream server, a bucket, and the versions written.
type foldEnv struct {
	t     *testing.T
	url   string
	js    jetstream.JetStream
	store *bucket.Bucket
	log   *slog.Logger
	mu    sync.Mutex
	last  map[string]map[string]uint64 // world -> doc -> last version
	first map[string]uint64            // world -> its first version
}

func newFoldEnv(t *testing.T, applyStreams bool) *foldEnv {
	t.Helper()
	ns := testenv.NATS(t)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	store, err := bucket.Open(context.Background(), "mem://")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	e := &foldEnv{t: t, url: ns.ClientURL(), js: js, store: store, log: testLogger(t),
		last: map[string]map[string]uint64{}, first: map[string]uint64{}}
	if applyStreams {
		e.apply()
	}
	return e
}

func (e *foldEnv) apply() {
	e.t.Helper()
	if err := streams.Apply(context.Background(), e.js, streams.StreamSpecs(streams.Config{})); err != nil {
		e.t.Fatal(err)
	}
}

// testLogger writes to the test's log while it runs (the runner's
// goroutine may outlive a failed test by a moment).
func testLogger(t *testing.T) *slog.Logger {
	w := &testWriter{t: t}
	t.Cleanup(func() { w.mu.Lock(); w.done = true; w.mu.Unlock() })
	return slog.New(slog.NewTextHandler(w, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

type testWriter struct {
	t    *testing.T
	mu   sync.Mutex
	done bool
}

func (w *testWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.t.Log(strings.TrimSpace(string(p)))
	}
	return len(p), nil
}

// put writes versions rounds times for each of docs documents of world.
func (e *foldEnv) put(world string, docs, rounds int) {
	e.t.Helper()
	for r := range rounds {
		for d := range docs {
			doc := fmt.Sprintf("doc-%03d", d)
			msg := &nats.Msg{Subject: subjects.Commits(world, doc), Data: []byte(fmt.Sprintf("%s %s r%d", world, doc, r)),
				Header: nats.Header{envelope.Schema: {envelope.SchemaCommitsV1}, envelope.Kind: {envelope.KindPut}}}
			ack, err := e.js.PublishMsg(context.Background(), msg)
			if err != nil {
				e.t.Fatal(err)
			}
			e.mu.Lock()
			if e.last[world] == nil {
				e.last[world] = map[string]uint64{}
				e.first[world] = ack.Sequence
			}
			e.last[world][doc] = ack.Sequence
			e.mu.Unlock()
		}
	}
}

// lastOf is the world's last version written.
func (e *foldEnv) lastOf(world string) uint64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	var top uint64
	for _, v := range e.last[world] {
		top = max(top, v)
	}
	return top
}

// covered is the seq of the world's latest checkpoint (0: none).
func (e *foldEnv) covered(world string) uint64 {
	e.t.Helper()
	m, err := layout.Latest(context.Background(), e.store, world)
	if err != nil {
		e.t.Fatal(err)
	}
	if m == nil {
		return 0
	}
	return m.Seq
}

// folded is nil when the world is folded up to its last version and the
// stream keeps exactly each document's last version of it.
func (e *foldEnv) folded(world string) error {
	ctx := context.Background()
	if c, want := e.covered(world), e.lastOf(world); c != want {
		return fmt.Errorf("world %s: checkpoint at %d, last version %d", world, c, want)
	}
	st, err := e.js.Stream(ctx, subjects.StreamCommits)
	if err != nil {
		return err
	}
	info, err := st.Info(ctx, jetstream.WithSubjectFilter(subjects.CommitsWorldFilter(world)))
	if err != nil {
		return err
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	for doc, v := range e.last[world] {
		subject := subjects.Commits(world, doc)
		if n := info.State.Subjects[subject]; n != 1 {
			return fmt.Errorf("world %s: %d messages of %s in the stream, want its last only", world, n, doc)
		}
		m, err := st.GetLastMsgForSubject(ctx, subject)
		if err != nil || m.Sequence != v {
			return fmt.Errorf("world %s: the stream's last of %s is %v (%v), want version %d", world, doc, m, err, v)
		}
	}
	return nil
}

// ackFloor is the discovery consumer's ack floor.
func (e *foldEnv) ackFloor(durable string) uint64 {
	e.t.Helper()
	c, err := e.js.Consumer(context.Background(), subjects.StreamCommits, durable)
	if err != nil {
		e.t.Fatal(err)
	}
	return c.CachedInfo().AckFloor.Stream
}

func (e *foldEnv) streamLast() uint64 {
	e.t.Helper()
	st, err := e.js.Stream(context.Background(), subjects.StreamCommits)
	if err != nil {
		e.t.Fatal(err)
	}
	return st.CachedInfo().State.LastSeq
}

// run starts a runner; the returned stop ends it and waits.
func (e *foldEnv) run(f projection.Folder, cfg commitlog.FoldRunnerConfig) (stop func()) {
	return e.start(e.js, f, cfg).stop
}

// foldProc is one runner, as a process of its own would run it.
type foldProc struct {
	cancel func() // asks it to stop
	stop   func() // asks it to stop and waits
	reg    *prometheus.Registry
}

// start starts a runner on js, its consumer metrics on a registry of its
// own.
func (e *foldEnv) start(js jetstream.JetStream, f projection.Folder, cfg commitlog.FoldRunnerConfig) foldProc {
	cfg.Logger = e.log
	if cfg.Fetch == 0 {
		cfg.Fetch = 64 // several pulls and ack handles even in small tests
	}
	if cfg.MaxAckPending == 0 {
		cfg.MaxAckPending = 10000
	}
	reg := prometheus.NewRegistry()
	cfg.ConsumerMetrics = streams.NewMetrics(reg)
	if cfg.Metrics == nil {
		cfg.Metrics = commitlog.NewFoldMetrics(reg)
	}
	r, err := commitlog.NewFoldRunner(js, f, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil {
				e.t.Errorf("runner: %v", err)
			}
		})
	}
	e.t.Cleanup(stop)
	return foldProc{cancel: cancel, stop: stop, reg: reg}
}

func (e *foldEnv) waitFolded(worlds ...string) {
	e.t.Helper()
	poll.NoError(e.t, fmt.Sprintf("worlds %q folded", worlds), func() error {
		for _, w := range worlds {
			if err := e.folded(w); err != nil {
				return err
			}
		}
		return nil
	})
}

// waitAcked waits until the consumer has acknowledged the whole stream.
func (e *foldEnv) waitAcked(durable string) {
	e.t.Helper()
	poll.NoError(e.t, durable+" to acknowledge the whole stream", func() error {
		if f, last := e.ackFloor(durable), e.streamLast(); f != last {
			return fmt.Errorf("ack floor %d, stream's last %d", f, last)
		}
		return nil
	}, poll.Within(10*time.Second))
}

// Several worlds, written interleaved, are discovered and folded: each
// checkpoint covers its world's every version, the stream keeps one
// message per document, and the consumer acknowledges everything. New
// writes afterwards are folded too.
func TestFoldRunnerFoldsEveryWorld(t *testing.T) {
	e := newFoldEnv(t, true)
	worlds := []string{"alpha", "beta", "gamma/γ", "delta"}
	for range 3 {
		for _, w := range worlds {
			e.put(w, 20, 1)
		}
	}
	e.run(compactor.MustNew(compactor.Config{ShardDocs: 8}, e.store), commitlog.FoldRunnerConfig{Interval: 150 * time.Millisecond})
	e.waitFolded(worlds...)
	e.waitAcked("compactor")

	e.put("beta", 5, 2)
	e.put("epsilon", 3, 1)
	e.waitFolded(append(worlds, "epsilon")...)
	e.waitAcked("compactor")
}

// The size trigger folds a world once MinVersions of its versions wait;
// a smaller world waits (Interval is an hour), and the acknowledgement
// never passes its first version.
func TestFoldRunnerSizeTrigger(t *testing.T) {
	e := newFoldEnv(t, true)
	e.put("small", 10, 1)
	e.put("big", 20, 3)
	e.run(compactor.MustNew(compactor.Config{}, e.store), commitlog.FoldRunnerConfig{MinVersions: 50, Interval: time.Hour, Fetch: 16})
	e.waitFolded("big")
	// A third world reaches the size after "small" was delivered: once it
	// is folded, the runner has seen "small" and left it alone.
	e.put("third", 25, 2)
	e.waitFolded("third")
	if c := e.covered("small"); c != 0 {
		t.Fatalf("the small world was folded (to %d) with 10 of 50 versions and an hour to go", c)
	}
	if f := e.ackFloor("compactor"); f >= e.first["small"] {
		t.Fatalf("ack floor %d passes the unfolded world's first version %d", f, e.first["small"])
	}
}

// The interval trigger folds a world whose oldest version is Interval old,
// and not before.
func TestFoldRunnerIntervalTrigger(t *testing.T) {
	e := newFoldEnv(t, true)
	const interval = 400 * time.Millisecond
	e.run(compactor.MustNew(compactor.Config{}, e.store), commitlog.FoldRunnerConfig{Interval: interval})
	start := time.Now()
	e.put("w", 5, 1)
	var seen time.Duration
	poll.NoError(t, "the first fold", func() error {
		if e.covered("w") == 0 {
			return errors.New("not folded yet")
		}
		seen = time.Since(start)
		return nil
	}, poll.Within(10*time.Second))
	if seen < interval {
		t.Fatalf("folded %s after the first write, before the %s interval", seen, interval)
	}
	e.waitFolded("w")
	e.waitAcked("compactor")
}

// A runner stopped before it folded some worlds leaves them
// unacknowledged; the next runner on the same durable folds them, and
// the one it had folded comes again and makes an idle pass.
func TestFoldRunnerRestart(t *testing.T) {
	e := newFoldEnv(t, true)
	e.put("b", 10, 1)
	e.put("a", 20, 2)
	e.put("c", 10, 1)
	stop := e.run(compactor.MustNew(compactor.Config{}, e.store), commitlog.FoldRunnerConfig{MinVersions: 30, Interval: time.Hour, Fetch: 8})
	e.waitFolded("a")
	stop()
	if e.covered("b") != 0 || e.covered("c") != 0 {
		t.Fatal("b or c folded without a trigger")
	}
	if f := e.ackFloor("compactor"); f >= e.first["b"] {
		t.Fatalf("the stopped runner acknowledged up to %d, past unfolded world b (first version %d)", f, e.first["b"])
	}

	e.put("d", 5, 1)
	e.run(compactor.MustNew(compactor.Config{}, e.store), commitlog.FoldRunnerConfig{Interval: 100 * time.Millisecond})
	e.waitFolded("a", "b", "c", "d")
	e.waitAcked("compactor")
}

// flakyFolder fails the passes of one world while failing is set: the
// first dies after storing its checkpoint, before the deletions (so the
// stream keeps versions a later pass must sweep); the next ones fail at
// once, as with the bucket away.
type flakyFolder struct {
	*compactor.Compactor
	world    string
	failing  atomic.Bool
	failures atomic.Int32
}

func (f *flakyFolder) Undropped(ctx context.Context, world string) (uint64, func(string) (uint64, bool), error) {
	if world == f.world && f.failing.Load() && f.failures.Load() > 0 {
		f.failures.Add(1)
		return 0, nil, errors.New("injected: the bucket is away")
	}
	return f.Compactor.Undropped(ctx, world)
}

func (f *flakyFolder) Fold(ctx context.Context, world string, versions []projection.Version) ([]uint64, error) {
	drop, err := f.Compactor.Fold(ctx, world, versions)
	if world == f.world && f.failing.Load() {
		f.failures.Add(1)
		return nil, errors.New("injected: the pass died after its checkpoint")
	}
	return drop, err
}

// A world whose passes fail is retried with backoff while the others are
// folded; the acknowledgement waits below it; once its passes succeed
// again, the versions the failed passes stranded are swept.
func TestFoldRunnerPassErrorDoesNotBlockOthers(t *testing.T) {
	e := newFoldEnv(t, true)
	e.put("bad", 10, 3)
	e.put("ok1", 10, 3)
	e.put("ok2", 10, 3)
	f := &flakyFolder{Compactor: compactor.MustNew(compactor.Config{}, e.store), world: "bad"}
	f.failing.Store(true)
	e.run(f, commitlog.FoldRunnerConfig{Interval: 50 * time.Millisecond, RetryMin: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond})
	e.waitFolded("ok1", "ok2")
	poll.NoError(t, "the bad world retried", func() error {
		if f.failures.Load() < 3 {
			return errors.New("the bad world was not retried")
		}
		return nil
	}, poll.Within(5*time.Second))
	if err := e.folded("bad"); err == nil {
		t.Fatal("the failing world looks folded")
	}
	if fl := e.ackFloor("compactor"); fl >= e.first["bad"] {
		t.Fatalf("ack floor %d passes the failing world's first version %d", fl, e.first["bad"])
	}
	f.failing.Store(false)
	e.waitFolded("bad", "ok1", "ok2")
	e.waitAcked("compactor")
}

// The runner waits for the COMMITS stream, and recreates its consumer
// when someone deletes it.
func TestFoldRunnerWaitsForStreamAndRecreatesConsumer(t *testing.T) {
	e := newFoldEnv(t, false)
	e.run(compactor.MustNew(compactor.Config{}, e.store), commitlog.FoldRunnerConfig{Interval: 100 * time.Millisecond})
	e.apply()
	e.put("w", 5, 2)
	e.waitFolded("w")
	e.waitAcked("compactor")
	if err := e.js.DeleteConsumer(context.Background(), subjects.StreamCommits, "compactor"); err != nil {
		t.Fatal(err)
	}
	e.put("w", 5, 1)
	e.put("v", 3, 1)
	e.waitFolded("w", "v")
	e.waitAcked("compactor")
}

// With deliveries near MaxAckPending, the world with the oldest waiting
// version folds without waiting for its triggers, so discovery never
// stalls at the limit (here 32 versions in flight, an hour's interval and
// a size no world reaches).
func TestFoldRunnerPressureTrigger(t *testing.T) {
	e := newFoldEnv(t, true)
	for range 4 {
		e.put("p", 10, 1)
		e.put("q", 10, 1)
		e.put("r", 5, 1)
	}
	e.run(compactor.MustNew(compactor.Config{}, e.store), commitlog.FoldRunnerConfig{
		MinVersions: 1000, Interval: time.Hour, MaxAckPending: 32, Fetch: 16})
	e.waitFolded("p", "q", "r")
	e.waitAcked("compactor")
}

// An export consumer named a holder (HoldFor) on COMMITS holds the
// compactor's deletions at its ack floor: a version it has not
// acknowledged stays in the stream (deleting it would skip it, and
// JetStream would count the deletion as the export's ack). Once the export
// acknowledges, the next pass sweeps what was withheld. A holder of
// another world does not hold this one back.
func TestFoldWithholdsWhatAnExportHasNotAcked(t *testing.T) {
	e := newFoldEnv(t, true)
	ctx := context.Background()
	st, err := e.js.Stream(ctx, subjects.StreamCommits)
	if err != nil {
		t.Fatal(err)
	}
	export := func(name, filter string) jetstream.Consumer {
		c, err := st.CreateConsumer(ctx, jetstream.ConsumerConfig{Durable: name, AckPolicy: jetstream.AckAllPolicy,
			FilterSubject: filter})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	exp := export("export-test", "commits.>")
	export("export-other", subjects.CommitsWorldFilter("other"))
	e.put("w", 5, 3) // 15 versions, 5 documents
	c := compactor.MustNew(compactor.Config{}, e.store)
	hold := commitlog.HoldFor("export-test", "export-other")

	// Acknowledge the first round only.
	batch, err := exp.Fetch(5)
	if err != nil {
		t.Fatal(err)
	}
	var lastAcked jetstream.Msg
	for m := range batch.Messages() {
		lastAcked = m
	}
	if err := lastAcked.DoubleAck(ctx); err != nil {
		t.Fatal(err)
	}
	fs, err := commitlog.FoldWorld(ctx, e.js, c, "w", hold)
	if err != nil {
		t.Fatal(err)
	}
	if fs.Dropped != 5 || fs.Withheld != 5 {
		t.Fatalf("pass: %d dropped, %d withheld; want 5 and 5 (the export acknowledged the first 5 versions)", fs.Dropped, fs.Withheld)
	}
	if err := e.folded("w"); err == nil {
		t.Fatal("the stream keeps only each document's last version although the export has not acknowledged the second round")
	}

	// The export catches up: the next pass sweeps the rest.
	batch, err = exp.Fetch(10)
	if err != nil {
		t.Fatal(err)
	}
	for m := range batch.Messages() {
		lastAcked = m
	}
	if err := lastAcked.DoubleAck(ctx); err != nil {
		t.Fatal(err)
	}
	fs, err = commitlog.FoldWorld(ctx, e.js, c, "w", hold)
	if err != nil {
		t.Fatal(err)
	}
	if fs.Swept != 5 || fs.Withheld != 0 {
		t.Fatalf("next pass: %d swept, %d withheld; want 5 and 0", fs.Swept, fs.Withheld)
	}
	if err := e.folded("w"); err != nil {
		t.Fatal(err)
	}
}
