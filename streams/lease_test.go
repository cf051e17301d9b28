package streams_test

import (
	"context"
	"errors"
	"net"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
)

// leaseTTL is the lease bucket's TTL in these tests: short, so that a
// lapse is seen within a test's deadline.
const leaseTTL = 2 * time.Second

// leaseBucket makes the lease bucket with leaseTTL.
func leaseBucket(t *testing.T, js jetstream.JetStream) jetstream.KeyValue {
	t.Helper()
	kv, err := js.CreateOrUpdateKeyValue(context.Background(), streams.LeaseBucketSpec(streams.Config{LeaseTTL: leaseTTL}))
	if err != nil {
		t.Fatal(err)
	}
	return kv
}

func ended(ctx context.Context) bool { return ctx.Err() != nil }

func TestPGLease(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	a, b := streams.NewPGLease(pool, "test.lease"), streams.NewPGLease(pool, "test.lease")
	ha, err := a.AcquirePG(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Acquire(ctx); !errors.Is(err, streams.ErrLocked) {
		t.Fatalf("a second holder: %v, want ErrLocked", err)
	}
	if err := ha.Fence(ctx); err != nil {
		t.Fatalf("Fence of a held lock: %v", err)
	}
	ha.Release(ctx)
	if !ended(ha.Context()) {
		t.Fatal("a released lease's context goes on")
	}
	hb, err := b.AcquirePG(ctx)
	if err != nil {
		t.Fatalf("after Release: %v", err)
	}
	// The backend holding the lock is killed: the lock is gone with its
	// session, Fence says so and ends the context, and another takes it.
	var pid int
	if err := hb.Conn().QueryRow(ctx, "select pg_backend_pid()").Scan(&pid); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "select pg_terminate_backend($1)", pid); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the terminated backend's lock taken by another", func() bool {
		h, err := a.Acquire(ctx)
		if err == nil {
			defer h.Release(ctx)
		}
		return err == nil
	}, waitWithin)

	if err := hb.Fence(ctx); !errors.Is(err, streams.ErrLeaseLost) || !ended(hb.Context()) {
		t.Fatalf("Fence after the backend was terminated: %v (context ended %v), want ErrLeaseLost", err, ended(hb.Context()))
	}
	hb.Release(ctx)
}

func TestKVLease(t *testing.T) {
	e := setup(t)
	kv := leaseBucket(t, e.js)
	ctx := context.Background()
	a, b := streams.NewKVLease(e.js, "test.kv"), streams.NewKVLease(e.js, "test.kv")
	ha, err := a.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.Acquire(ctx); !errors.Is(err, streams.ErrLocked) {
		t.Fatalf("a second holder: %v, want ErrLocked", err)
	}
	// Renewals keep it well past the TTL.
	rev := ha.(*streams.KVHeld).Revision()
	deadline := time.Now().Add(2 * leaseTTL)
	for time.Now().Before(deadline) {
		if err := ha.Fence(ctx); err != nil {
			t.Fatalf("Fence while renewing: %v", err)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if ha.(*streams.KVHeld).Revision() <= rev {
		t.Fatal("not renewed")
	}
	if _, err := b.Acquire(ctx); !errors.Is(err, streams.ErrLocked) {
		t.Fatalf("a second holder after two TTLs: %v, want ErrLocked", err)
	}
	// Release: the other takes it at once.
	ha.Release(ctx)
	hb, err := b.Acquire(ctx)
	if err != nil {
		t.Fatalf("after Release: %v", err)
	}

	// The entry deleted under its holder: Fence sees it at once.
	if err := kv.Delete(ctx, "test.kv"); err != nil {
		t.Fatal(err)
	}
	if err := hb.Fence(ctx); !errors.Is(err, streams.ErrLeaseLost) || !ended(hb.Context()) {
		t.Fatalf("Fence of a deleted entry: %v, want ErrLeaseLost and the context ended", err)
	}
	hb.Release(ctx)

	// Taken by another holder: the renewal is refused and the context ends
	// without a Fence.
	hc, err := a.Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := kv.Put(ctx, "test.kv", []byte("someone else")); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the holder to see its lease taken", func() bool { return ended(hc.Context()) }, waitWithin)
	if !errors.Is(context.Cause(hc.Context()), streams.ErrLeaseLost) {
		t.Fatalf("cause %v, want ErrLeaseLost", context.Cause(hc.Context()))
	}
	hc.Release(ctx) // must not delete someone else's entry
	if e, err := kv.Get(ctx, "test.kv"); err != nil || string(e.Value()) != "someone else" {
		t.Fatalf("the other holder's entry after a lost holder's Release: %v", err)
	}
	kv.Delete(ctx, "test.kv")
}

// A holder that dies without releasing: its entry lapses after the TTL
// and a standby takes it. The same lease takes back its own entry at once
// (a Release that could not reach the server).
func TestKVLeaseLapses(t *testing.T) {
	e := setup(t)
	leaseBucket(t, e.js)
	a, b := streams.NewKVLease(e.js, "test.lapse"), streams.NewKVLease(e.js, "test.lapse")
	actx, crash := context.WithCancel(context.Background())
	if _, err := a.Acquire(actx); err != nil {
		t.Fatal(err)
	}
	crash() // renewals stop; nothing is deleted
	ctx := context.Background()
	h, err := a.Acquire(ctx)
	if err != nil {
		t.Fatalf("the same lease taking back its own entry: %v", err)
	}
	h.Release(ctx)
	// A crash: a's entry left behind, b waits for it to lapse.
	actx, crash = context.WithCancel(context.Background())
	if _, err := a.Acquire(actx); err != nil {
		t.Fatal(err)
	}
	crash()
	crashed := time.Now()
	if _, err := b.Acquire(ctx); !errors.Is(err, streams.ErrLocked) {
		t.Fatalf("standby right after the crash: %v, want ErrLocked", err)
	}
	var hb streams.Held
	poll.Until(t, "the standby to take the lapsed lease", func() bool {
		hb, err = b.Acquire(ctx)
		return err == nil
	}, waitWithin)

	if took := time.Since(crashed); took < leaseTTL/2 {
		t.Fatalf("taken %s after the crash, before the TTL %s could lapse", took, leaseTTL)
	}
	hb.Release(ctx)
}

// A holder cut off from the server stops leading within the TTL, on its
// own; when the server is back it takes its own entry again, or a
// standby takes the lapsed one.
func TestKVLeaseCutOff(t *testing.T) {
	dir := t.TempDir()
	ns := testenv.NATSAt(t, dir, -1)
	port := ns.Addr().(*net.TCPAddr).Port
	nc, err := streams.Connect(ns.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	leaseBucket(t, js)
	ctx := context.Background()
	h, err := streams.NewKVLease(js, "test.cut").Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	ns.Shutdown()
	ns.WaitForShutdown()
	cut := time.Now()
	poll.Until(t, "the cut-off holder to stop leading", func() bool { return ended(h.Context()) }, waitWithin)
	if took := time.Since(cut); took > leaseTTL {
		t.Fatalf("the holder led %s after it was cut off, past the TTL %s", took, leaseTTL)
	}
	if err := h.Fence(ctx); !errors.Is(err, streams.ErrLeaseLost) {
		t.Fatalf("Fence after the lapse: %v, want ErrLeaseLost", err)
	}
	testenv.NATSAt(t, dir, port)
	poll.Until(t, "another holder to lead once the server is back", func() bool {
		h, err := streams.NewKVLease(js, "test.cut").Acquire(ctx)
		if err == nil {
			h.Release(ctx)
		}
		return err == nil
	}, waitWithin)

}

// TestKVLeaseFencesWhileRenewing: a holder fencing as often as the export
// does (before every ack) keeps its lease across its own renewals. A fence
// that read the held revision before a renewal and the entry after it
// would see the holder's own new revision and give the lease up.
func TestKVLeaseFencesWhileRenewing(t *testing.T) {
	e := setup(t)
	leaseBucket(t, e.js)
	ctx := context.Background()
	h, err := streams.NewKVLease(e.js, "test.fence").Acquire(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer h.Release(ctx)
	kh := h.(*streams.KVHeld)
	first := kh.Revision()
	fences := 0
	// Until three renewals have gone by (one every TTL/3).
	for kh.Revision() < first+3 {
		if err := h.Fence(ctx); err != nil {
			t.Fatalf("fence %d, at revision %d: %v", fences, kh.Revision(), err)
		}
		fences++
		if fences > 1_000_000 {
			t.Fatal("no renewal seen")
		}
	}
	t.Logf("%d fences over three renewals", fences)
}
