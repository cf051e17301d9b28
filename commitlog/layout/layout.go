// Package layout is the commit log's layout in a bucket: the record
// files (shards and history segments) and the checkpoint manifests the
// compactor (projectors/compactor) writes, and how they are read back (the
// commits edge reads folded versions and opens worlds from them).
//
// Under worlds/<world token>/:
//
//	shards/<sha256/128 hex>.zst     documents of an id range at their latest version, sorted by id
//	history/<from>-<to>-<i>.zst     the versions in the sequence range (from, to] of an id range, by id then version
//	checkpoints/<seq>.json          the manifest: the world up to seq
//
// A manifest is created last, conditionally: it is the commit point of a
// pass, so a reader never sees a checkpoint whose objects are missing.
package layout

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strings"
	"sync"
	"time"

	"github.com/millrace/millrace/bucket"
)

// Reader is what reading a world needs of a bucket (*bucket.Bucket).
type Reader interface {
	Get(ctx context.Context, key string) ([]byte, error)
	List(ctx context.Context, prefix string) ([]bucket.Object, error)
}

// Manifest is a checkpoint: the world's state up to Seq. Docs counts the
// live documents.
type Manifest struct {
	Format  int        `json:"format"`
	World   string     `json:"world"`
	Seq     uint64     `json:"seq"`
	Docs    int        `json:"docs"`
	Shards  []ShardRef `json:"shards"`
	History []Segment  `json:"history"`
}

// ManifestFormat is the format number manifests are written with.
const ManifestFormat = 1

// ShardRef names a shard object and the id range it holds: Docs records,
// of which Live are not tombstones. A deleted document stays in its shard
// as its tombstone for as long as the tombstone is its last version (and
// so is kept in the stream): that is how the next pass knows it has a
// version to purge when the document is written again.
type ShardRef struct {
	Key   string `json:"key"`
	First string `json:"first"`
	Last  string `json:"last"`
	Docs  int    `json:"docs"`
	Live  int    `json:"live"`
	Bytes int    `json:"bytes"`
}

// Segment names a history object: every version in (From, To] of the
// documents with ids in [First, Last], sorted by id and then version. A
// pass cuts its versions into segments by id range, never splitting one
// document's versions, so a version or a document's history of a pass is
// in one small object (a reader finds it from the manifest and decodes
// only that). Empty First and Last: the segment may hold any id.
type Segment struct {
	Key      string `json:"key"`
	From     uint64 `json:"from"`
	To       uint64 `json:"to"`
	First    string `json:"first,omitempty"`
	Last     string `json:"last,omitempty"`
	Versions int    `json:"versions"`
}

// Holds reports whether the segment's id range takes id.
func (s Segment) Holds(id string) bool {
	return (s.First == "" && s.Last == "") || (s.First <= id && id <= s.Last)
}

// worldToken is a world's key segment: path-escaped (no '/'), and prefixed
// so that no world makes an empty, "." or ".." segment.
func worldToken(world string) string { return "w-" + url.PathEscape(world) }

// Prefix is where a world's objects live.
func Prefix(world string) string { return "worlds/" + worldToken(world) + "/" }

// CheckpointPrefix is where a world's manifests live.
func CheckpointPrefix(world string) string { return Prefix(world) + "checkpoints/" }

// CheckpointKey names the manifest of the checkpoint at seq.
func CheckpointKey(world string, seq uint64) string {
	return fmt.Sprintf("%s%020d.json", CheckpointPrefix(world), seq)
}

// HistoryKey names the i-th history segment (in id order) of the pass
// over (from, to].
func HistoryKey(world string, from, to uint64, i int) string {
	return fmt.Sprintf("%shistory/%020d-%020d-%06d.zst", Prefix(world), from, to, i)
}

// ShardKey names a shard by the hex digest of its content.
func ShardKey(world, digest string) string { return Prefix(world) + "shards/" + digest + ".zst" }

// WorldsPrefix is where every world's objects live.
const WorldsPrefix = "worlds/"

// Latest returns the world's latest checkpoint, or nil when it has none.
func Latest(ctx context.Context, r Reader, world string) (*Manifest, error) {
	m, _, err := LatestAt(ctx, r, world)
	return m, err
}

// LatestAt is Latest with the time its manifest was written (zero where
// the store does not say).
func LatestAt(ctx context.Context, r Reader, world string) (*Manifest, time.Time, error) {
	objs, err := r.List(ctx, CheckpointPrefix(world))
	if err != nil {
		return nil, time.Time{}, err
	}
	for i := len(objs) - 1; i >= 0; i-- {
		if !strings.HasSuffix(objs[i].Key, ".json") {
			continue
		}
		data, err := r.Get(ctx, objs[i].Key)
		if err != nil {
			return nil, time.Time{}, err
		}
		var m Manifest
		if err := json.Unmarshal(data, &m); err != nil || m.Format != ManifestFormat || m.World != world {
			return nil, time.Time{}, fmt.Errorf("commitlog: checkpoint %s is not a format-%d manifest of world %q", objs[i].Key, ManifestFormat, world)
		}
		return &m, objs[i].ModTime, nil
	}
	return nil, time.Time{}, nil
}

// DirLister is what listing the worlds needs of a bucket (*bucket.Bucket).
type DirLister interface {
	Dirs(ctx context.Context, prefix string) ([]string, error)
}

// Worlds lists the worlds that have objects in the bucket (those the
// compactor has folded at least once), sorted by their key segments: one
// listing of WorldsPrefix, not of the worlds' objects.
func Worlds(ctx context.Context, d DirLister) ([]string, error) {
	dirs, err := d.Dirs(ctx, WorldsPrefix)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, dir := range dirs {
		token := strings.TrimSuffix(strings.TrimPrefix(dir, WorldsPrefix), "/")
		esc, ok := strings.CutPrefix(token, "w-")
		if !ok {
			continue // not a world's
		}
		if world, err := url.PathUnescape(esc); err == nil {
			out = append(out, world)
		}
	}
	return out, nil
}

// ReadShard reads one shard of a checkpoint.
func ReadShard(ctx context.Context, r Reader, s ShardRef) ([]Record, error) {
	return read(ctx, r, KindShard, s.Key)
}

// ReadSegment reads one history segment.
func ReadSegment(ctx context.Context, r Reader, s Segment) ([]Record, error) {
	return read(ctx, r, KindHistory, s.Key)
}

func read(ctx context.Context, r Reader, kind byte, key string) ([]Record, error) {
	data, err := r.Get(ctx, key)
	if err != nil {
		return nil, fmt.Errorf("commitlog: %s: %w", key, err)
	}
	recs, err := Decode(kind, data)
	if err != nil {
		return nil, fmt.Errorf("commitlog: %s: %w", key, err)
	}
	return recs, nil
}

// loadConcurrency is how many shards Load reads at once: a bucket's
// latency, not its bandwidth, bounds one read of a few hundred KiB.
const loadConcurrency = 8

// Load reads a checkpoint's documents, sorted by id: the live ones, and
// the deleted ones as their tombstones (Deleted).
func Load(ctx context.Context, r Reader, m *Manifest) ([]Record, error) {
	parts := make([][]Record, len(m.Shards))
	errs := make([]error, len(m.Shards))
	sem := make(chan struct{}, loadConcurrency)
	var wg sync.WaitGroup
	for i, s := range m.Shards {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			parts[i], errs[i] = ReadShard(ctx, r, s)
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	n := 0
	for _, p := range parts {
		n += len(p)
	}
	out := make([]Record, 0, n)
	for _, p := range parts {
		out = append(out, p...)
	}
	return out, nil
}
