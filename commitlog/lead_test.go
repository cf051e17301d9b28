package commitlog_test

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/commitlog/layout"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/compactor"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// The fold leads through the consumer core: one runner per durable name
// folds, under a key-value lease, and stores checkpoints and deletes only
// while it holds it.

// leases makes the lease bucket with ttl (before any runner starts: a
// runner makes it with the default TTL when it is missing).
func (e *foldEnv) leases(ttl time.Duration) jetstream.KeyValue {
	e.t.Helper()
	kv, err := e.js.CreateOrUpdateKeyValue(context.Background(), streams.LeaseBucketSpec(streams.Config{LeaseTTL: ttl}))
	if err != nil {
		e.t.Fatal(err)
	}
	return kv
}

// conn is a connection of its own, as another process would have.
func (e *foldEnv) conn() (*nats.Conn, jetstream.JetStream) {
	e.t.Helper()
	nc, err := nats.Connect(e.url)
	if err != nil {
		e.t.Fatal(err)
	}
	e.t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		e.t.Fatal(err)
	}
	return nc, js
}

// take has another holder take the fold's lease of durable, renewing it
// as a holder would, until the function it returns gives it back.
func take(t *testing.T, kv jetstream.KeyValue, durable string, every time.Duration) (giveBack func()) {
	t.Helper()
	ctx := context.Background()
	key := commitlog.FoldLeaseKey(durable)
	if _, err := kv.Put(ctx, key, []byte("another holder")); err != nil {
		t.Fatal(err)
	}
	stop, done := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			case <-time.After(every):
				kv.Put(ctx, key, []byte("another holder"))
			}
		}
	}()
	return func() {
		close(stop)
		<-done
		if err := kv.Delete(ctx, key); err != nil {
			t.Fatal(err)
		}
	}
}

func active(t *testing.T, p foldProc) float64 {
	return testenv.Metric(t, p.reg, "millrace_consumer_active", `kind="fold"`, `consumer="compactor"`)
}

// waitActive waits until p leads (1) or stands by (0).
func waitActive(t *testing.T, p foldProc, want float64, what string) {
	t.Helper()
	poll.NoError(t, what, func() error {
		if a := active(t, p); a != want {
			return fmt.Errorf("millrace_consumer_active %v", a)
		}
		return nil
	})
}

// countedCompactor counts its folds.
type countedCompactor struct {
	*compactor.Compactor
	folds atomic.Int32
}

func (c *countedCompactor) Fold(ctx context.Context, world string, versions []projection.Version) ([]uint64, error) {
	c.folds.Add(1)
	return c.Compactor.Fold(ctx, world, versions)
}

var leadConfig = commitlog.FoldRunnerConfig{Interval: 50 * time.Millisecond, StandbyEvery: 50 * time.Millisecond,
	RetryMin: 20 * time.Millisecond, RetryMax: 100 * time.Millisecond}

// compactorProc is a compactor process: a runner on a connection of its
// own, with a folder that counts its folds.
type compactorProc struct {
	foldProc
	nc *nats.Conn
	f  *countedCompactor
}

func (e *foldEnv) compactorProc() compactorProc {
	nc, js := e.conn()
	f := &countedCompactor{Compactor: compactor.MustNew(compactor.Config{}, e.store)}
	return compactorProc{foldProc: e.start(js, f, leadConfig), nc: nc, f: f}
}

// kill ends the process as a crash would: its connection goes first, so
// it cannot give its lease up.
func (p compactorProc) kill() {
	p.nc.Close()
	p.stop()
}

// Two runners on one durable name: one leads and folds, the other stands
// by and folds nothing. When the leader stops it gives the lease up and
// the other leads at once; when the next leader is killed (its connection
// gone, no release), its lease lapses after the TTL and a third takes
// over.
func TestFoldRunnersOnOneDurable(t *testing.T) {
	e := newFoldEnv(t, true)
	kv := e.leases(2 * time.Second)
	a, b := e.compactorProc(), e.compactorProc()
	e.put("w", 10, 2)
	e.waitFolded("w")
	e.waitAcked("compactor")
	poll.NoError(t, "one runner leading, the other standing by", func() error {
		if n := active(t, a.foldProc) + active(t, b.foldProc); n != 1 {
			return fmt.Errorf("%v lead", n)
		}
		return nil
	})
	leader, standby := a, b
	if active(t, b.foldProc) == 1 {
		leader, standby = b, a
	}
	if leader.f.folds.Load() == 0 || standby.f.folds.Load() != 0 {
		t.Fatalf("the leader folded %d times, the standby %d; want the leader only", leader.f.folds.Load(), standby.f.folds.Load())
	}

	leader.stop()
	waitActive(t, standby.foldProc, 1, "the standby to lead once the leader stopped")
	e.put("w", 10, 1)
	e.put("v", 5, 1)
	e.waitFolded("w", "v")
	e.waitAcked("compactor")
	if standby.f.folds.Load() == 0 {
		t.Fatal("the new leader folded nothing")
	}

	third := e.compactorProc()
	waitActive(t, third.foldProc, 0, "a third runner to stand by")
	standby.kill()
	if _, err := kv.Get(context.Background(), commitlog.FoldLeaseKey("compactor")); err != nil {
		t.Fatalf("the killed leader's lease: %v; want it left to lapse", err)
	}
	waitActive(t, third.foldProc, 1, "the third runner to lead once the killed leader's lease lapsed")
	e.put("w", 5, 1)
	e.waitFolded("w", "v")
	e.waitAcked("compactor")
	if third.f.folds.Load() == 0 {
		t.Fatal("the third runner folded nothing")
	}
}

// waitPass waits until p's first pass has ended.
func waitPass(t *testing.T, p foldProc) {
	t.Helper()
	poll.NoError(t, "the pass to end", func() error {
		if n := testenv.Metric(t, p.reg, "millrace_compactor_passes_total"); n == 0 {
			return errors.New("no pass ended")
		}
		return nil
	})
}

// hold blocks the first caller of wait until open, or until the caller's
// context ends (so that a failed test does not leave its runner blocked).
type hold struct {
	once, opening sync.Once
	reached       chan struct{}
	opened        chan struct{}
}

func newHold(t *testing.T) *hold {
	h := &hold{reached: make(chan struct{}), opened: make(chan struct{})}
	t.Cleanup(h.open)
	return h
}

func (h *hold) wait(ctx context.Context) {
	h.once.Do(func() {
		close(h.reached)
		select {
		case <-h.opened:
		case <-ctx.Done():
		}
	})
}

func (h *hold) open() { h.opening.Do(func() { close(h.opened) }) }

func (h *hold) waitReached(t *testing.T, what string) {
	t.Helper()
	select {
	case <-h.reached:
	case <-time.After(poll.DefaultWithin):
		t.Fatalf("nothing reached %s", what)
	}
}

// heldFold holds the first pass before it folds.
type heldFold struct {
	*compactor.Compactor
	h *hold
}

func (f *heldFold) Fold(ctx context.Context, world string, versions []projection.Version) ([]uint64, error) {
	f.h.wait(ctx)
	return f.Compactor.Fold(ctx, world, versions)
}

// heldStore holds the first Create of key, after the compactor's own
// checks.
type heldStore struct {
	*bucket.Bucket
	key string
	h   *hold
}

func (s heldStore) Create(ctx context.Context, key string, data []byte) error {
	if key == s.key {
		s.h.wait(ctx)
	}
	return s.Bucket.Create(ctx, key, data)
}

// A pass whose lease another holder takes before it stores its checkpoint
// stores none and deletes nothing; the runner stands down, and once the
// lease is back it folds the world. The TTL is long, so that no renewal
// falls in the window: the fence before the checkpoint alone sees the
// lease gone.
func TestFoldFencedBeforeTheCheckpoint(t *testing.T) {
	e := newFoldEnv(t, true)
	kv := e.leases(time.Minute)
	e.put("w", 5, 3)
	h := newHold(t)
	p := e.start(e.js, &heldFold{Compactor: compactor.MustNew(compactor.Config{}, e.store), h: h}, leadConfig)
	h.waitReached(t, "the pass's fold")
	giveBack := take(t, kv, "compactor", time.Hour)
	h.open()
	waitPass(t, p)
	if c := e.covered("w"); c != 0 {
		t.Fatalf("a checkpoint at %d was stored after another holder took the lease", c)
	}
	if n := e.streamMsgs(); n != 15 {
		t.Fatalf("%d versions left in COMMITS, want all 15: deleted after the lease was taken", n)
	}
	waitActive(t, p, 0, "the runner to stand down")
	giveBack()
	e.waitFolded("w")
	e.waitAcked("compactor")
}

// A pass whose lease another holder takes after it stored its checkpoint
// deletes nothing; the next leader's pass sweeps what it left.
func TestFoldFencedBeforeTheDeletions(t *testing.T) {
	e := newFoldEnv(t, true)
	kv := e.leases(time.Minute)
	e.put("w", 5, 3)
	h := newHold(t)
	store := heldStore{Bucket: e.store, key: layout.CheckpointKey("w", e.lastOf("w")), h: h}
	p := e.start(e.js, compactor.MustNew(compactor.Config{}, store), leadConfig)
	h.waitReached(t, "the checkpoint's store")
	giveBack := take(t, kv, "compactor", time.Hour)
	h.open()
	waitPass(t, p)
	if c, want := e.covered("w"), e.lastOf("w"); c != want {
		t.Fatalf("checkpoint at %d, want %d (its fence passed before the lease was taken)", c, want)
	}
	if n := e.streamMsgs(); n != 15 {
		t.Fatalf("%d versions left in COMMITS, want all 15: deleted after the lease was taken", n)
	}
	waitActive(t, p, 0, "the runner to stand down")
	giveBack()
	e.waitFolded("w")
	e.waitAcked("compactor")
}

// A runner told to stop lets the pass in flight finish under its lease,
// still renewed, and gives the lease up only afterwards: the pass stores
// its checkpoint, however long the drain outlasts the lease's TTL.
func TestFoldRunnerDrainsUnderItsLease(t *testing.T) {
	e := newFoldEnv(t, true)
	ctx := context.Background()
	kv := e.leases(2 * time.Second)
	e.put("w", 5, 3)
	h := newHold(t)
	p := e.start(e.js, &heldFold{Compactor: compactor.MustNew(compactor.Config{}, e.store), h: h}, leadConfig)
	h.waitReached(t, "the pass's fold")
	key := commitlog.FoldLeaseKey("compactor")
	p.cancel()
	before, err := kv.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	for n := range 2 {
		poll.NoError(t, fmt.Sprintf("renewal %d of the lease while the pass drains", n+1), func() error {
			now, err := kv.Get(ctx, key)
			if err != nil {
				return err
			}
			if now.Revision() <= before.Revision() {
				return fmt.Errorf("still at revision %d", now.Revision())
			}
			before = now
			return nil
		})
	}
	h.open()
	p.stop()
	if c, want := e.covered("w"), e.lastOf("w"); c != want {
		t.Fatalf("checkpoint at %d, want %d: the pass in flight at the stop did not finish", c, want)
	}
	if _, err := kv.Get(ctx, key); !errors.Is(err, jetstream.ErrKeyNotFound) {
		t.Fatalf("the lease after the stop: %v, want it given up", err)
	}
}

// A runner that lost the lead to another attaches the consumer afresh
// when it leads again: what the other had delivered and not acknowledged
// when it stopped comes again at once, not after AckWait (5 minutes).
func TestFoldRunnerLeadsAfresh(t *testing.T) {
	e := newFoldEnv(t, true)
	ctx := context.Background()
	kv := e.leases(2 * time.Second)
	cfg := leadConfig
	cfg.MinVersions, cfg.Interval = 15, time.Hour
	e.put("w", 5, 2)
	p := e.start(e.js, compactor.MustNew(compactor.Config{}, e.store), cfg)
	poll.NoError(t, "ten versions waiting", func() error {
		c, err := e.js.Consumer(ctx, subjects.StreamCommits, "compactor")
		if err != nil {
			return err
		}
		if n := c.CachedInfo().NumAckPending; n != 10 {
			return fmt.Errorf("%d delivered and unacknowledged", n)
		}
		return nil
	})
	giveBack := take(t, kv, "compactor", 500*time.Millisecond)
	waitActive(t, p, 0, "the runner to stand down")

	// The other leader is delivered five new versions, and stops before
	// it folds them.
	e.put("w", 5, 1)
	c, err := e.js.Consumer(ctx, subjects.StreamCommits, "compactor")
	if err != nil {
		t.Fatal(err)
	}
	batch, err := c.Fetch(5, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := 0
	for range batch.Messages() {
		got++
	}
	if got != 5 {
		t.Fatalf("the other leader was delivered %d versions, want 5 (%v)", got, batch.Error())
	}
	giveBack()
	waitActive(t, p, 1, "the runner to lead again")
	e.waitFolded("w") // 15 waiting: due by size
	e.waitAcked("compactor")
}

// A recreated COMMITS stream starts discovery over: its sequences begin at
// 1 again, below what the runner had delivered.
func TestFoldRunnerStreamRecreated(t *testing.T) {
	e := newFoldEnv(t, true)
	e.put("w", 10, 2)
	e.run(compactor.MustNew(compactor.Config{}, e.store), leadConfig)
	e.waitFolded("w")
	e.waitAcked("compactor")
	if err := e.js.DeleteStream(context.Background(), subjects.StreamCommits); err != nil {
		t.Fatal(err)
	}
	e.apply()
	e.put("v", 5, 1)
	e.waitFolded("v")
	e.waitAcked("compactor")
}

// Until COMMITS exists the runner tries to attach every second and says
// so once; then it folds.
func TestFoldRunnerWaitsForTheStreamSayingSoOnce(t *testing.T) {
	e := newFoldEnv(t, false)
	var logs logBuffer
	e.log = slog.New(slog.NewTextHandler(&logs, nil))
	p := e.start(e.js, compactor.MustNew(compactor.Config{}, e.store), leadConfig)
	poll.NoError(t, "three attempts to attach", func() error {
		if n := testenv.Metric(t, p.reg, "millrace_consumer_batches_total", `kind="fold"`, `result="attach_error"`); n < 3 {
			return fmt.Errorf("%v attempts", n)
		}
		return nil
	})
	if n := logs.count("waiting for the " + subjects.StreamCommits + " stream"); n != 1 {
		t.Fatalf("the wait for the stream was logged %d times, want once", n)
	}
	e.apply()
	e.put("w", 5, 2)
	e.waitFolded("w")
	e.waitAcked("compactor")
}
