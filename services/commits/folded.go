package commits

import (
	"cmp"
	"container/list"
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/millrace/millrace/commitlog/layout"
)

// folded reads what the compactor moved out of the stream: versions from
// history segments, documents from shards. Record files are immutable
// (content-addressed shards; a segment's key is its sequence range), so
// decoded ones are kept in a cache bounded by size.
//
// Manifests are not immutable knowledge: a newer checkpoint may exist.
// The compactor writes a checkpoint before it deletes anything it covers,
// so a manifest read after the stream said "not there" covers whatever was
// deleted before that read. Each lookup says how fresh a manifest it needs.
type folded struct {
	store layout.Reader

	mu     sync.Mutex
	worlds map[string]*manifestCache
	files  *fileCache
}

type manifestCache struct {
	mu      sync.Mutex // one fetch at a time per world
	m       *layout.Manifest
	fetched time.Time
}

func newFolded(store layout.Reader, cacheBytes int) *folded {
	return &folded{store: store, worlds: map[string]*manifestCache{}, files: newFileCache(cacheBytes)}
}

// manifest returns the world's latest checkpoint (nil: none), read from
// the bucket unless the one in memory was read after notBefore or already
// covers seq.
func (f *folded) manifest(ctx context.Context, world string, notBefore time.Time, seq uint64) (*layout.Manifest, error) {
	f.mu.Lock()
	c := f.worlds[world]
	if c == nil {
		c = &manifestCache{}
		f.worlds[world] = c
	}
	f.mu.Unlock()
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m != nil && seq > 0 && c.m.Seq >= seq {
		return c.m, nil
	}
	if !c.fetched.IsZero() && !c.fetched.Before(notBefore) {
		return c.m, nil
	}
	at := time.Now()
	m, err := layout.Latest(ctx, f.store, world)
	if err != nil {
		return nil, err
	}
	c.m, c.fetched = m, at
	return m, nil
}

// version finds version seq of document id in the world's history
// segments (nil: the checkpoints hold no such version). asked is when the
// stream was found not to hold it.
func (f *folded) version(ctx context.Context, world, id string, seq uint64, asked time.Time) (*layout.Record, error) {
	m, err := f.manifest(ctx, world, asked, seq)
	if err != nil || m == nil || m.Seq < seq {
		return nil, err
	}
	// Segments are in pass order, and in id order within a pass: the
	// pass holding seq starts at the first segment whose range reaches it.
	i, _ := slices.BinarySearchFunc(m.History, seq, func(s layout.Segment, v uint64) int { return cmp.Compare(s.To, v) })
	for ; i < len(m.History) && m.History[i].From < seq; i++ {
		s := m.History[i]
		if !s.Holds(id) {
			continue
		}
		recs, err := f.read(ctx, layout.KindHistory, s.Key)
		if err != nil {
			return nil, err
		}
		if r := find(recs, id, seq); r != nil {
			return r, nil
		}
	}
	return nil, nil
}

// find returns the record of document id at version seq in a segment
// (sorted by id, then version).
func find(recs []layout.Record, id string, seq uint64) *layout.Record {
	j, _ := slices.BinarySearchFunc(recs, id, func(r layout.Record, id string) int { return strings.Compare(r.ID, id) })
	for ; j < len(recs) && recs[j].ID == id; j++ {
		if recs[j].Version == seq {
			return &recs[j]
		}
	}
	return nil
}

// latest finds document id in the world's latest checkpoint (nil: not
// there).
func (f *folded) latest(ctx context.Context, world, id string, asked time.Time) (*layout.Record, error) {
	m, err := f.manifest(ctx, world, asked, 0)
	if err != nil || m == nil {
		return nil, err
	}
	for _, s := range m.Shards {
		if id < s.First || id > s.Last {
			continue
		}
		recs, err := f.read(ctx, layout.KindShard, s.Key)
		if err != nil {
			return nil, err
		}
		if j, ok := slices.BinarySearchFunc(recs, id, func(r layout.Record, id string) int { return strings.Compare(r.ID, id) }); ok {
			return &recs[j], nil
		}
		return nil, nil
	}
	return nil, nil
}

// history returns up to n versions of document id after seq from the
// world's history segments, oldest first, and the sequence the segments
// cover up to (the stream holds every version after it). asked is when
// the stream was read. It reads the one segment of each pass since after
// whose id range holds the document.
func (f *folded) history(ctx context.Context, world, id string, after uint64, n int, asked time.Time) ([]layout.Record, uint64, error) {
	m, err := f.manifest(ctx, world, asked, 0)
	if err != nil || m == nil {
		return nil, 0, err
	}
	var out []layout.Record
	i, _ := slices.BinarySearchFunc(m.History, after+1, func(s layout.Segment, v uint64) int { return cmp.Compare(s.To, v) })
	for ; i < len(m.History); i++ {
		s := m.History[i]
		if !s.Holds(id) {
			continue
		}
		recs, err := f.read(ctx, layout.KindHistory, s.Key)
		if err != nil {
			return nil, 0, err
		}
		j, _ := slices.BinarySearchFunc(recs, id, func(r layout.Record, id string) int { return strings.Compare(r.ID, id) })
		for ; j < len(recs) && recs[j].ID == id; j++ {
			if recs[j].Version > after {
				out = append(out, recs[j])
				if len(out) == n {
					return out, m.Seq, nil
				}
			}
		}
	}
	return out, m.Seq, nil
}

func (f *folded) read(ctx context.Context, kind byte, key string) ([]layout.Record, error) {
	if recs, ok := f.files.get(key); ok {
		return recs, nil
	}
	var (
		recs []layout.Record
		err  error
	)
	if kind == layout.KindShard {
		recs, err = layout.ReadShard(ctx, f.store, layout.ShardRef{Key: key})
	} else {
		recs, err = layout.ReadSegment(ctx, f.store, layout.Segment{Key: key})
	}
	if err != nil {
		return nil, err
	}
	f.files.put(key, recs)
	return recs, nil
}

// fileCache keeps decoded record files, least recently used out first,
// within a budget of bytes (ids and bodies, plus a fixed cost per record).
type fileCache struct {
	mu     sync.Mutex
	budget int
	used   int
	order  *list.List // of *cachedFile, most recent first
	byKey  map[string]*list.Element
}

type cachedFile struct {
	key  string
	recs []layout.Record
	size int
}

// recordOverhead is what a decoded record costs beside its id and body.
const recordOverhead = 96

func newFileCache(budget int) *fileCache {
	return &fileCache{budget: budget, order: list.New(), byKey: map[string]*list.Element{}}
}

func (c *fileCache) get(key string) ([]layout.Record, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	e, ok := c.byKey[key]
	if !ok {
		return nil, false
	}
	c.order.MoveToFront(e)
	return e.Value.(*cachedFile).recs, true
}

func (c *fileCache) put(key string, recs []layout.Record) {
	size := 0
	for _, r := range recs {
		size += len(r.ID) + len(r.Body) + recordOverhead
	}
	if size > c.budget {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.byKey[key]; ok {
		return
	}
	c.byKey[key] = c.order.PushFront(&cachedFile{key: key, recs: recs, size: size})
	c.used += size
	for c.used > c.budget {
		e := c.order.Back()
		f := e.Value.(*cachedFile)
		c.order.Remove(e)
		delete(c.byKey, f.key)
		c.used -= f.size
	}
}
