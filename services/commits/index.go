package commits

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/commitlog/layout"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/subjects"
)

// A world index is what List reads: every document of a world with its
// latest version, in memory. It opens from the world's latest checkpoint
// (its shards name every document folded so far) and then follows the
// world's messages after the checkpoint with an ordered, headers-only
// consumer, so it stays current while it is open. This is the edge's
// cold start: the stream alone would mean reading one message per
// document of the world.
//
// Versions the compactor deletes after the index opened do not matter:
// it deletes only versions that are not their document's last, and every
// document's last version stays in the stream.

type entry struct {
	version uint64
	size    uint32
	deleted bool
	at      int64 // unix ns
}

type worldIndex struct {
	world  string
	opened chan struct{} // closed when the open finished (err tells how)
	err    error

	mu       sync.Mutex
	changed  *sync.Cond // applied moved
	docs     map[string]entry
	sorted   []string           // every id of docs, sorted, but those in unsorted
	unsorted []string           // ids added since the last sort
	applied  uint64             // the last stream sequence applied
	tail     int                // messages applied after the checkpoint
	cons     jetstream.Consumer // the ordered consumer following the world
	cc       jetstream.ConsumeContext
	used     time.Time
}

// indexes are the worlds open on this edge, at most max of them; the
// least recently used closes when another opens.
type indexes struct {
	s   *Server
	max int

	mu     sync.Mutex
	worlds map[string]*worldIndex
}

func newIndexes(s *Server, max int) *indexes {
	return &indexes{s: s, max: max, worlds: map[string]*worldIndex{}}
}

// get returns the world's index, opening it when it is not open.
func (x *indexes) get(ctx context.Context, world string) (*worldIndex, error) {
	x.mu.Lock()
	w := x.worlds[world]
	if w == nil {
		w = &worldIndex{world: world, opened: make(chan struct{}), docs: map[string]entry{}}
		w.changed = sync.NewCond(&w.mu)
		x.evictLocked()
		x.worlds[world] = w
		x.s.m.worldsOpen.Set(float64(len(x.worlds)))
		go x.open(w)
	}
	x.mu.Unlock()
	select {
	case <-w.opened:
	case <-ctx.Done():
		return nil, unavailable(ctx.Err())
	}
	if w.err != nil {
		return nil, w.err
	}
	w.mu.Lock()
	w.used = time.Now()
	w.mu.Unlock()
	return w, nil
}

// evictLocked closes the least recently used open world when max are
// open. Worlds still opening are not evicted.
func (x *indexes) evictLocked() {
	if len(x.worlds) < x.max {
		return
	}
	var oldest *worldIndex
	var oldestUsed time.Time
	for _, w := range x.worlds {
		select {
		case <-w.opened:
		default:
			continue
		}
		w.mu.Lock()
		used := w.used
		w.mu.Unlock()
		if oldest == nil || used.Before(oldestUsed) {
			oldest, oldestUsed = w, used
		}
	}
	if oldest != nil {
		x.closeLocked(oldest)
	}
}

func (x *indexes) closeLocked(w *worldIndex) {
	delete(x.worlds, w.world)
	x.s.m.worldsOpen.Set(float64(len(x.worlds)))
	w.mu.Lock()
	if w.cc != nil {
		w.cc.Stop()
	}
	w.mu.Unlock()
}

// close stops every open world.
func (x *indexes) close() {
	x.mu.Lock()
	open := make([]*worldIndex, 0, len(x.worlds))
	for _, w := range x.worlds {
		open = append(open, w)
	}
	x.mu.Unlock()
	for _, w := range open {
		<-w.opened
		x.mu.Lock()
		if x.worlds[w.world] == w {
			x.closeLocked(w)
		}
		x.mu.Unlock()
	}
}

// openTimeout bounds opening one world (reading its checkpoint).
const openTimeout = 2 * time.Minute

// open loads the world's checkpoint and starts following its tail. On
// failure the world leaves the open set, so the next call tries again.
func (x *indexes) open(w *worldIndex) {
	defer close(w.opened)
	ctx, cancel := context.WithTimeout(context.Background(), openTimeout)
	defer cancel()
	start := time.Now()
	var m *layout.Manifest
	if x.s.folded != nil {
		var err error
		if m, err = x.s.folded.manifest(ctx, w.world, start, 0); err != nil {
			w.err = unavailable(fmt.Errorf("the world's checkpoint: %w", err))
		} else if m != nil {
			recs, err := layout.Load(ctx, x.s.folded.store, m)
			if err != nil {
				w.err = unavailable(fmt.Errorf("the world's checkpoint: %w", err))
			}
			// Shards come in id order, each sorted: so is their sequence.
			// A map grown one insert at a time spent most of an open
			// rehashing (BenchmarkOpenWorld).
			w.docs = make(map[string]entry, len(recs)+len(recs)/8)
			w.sorted = make([]string, 0, len(recs))
			for _, r := range recs {
				w.docs[r.ID] = entry{version: r.Version, size: uint32(len(r.Body)), deleted: r.Deleted, at: r.Time.UnixNano()}
				w.sorted = append(w.sorted, r.ID)
			}
			w.applied = m.Seq
		}
	}
	docs := len(w.docs) // from the checkpoint; apply runs from here on
	if w.err == nil {
		cons, err := x.s.js.OrderedConsumer(ctx, subjects.StreamCommits, jetstream.OrderedConsumerConfig{
			FilterSubjects: []string{subjects.CommitsWorldFilter(w.world)},
			DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
			OptStartSeq:    w.applied + 1,
			HeadersOnly:    true,
		})
		if err == nil {
			w.cons = cons
			w.cc, err = cons.Consume(w.apply)
		}
		if err != nil {
			w.err = unavailable(fmt.Errorf("following the world: %w", err))
		}
	}
	if w.err != nil {
		x.mu.Lock()
		if x.worlds[w.world] == w {
			delete(x.worlds, w.world)
			x.s.m.worldsOpen.Set(float64(len(x.worlds)))
		}
		x.mu.Unlock()
		x.s.log.Warn("world not opened", "world", w.world, "err", w.err)
		return
	}
	took := time.Since(start)
	x.s.m.worldOpen.Observe(took.Seconds())
	var from uint64
	if m != nil {
		from = m.Seq
	}
	x.s.log.Info("world opened", "world", w.world, "checkpoint_docs", docs, "checkpoint", from, "seconds", took.Seconds())
}

// applyHook, when set (tests), runs before each message is applied.
var applyHook func()

// apply takes one message of the world's tail (headers only).
func (w *worldIndex) apply(msg jetstream.Msg) {
	if applyHook != nil {
		applyHook()
	}
	meta, err := msg.Metadata()
	if err != nil {
		return
	}
	_, doc, ok := subjects.ParseCommits(msg.Subject())
	hdr := msg.Headers()
	size, _ := strconv.ParseUint(hdr.Get(nats.MsgSize), 10, 32)
	w.mu.Lock()
	defer w.mu.Unlock()
	w.tail++
	if ok {
		old, had := w.docs[doc]
		if !had {
			w.unsorted = append(w.unsorted, doc)
		}
		if meta.Sequence.Stream > old.version {
			w.docs[doc] = entry{version: meta.Sequence.Stream, size: uint32(size),
				deleted: hdr.Get(envelope.Kind) == envelope.KindDelete, at: meta.Timestamp.UnixNano()}
		}
	}
	if meta.Sequence.Stream > w.applied {
		w.applied = meta.Sequence.Stream
		w.changed.Broadcast()
	}
}

// catchUp waits until the index holds every version up to seq.
func (w *worldIndex) catchUp(ctx context.Context, seq uint64) error {
	stop := context.AfterFunc(ctx, func() {
		w.mu.Lock()
		w.changed.Broadcast()
		w.mu.Unlock()
	})
	defer stop()
	w.mu.Lock()
	defer w.mu.Unlock()
	for w.applied < seq {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		w.changed.Wait()
	}
	return nil
}

// page lists up to n live documents with ids starting with prefix, after
// the id after, in id order; more tells whether any may follow.
func (w *worldIndex) page(prefix, after string, n int) (ids []string, entries []entry, more bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if len(w.unsorted) > 0 {
		slices.Sort(w.unsorted)
		w.sorted = mergeSorted(w.sorted, w.unsorted)
		w.unsorted = w.unsorted[:0]
	}
	from := prefix
	if after > from {
		from = after
	}
	i, found := slices.BinarySearch(w.sorted, from)
	if found && from == after {
		i++
	}
	for ; i < len(w.sorted); i++ {
		id := w.sorted[i]
		if !strings.HasPrefix(id, prefix) {
			break
		}
		e := w.docs[id]
		if e.deleted {
			continue
		}
		if len(ids) == n {
			return ids, entries, true
		}
		ids, entries = append(ids, id), append(entries, e)
	}
	return ids, entries, false
}

// mergeSorted merges two sorted lists of distinct ids.
func mergeSorted(a, b []string) []string {
	out := make([]string, 0, len(a)+len(b))
	i, j := 0, 0
	for i < len(a) && j < len(b) {
		if a[i] < b[j] {
			out = append(out, a[i])
			i++
		} else {
			out = append(out, b[j])
			j++
		}
	}
	out = append(out, a[i:]...)
	return append(out, b[j:]...)
}

// listTarget is the stream sequence the world's index must have applied
// to hold every write acknowledged before the call. Its consumer says it
// cheaply: with nothing pending, the last message it delivered. Otherwise
// (the index is behind, or its consumer is being recreated) the world's
// last message, which costs the server a search of its subject index
// (GetLastMsgForSubject on a wildcard), once per List page: too much to
// do every time on a stream of a million documents.
func (s *Server) listTarget(ctx context.Context, w *worldIndex, world string) (uint64, error) {
	if info, err := w.cons.Info(ctx); err == nil && info.NumPending == 0 {
		return info.Delivered.Stream, nil
	}
	last, err := s.stream.GetLastMsgForSubject(ctx, subjects.CommitsWorldFilter(world))
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return 0, nil
	case err != nil:
		return 0, err
	}
	return last.Sequence, nil
}

// list answers List: it waits until the world's index holds every write
// acknowledged before the call, then pages it.
func (s *Server) list(ctx context.Context, world, prefix, after string, pageSize uint32) ([]string, []entry, bool, error) {
	if err := checkWorld(world); err != nil {
		return nil, nil, false, invalid(err)
	}
	if len(prefix) > MaxIDBytes || len(after) > MaxIDBytes {
		return nil, nil, false, invalid(fmt.Errorf("prefix and after_id are at most %d bytes", MaxIDBytes))
	}
	switch {
	case pageSize == 0:
		pageSize = defaultPageSize
	case pageSize > MaxPageSize:
		return nil, nil, false, invalid(fmt.Errorf("page size %d is more than %d", pageSize, MaxPageSize))
	}
	w, err := s.index.get(ctx, world)
	if err != nil {
		return nil, nil, false, err
	}
	target, err := s.listTarget(ctx, w, world)
	if err != nil {
		return nil, nil, false, unavailable(err)
	}
	wait, cancel := context.WithTimeout(ctx, s.cfg.ListWait)
	defer cancel()
	if err := w.catchUp(wait, target); err != nil {
		if ctx.Err() != nil {
			return nil, nil, false, unavailable(ctx.Err())
		}
		return nil, nil, false, unavailable(fmt.Errorf("the world's index did not reach version %d within %s", target, s.cfg.ListWait))
	}
	ids, entries, more := w.page(prefix, after, int(pageSize))
	return ids, entries, more, nil
}
