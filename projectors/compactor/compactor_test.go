package compactor

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/commitlog/layout"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

type world struct {
	t      testing.TB
	js     jetstream.JetStream
	stream jetstream.Stream
	store  *bucket.Bucket
	name   string
	acked  map[uint64]layout.Record // every acknowledged version
}

func newWorld(t testing.TB) *world {
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
	ctx := context.Background()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(ctx, subjects.StreamCommits)
	if err != nil {
		t.Fatal(err)
	}
	b, err := bucket.Open(ctx, "mem://")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return &world{t: t, js: js, stream: st, store: b, name: "w/1", acked: map[uint64]layout.Record{}}
}

// put writes a version as the commits edge does (expected: the version
// replaced, -1 for none).
func (w *world) put(id, body string, deleted bool, expected int64) (uint64, error) {
	kind := envelope.KindPut
	if deleted {
		kind = envelope.KindDelete
	}
	msg := &nats.Msg{Subject: subjects.Commits(w.name, id), Data: []byte(body),
		Header: nats.Header{envelope.Schema: {envelope.SchemaCommitsV1}, envelope.Kind: {kind}}}
	if expected >= 0 {
		msg.Header.Set(jetstream.ExpectedLastSubjSeqHeader, fmt.Sprint(expected))
	}
	ack, err := w.js.PublishMsg(context.Background(), msg)
	if err != nil {
		return 0, err
	}
	w.acked[ack.Sequence] = layout.Record{ID: id, Version: ack.Sequence, Deleted: deleted, Body: []byte(body)}
	return ack.Sequence, nil
}

func (w *world) mustPut(id, body string) uint64 {
	w.t.Helper()
	v, err := w.put(id, body, false, -1)
	if err != nil {
		w.t.Fatal(err)
	}
	return v
}

// pass runs one fold of the world into store, as the compactor command
// does (commitlog.FoldWorld), and returns what it did.
func (w *world) pass(store Store, shardDocs int) (*Result, error) {
	c := MustNew(Config{ShardDocs: shardDocs}, store)
	st, err := commitlog.FoldWorld(context.Background(), w.js, c, w.name)
	res := c.Last(w.name)
	if res == nil {
		res = &Result{World: w.name}
	}
	if err == nil && st.Dropped != res.Dropped {
		w.t.Fatalf("FoldWorld dropped %d versions, Fold returned %d", st.Dropped, res.Dropped)
	}
	return res, err
}

// check is the oracle: the checkpoint's documents plus the stream's tail
// give every document's latest version as the writers acknowledged it, and
// every acknowledged version is readable from the stream or from a
// history segment.
func (w *world) check() *layout.Manifest {
	w.t.Helper()
	ctx := context.Background()
	m, err := layout.Latest(ctx, w.store, w.name)
	if err != nil {
		w.t.Fatal(err)
	}
	want := map[string]layout.Record{} // latest acknowledged version per document
	for _, r := range w.acked {
		if cur, ok := want[r.ID]; !ok || r.Version > cur.Version {
			want[r.ID] = r
		}
	}
	got := map[string]layout.Record{}
	var cover uint64
	if m != nil {
		cover = m.Seq
		recs, err := layout.Load(ctx, w.store, m)
		if err != nil {
			w.t.Fatal(err)
		}
		for i, r := range recs {
			if i > 0 && recs[i-1].ID >= r.ID {
				w.t.Fatalf("shards not sorted by id: %q then %q", recs[i-1].ID, r.ID)
			}
			got[r.ID] = r
		}
	}
	// The tail, from the stream.
	for seq, r := range w.acked {
		if seq <= cover {
			continue
		}
		if cur, ok := got[r.ID]; !ok || r.Version > cur.Version {
			got[r.ID] = r
		}
	}
	for id, r := range want {
		g, ok := got[id]
		switch {
		case r.Deleted && (!ok || g.Deleted):
		case !ok || g.Version != r.Version || !bytes.Equal(g.Body, r.Body):
			w.t.Errorf("document %q: checkpoint + tail give %+v, want version %d %q", id, g, r.Version, r.Body)
		}
	}
	// Every acknowledged version: in the stream, or in a segment.
	inHistory := map[uint64]layout.Record{}
	if m != nil {
		for _, s := range m.History {
			data, err := w.store.Get(ctx, s.Key)
			if err != nil {
				w.t.Fatal(err)
			}
			recs, err := layout.Decode(layout.KindHistory, data)
			if err != nil {
				w.t.Fatal(err)
			}
			for _, r := range recs {
				inHistory[r.Version] = r
			}
		}
	}
	for seq, r := range w.acked {
		if h, ok := inHistory[seq]; ok {
			if h.ID != r.ID || !bytes.Equal(h.Body, r.Body) || h.Deleted != r.Deleted {
				w.t.Errorf("version %d in history as %+v, want %+v", seq, h, r)
			}
			continue
		}
		msg, err := w.stream.GetMsg(ctx, seq)
		if err != nil || !bytes.Equal(msg.Data, r.Body) {
			w.t.Errorf("acknowledged version %d of %q is neither in the stream (%v) nor in a history segment", seq, r.ID, err)
		}
	}
	return m
}

func TestCompactFoldsPurgesAndKeepsCompareAndSet(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	a1 := w.mustPut("a", "a1")
	w.mustPut("b", "b1")
	c1 := w.mustPut("c", "c1")
	a2 := w.mustPut("a", "a2")
	a3 := w.mustPut("a", "a3")
	bDel, err := w.put("b", "", true, -1)
	if err != nil {
		t.Fatal(err)
	}
	res, err := w.pass(w.store, 0)
	if err != nil {
		t.Fatal(err)
	}
	if res.To != bDel || res.Versions != 6 || res.DocsChanged != 3 || res.Docs != 2 {
		t.Fatalf("result %+v", res)
	}
	m := w.check()
	if m.Seq != bDel || len(m.History) != 1 {
		t.Fatalf("manifest %+v", m)
	}
	// Folded versions left the stream; each document's last stayed.
	for _, gone := range []uint64{a1, a2} {
		if _, err := w.stream.GetMsg(ctx, gone); !errors.Is(err, jetstream.ErrMsgNotFound) {
			t.Errorf("version %d still in the stream (%v)", gone, err)
		}
	}
	for _, kept := range []uint64{a3, c1, bDel} {
		if _, err := w.stream.GetMsg(ctx, kept); err != nil {
			t.Errorf("last version %d purged: %v", kept, err)
		}
	}
	// Compare-and-set holds against the kept last versions.
	if _, err := w.put("a", "x", false, 0); err == nil {
		t.Fatal(`"must not exist" accepted for a compacted document`)
	}
	if _, err := w.put("a", "stale", false, int64(a2)); err == nil {
		t.Fatal("a stale version accepted after compaction")
	}
	if _, err := w.put("a", "a4", false, int64(a3)); err != nil {
		t.Fatalf("the current version refused after compaction: %v", err)
	}
	if _, err := w.put("b", "b2", false, int64(bDel)); err != nil {
		t.Fatalf("re-create over the kept tombstone: %v", err)
	}
	// A pass with nothing new writes nothing.
	res, err = w.pass(w.store, 0)
	if err != nil || res.Versions != 2 {
		t.Fatalf("second pass: %+v, %v", res, err)
	}
	w.check()
	res, err = w.pass(w.store, 0)
	if err != nil || res.Versions != 0 || res.Creates != 0 {
		t.Fatalf("idle pass: %+v, %v", res, err)
	}
}

// Unchanged shards are the same objects in the next checkpoint.
func TestUnchangedShardsReused(t *testing.T) {
	w := newWorld(t)
	for i := range 100 {
		w.mustPut(fmt.Sprintf("doc-%03d", i), fmt.Sprint(i))
	}
	first, err := w.pass(w.store, 10)
	if err != nil {
		t.Fatal(err)
	}
	m1 := w.check()
	if len(m1.Shards) < 5 || first.ShardsNew != len(m1.Shards) {
		t.Fatalf("%d shards, %d written", len(m1.Shards), first.ShardsNew)
	}
	w.mustPut("doc-050", "changed")
	second, err := w.pass(w.store, 10)
	if err != nil {
		t.Fatal(err)
	}
	m2 := w.check()
	if second.ShardsNew != 1 || second.ShardsKept != len(m1.Shards)-1 || second.Gets != 1 {
		t.Fatalf("one changed document: %d shards written, %d reused, %d read; want 1, %d, 1", second.ShardsNew, second.ShardsKept, second.Gets, len(m1.Shards)-1)
	}
	same := 0
	for i := range m2.Shards {
		if m2.Shards[i].Key == m1.Shards[i].Key {
			same++
		}
	}
	if same != len(m1.Shards)-1 {
		t.Fatalf("%d shard objects kept, want %d", same, len(m1.Shards)-1)
	}
}

// failingStore refuses creates of keys containing fail.
type failingStore struct {
	Store
	fail string
}

func (f failingStore) Create(ctx context.Context, key string, data []byte) error {
	if strings.Contains(key, f.fail) {
		return errors.New("injected: the compactor died here")
	}
	return f.Store.Create(ctx, key, data)
}

// A pass that dies after writing shards and history but before its
// manifest leaves no checkpoint and purges nothing; the next pass
// completes it (reusing what the first wrote).
func TestCrashBeforeManifest(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	for i := range 30 {
		w.mustPut(fmt.Sprintf("d%02d", i%10), fmt.Sprint(i))
	}
	if _, err := w.pass(failingStore{w.store, "/checkpoints/"}, 4); err == nil {
		t.Fatal("the injected failure did not surface")
	}
	if m, _ := layout.Latest(ctx, w.store, w.name); m != nil {
		t.Fatalf("a checkpoint exists after the crash: %+v", m)
	}
	info, _ := w.stream.Info(ctx)
	if info.State.Msgs != 30 {
		t.Fatalf("%d messages in the stream after the crash, want all 30", info.State.Msgs)
	}
	w.check()
	res, err := w.pass(w.store, 4)
	if err != nil {
		t.Fatal(err)
	}
	if res.Creates != 1 { // only the manifest was missing
		t.Errorf("the pass after the crash created %d objects, want 1 (the manifest)", res.Creates)
	}
	w.check()
}

// A compactor whose fence fails (its process no longer leads the fold)
// stores no checkpoint, and the pass deletes nothing; once it leads again
// the next pass folds everything.
func TestFoldWithoutTheLeadStoresNoCheckpoint(t *testing.T) {
	w := newWorld(t)
	for i := range 30 {
		w.mustPut(fmt.Sprintf("d%02d", i%10), fmt.Sprint(i))
	}
	lost := errors.New("the lease is lost")
	ctx := projection.WithFence(context.Background(), func(context.Context) error { return lost })
	_, err := commitlog.FoldWorld(ctx, w.js, MustNew(Config{ShardDocs: 4}, w.store), w.name)
	if !errors.Is(err, lost) {
		t.Fatalf("pass without the lead: %v, want the fence's error", err)
	}
	if m, _ := layout.Latest(ctx, w.store, w.name); m != nil {
		t.Fatalf("a checkpoint was stored without the lead: %+v", m)
	}
	if info, _ := w.stream.Info(ctx); info.State.Msgs != 30 {
		t.Fatalf("%d messages in the stream, want all 30", info.State.Msgs)
	}
	w.check()
	if _, err := w.pass(w.store, 4); err != nil {
		t.Fatal(err)
	}
	w.check()
}

// Two compactors racing on one world never both win one checkpoint: each
// pass either writes its checkpoint or finds the identical one; and a
// different checkpoint at the same sequence is refused before any purge.
func TestRacingCompactors(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(1, 2))
	for range 200 {
		w.mustPut(fmt.Sprintf("d%02d", rng.IntN(40)), fmt.Sprint(rng.Int()))
	}
	var wg sync.WaitGroup
	results := make([]*Result, 4)
	errs := make([]error, 4)
	for i := range results {
		wg.Add(1)
		go func() { defer wg.Done(); results[i], errs[i] = w.pass(w.store, 8) }()
	}
	wg.Wait()
	wrote := 0
	for i, err := range errs {
		if err != nil {
			t.Fatalf("compactor %d: %v", i, err)
		}
		if !results[i].Raced {
			wrote++
		}
	}
	if wrote < 1 {
		t.Fatal("no compactor wrote the checkpoint")
	}
	w.check()

	// Someone else's different checkpoint at the sequence this pass will
	// reach: refused, and the stream keeps every version.
	last := w.mustPut("zz", "last")
	if err := w.store.Create(ctx, layout.CheckpointKey(w.name, last), []byte(`{"format":1,"world":"w/1","seq":1}`)); err != nil {
		t.Fatal(err)
	}
	before, _ := w.stream.Info(ctx)
	if _, err := w.pass(w.store, 8); !errors.Is(err, ErrLostRace) {
		t.Fatalf("against a different checkpoint: %v, want ErrLostRace", err)
	}
	after, _ := w.stream.Info(ctx)
	if after.State.Msgs != before.State.Msgs {
		t.Fatalf("a pass that lost its race purged %d messages", before.State.Msgs-after.State.Msgs)
	}
}

// Writers and passes interleaved at random: the oracle holds after every
// pass.
func TestRandomWritesAndPasses(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(3, 4))
	for round := range 8 {
		for range 150 {
			id := fmt.Sprintf("doc/%03d", rng.IntN(120))
			if _, err := w.put(id, fmt.Sprintf("r%d-%d", round, rng.Int()), rng.IntN(10) == 0, -1); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := w.pass(w.store, 16); err != nil {
			t.Fatal(err)
		}
		w.check()
	}
	m, _ := layout.Latest(ctx, w.store, w.name)
	info, _ := w.stream.Info(ctx)
	if docs := len(m.Shards); info.State.Msgs > 120 || docs == 0 {
		t.Errorf("%d messages left in the stream for at most 120 documents", info.State.Msgs)
	}
	t.Logf("%d versions written, %d messages left in the stream, %d shards, %d history segments, %d documents",
		len(w.acked), info.State.Msgs, len(m.Shards), len(m.History), m.Docs)
}

// diesAfterFold stores its checkpoint and then dies before FoldWorld
// deletes anything: the error stops FoldWorld before the deletions, and
// cancel (when set) makes the deletions themselves fail.
type diesAfterFold struct {
	*Compactor
	cancel context.CancelFunc
}

func (d diesAfterFold) Fold(ctx context.Context, world string, versions []projection.Version) ([]uint64, error) {
	drop, err := d.Compactor.Fold(ctx, world, versions)
	if d.cancel != nil {
		d.cancel() // the deletions find their context ended
		return drop, err
	}
	if err == nil {
		err = errors.New("injected: the compactor died before its deletions")
	}
	return nil, err
}

// streamMsgs is how many messages the stream holds.
func (w *world) streamMsgs() uint64 {
	w.t.Helper()
	info, err := w.stream.Info(context.Background())
	if err != nil {
		w.t.Fatal(err)
	}
	return info.State.Msgs
}

func (w *world) marked(seq uint64) bool {
	w.t.Helper()
	ok, err := w.store.Exists(context.Background(), DroppedKey(w.name, seq))
	if err != nil {
		w.t.Fatal(err)
	}
	return ok
}

// A pass that dies after its manifest and before its deletions leaves
// versions at or below the checkpoint that no later pass would delete; the
// next pass sweeps them (once, then marks the checkpoint), and every
// document keeps its last version in the stream, so compare-and-set
// holds.
func TestStrandedVersionsSwept(t *testing.T) {
	w := newWorld(t)
	ctx := context.Background()
	var last map[string]uint64
	round := func(n int) {
		last = map[string]uint64{}
		for i := range n {
			for d := range 10 {
				last[fmt.Sprintf("d%d", d)] = w.mustPut(fmt.Sprintf("d%d", d), fmt.Sprintf("v%d-%d", i, d))
			}
		}
	}

	// The first pass of the world dies in its deletions (its context
	// ends): the checkpoint holds 30 versions, the stream keeps all 30.
	round(3)
	dctx, cancel := context.WithCancel(ctx)
	st, err := commitlog.FoldWorld(dctx, w.js, diesAfterFold{MustNew(Config{ShardDocs: 4}, w.store), cancel}, w.name)
	if err == nil {
		t.Fatalf("the injected failure did not surface: %+v", st)
	}
	m, _ := layout.Latest(ctx, w.store, w.name)
	if m == nil || m.Seq != last["d9"] {
		t.Fatalf("the dead pass left checkpoint %+v, want one at %d", m, last["d9"])
	}
	if n := w.streamMsgs(); n != 30 || w.marked(m.Seq) {
		t.Fatalf("after the dead pass: %d messages (want 30 stranded), marked %v", n, w.marked(m.Seq))
	}
	w.check()

	// The next pass (a new compactor, as after a restart) has nothing new
	// to fold, and sweeps.
	st, err = commitlog.FoldWorld(ctx, w.js, MustNew(Config{ShardDocs: 4}, w.store), w.name)
	if err != nil {
		t.Fatal(err)
	}
	if st.Swept != 20 || st.Versions != 0 || !w.marked(m.Seq) {
		t.Fatalf("sweep: %+v, marked %v; want 20 swept, nothing folded, marked", st, w.marked(m.Seq))
	}
	if n := w.streamMsgs(); n != 10 {
		t.Fatalf("%d messages after the sweep, want one per document (10)", n)
	}
	w.check()

	// A pass on top of a marked checkpoint dies before its deletions; a
	// document is written meanwhile. The next pass sweeps the versions the
	// dead pass should have dropped (the previous last of each document,
	// and the first of the two updates), then folds the new document.
	round(2)
	if _, err := commitlog.FoldWorld(ctx, w.js, diesAfterFold{Compactor: MustNew(Config{ShardDocs: 4}, w.store)}, w.name); err == nil {
		t.Fatal("the injected failure did not surface")
	}
	m, _ = layout.Latest(ctx, w.store, w.name)
	if m.Seq != last["d9"] || w.marked(m.Seq) || w.streamMsgs() != 30 {
		t.Fatalf("after the second dead pass: checkpoint %d (want %d), marked %v, %d messages (want 30)", m.Seq, last["d9"], w.marked(m.Seq), w.streamMsgs())
	}
	// Folding on top of the unmarked checkpoint (no sweep: Fold called
	// directly) must not mark the new one: its base still has strays.
	c := MustNew(Config{ShardDocs: 4}, w.store)
	newer := w.mustPut("other", "o1")
	if _, err := c.Fold(ctx, w.name, []projection.Version{{Doc: "other", Seq: newer, Time: time.Now(), Body: []byte("o1")}}); err != nil {
		t.Fatal(err)
	}
	if err := c.Dropped(ctx, w.name, newer); err != nil || w.marked(newer) {
		t.Fatalf("a checkpoint on an unswept base was marked (%v)", err)
	}
	w.mustPut("new", "n1")
	st, err = commitlog.FoldWorld(ctx, w.js, MustNew(Config{ShardDocs: 4}, w.store), w.name)
	if err != nil {
		t.Fatal(err)
	}
	if st.Swept != 20 || st.Versions != 1 {
		t.Fatalf("second sweep: %+v, want 20 swept and 1 folded", st)
	}
	m = w.check()
	if n := w.streamMsgs(); n != 12 || !w.marked(m.Seq) {
		t.Fatalf("%d messages for 12 documents, marked %v", n, w.marked(m.Seq))
	}

	// Compare-and-set still holds on every document.
	for doc, v := range last {
		if _, err := w.put(doc, "stale", false, int64(v)-1); err == nil {
			t.Fatalf("%s: a stale version accepted after the sweep", doc)
		}
		if _, err := w.put(doc, "x", false, 0); err == nil {
			t.Fatalf(`%s: "must not exist" accepted after the sweep`, doc)
		}
		if _, err := w.put(doc, "next", false, int64(v)); err != nil {
			t.Fatalf("%s: the current version %d refused after the sweep: %v", doc, v, err)
		}
	}
	// A healthy pass marks its checkpoint, and the one after sweeps nothing.
	st, err = commitlog.FoldWorld(ctx, w.js, MustNew(Config{ShardDocs: 4}, w.store), w.name)
	if err != nil || st.Swept != 0 || st.Versions != 10 || st.Dropped != 10 {
		t.Fatalf("healthy pass: %+v, %v", st, err)
	}
	m = w.check()
	if !w.marked(m.Seq) {
		t.Fatal("a healthy pass left its checkpoint unmarked")
	}
	st, err = commitlog.FoldWorld(ctx, w.js, MustNew(Config{ShardDocs: 4}, w.store), w.name)
	if err != nil || st.Swept != 0 || st.Versions != 0 {
		t.Fatalf("idle pass: %+v, %v", st, err)
	}
}

// A pass's history is cut into segments by id range, each sorted by id and
// version, and one document's versions of a pass are never split.
func TestHistorySegmentsByIDRange(t *testing.T) {
	w := newWorld(t)
	for round := range 3 {
		for i := range 10 {
			w.mustPut(fmt.Sprintf("doc-%02d", (i*7)%10), fmt.Sprint(round, i))
		}
	}
	w.mustPut("doc-03", "last")
	c := MustNew(Config{HistoryVersions: 4}, w.store)
	if _, err := commitlog.FoldWorld(context.Background(), w.js, c, w.name); err != nil {
		t.Fatal(err)
	}
	m := w.check()
	if len(m.History) < 5 {
		t.Fatalf("%d segments for 31 versions at 4 per segment", len(m.History))
	}
	seen := map[string]int{}
	prevLast := ""
	total := 0
	for i, s := range m.History {
		if s.First > s.Last || (i > 0 && s.First <= prevLast) {
			t.Fatalf("segment %d: range [%s, %s] after %s", i, s.First, s.Last, prevLast)
		}
		prevLast = s.Last
		data, err := w.store.Get(context.Background(), s.Key)
		if err != nil {
			t.Fatal(err)
		}
		recs, err := layout.Decode(layout.KindHistory, data)
		if err != nil || len(recs) != s.Versions {
			t.Fatalf("segment %d: %d records (%v), manifest says %d", i, len(recs), err, s.Versions)
		}
		for j, r := range recs {
			if r.ID < s.First || r.ID > s.Last {
				t.Fatalf("segment %d [%s, %s] holds %s", i, s.First, s.Last, r.ID)
			}
			if j > 0 && (recs[j-1].ID > r.ID || (recs[j-1].ID == r.ID && recs[j-1].Version >= r.Version)) {
				t.Fatalf("segment %d not sorted by id and version at %d", i, j)
			}
			if k, ok := seen[r.ID]; ok && k != i {
				t.Fatalf("%s has versions in segments %d and %d of one pass", r.ID, k, i)
			}
			seen[r.ID] = i
		}
		total += len(recs)
	}
	if total != 31 {
		t.Fatalf("%d versions in history, want 31", total)
	}
}

// TestNewConfig: zero takes the defaults; a negative field is refused,
// naming it, rather than taken for the default.
func TestNewConfig(t *testing.T) {
	c, err := New(Config{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if c.cfg != (Config{ShardDocs: DefaultShardDocs, HistoryVersions: DefaultHistoryVersions}) {
		t.Errorf("defaults %+v", c.cfg)
	}
	for field, cfg := range map[string]Config{"ShardDocs": {ShardDocs: -1}, "HistoryVersions": {HistoryVersions: -1}} {
		if _, err := New(cfg, nil); err == nil || !strings.Contains(err.Error(), "compactor: "+field+" -1 is negative; set 0 for the default") {
			t.Errorf("%s negative: New returned %v", field, err)
		}
	}
}

// CheckFlags refuses a zero --compactor-shard-docs, which the flag's
// default would otherwise hide, and what Validate refuses, as usage
// errors.
func TestCheckFlags(t *testing.T) {
	var c Config
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	c.RegisterFlags(fs)
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if err := c.CheckFlags(); err != nil || c.ShardDocs != DefaultShardDocs {
		t.Fatalf("the default: %d, %v", c.ShardDocs, err)
	}
	if err := fs.Parse([]string{"--compactor-shard-docs", "0"}); err != nil {
		t.Fatal(err)
	}
	if err := c.CheckFlags(); !errors.As(err, new(envflag.UsageError)) || err.Error() != "--compactor-shard-docs must be at least 1" {
		t.Fatalf("zero shard docs: %v", err)
	}
	c = Config{ShardDocs: 1, HistoryVersions: -1}
	if err := c.CheckFlags(); !errors.As(err, new(envflag.UsageError)) || !strings.Contains(err.Error(), "HistoryVersions") {
		t.Fatalf("negative history versions: %v", err)
	}
}
