// Package compactor folds a world's commit log into a bucket: shards (the
// documents of an id range at their latest version, a deleted one as its
// tombstone), history segments
// (every version of a sequence range) and a checkpoint manifest naming
// them, then purges the folded versions from the COMMITS stream.
//
// It is a projection.Folder: commitlog.FoldWorld reads a world's versions
// after the latest checkpoint (Covered), up to the world's last message at
// the start of the pass, hands them to Fold, and deletes from the stream
// the versions Fold returns. Objects are written before the manifest, and the manifest last with a
// conditional create: a pass that dies between them leaves orphans and no
// torn checkpoint, and of two compactors racing for one checkpoint one
// wins (the other finds an identical manifest, or a different one, and
// says so). The manifest is stored only while the fold's lease holds
// (projection.Fence, just before it): a process that no longer leads the
// fold leaves orphans, never a checkpoint. Shards are content-addressed, so a shard no change touched is
// the same object in the next checkpoint.
//
// The stream keeps every document's last version: Fold returns, to be
// deleted by sequence, exactly the versions it folded that are not their
// document's last (those of the pass, and the previous checkpoint's last version of
// each document it changed). A subject purged of every version would
// accept "must not exist" again (commitlog/cas_test.go), and compare-and-set
// must stay JetStream's alone. Deleting by sequence rather than purging a
// subject below a version also costs the server a lookup instead of a
// scan: a pass of 20,000 updates ran at 7,800 documents/s with purges and
// 29,000 with deletions (BenchmarkCompact).
//
// It is also a projection.Dropper: once FoldWorld's deletions for a
// checkpoint have all succeeded, Dropped writes a marker beside the
// manifest (checkpoints/<seq>.dropped). A pass that died between its
// manifest and the end of its deletions leaves the latest checkpoint
// unmarked; the next pass finds that (Undropped), and FoldWorld sweeps the
// world's versions at or below the checkpoint that are older than their
// document's version in it before folding anything new.
package compactor

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog/layout"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/streams/projection"
)

// Store is what the compactor needs of a bucket (*bucket.Bucket).
type Store interface {
	Create(ctx context.Context, key string, data []byte) error
	Get(ctx context.Context, key string) ([]byte, error)
	List(ctx context.Context, prefix string) ([]bucket.Object, error)
	Equal(ctx context.Context, key string, data []byte) (bool, error)
}

// Config of a compactor. A zero field takes its default; a negative one is
// refused by New.
type Config struct {
	// ShardDocs is the number of documents a shard is cut at; a shard
	// that grows past twice this is split. Default 4096.
	ShardDocs int
	// HistoryVersions is about how many versions a history segment holds
	// (a document's versions of one pass are never split). Small segments
	// keep a read of one folded version cheap: the reader decodes one
	// segment of the pass, not the pass. Default 2048.
	HistoryVersions int
}

// Defaults.
const (
	DefaultShardDocs       = 4096
	DefaultHistoryVersions = 2048
)

// Validate reports a negative field.
func (c Config) Validate() error {
	return errors.Join(
		knob.NotNegative("compactor", "ShardDocs", c.ShardDocs, DefaultShardDocs),
		knob.NotNegative("compactor", "HistoryVersions", c.HistoryVersions, DefaultHistoryVersions),
	)
}

// RegisterFlags registers the flag of the one knob a process sets,
// ShardDocs, with its variable, so that every command that compacts takes
// the same one.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	envflag.Int(fs, &c.ShardDocs, "compactor-shard-docs", "MILLRACE_COMPACTOR_SHARD_DOCS", DefaultShardDocs,
		"documents per shard object of a checkpoint; a shard past twice this is split")
}

// CheckFlags is Validate for a Config RegisterFlags filled, as an
// envflag.UsageError: the flag shows its default, so a zero was asked for
// and is refused rather than silently replaced.
func (c Config) CheckFlags() error {
	if c.ShardDocs < 1 {
		return envflag.Usage("--compactor-shard-docs must be at least 1")
	}
	if err := c.Validate(); err != nil {
		return envflag.Usage(err.Error())
	}
	return nil
}

func (c Config) withDefaults() Config {
	if c.ShardDocs == 0 {
		c.ShardDocs = DefaultShardDocs
	}
	if c.HistoryVersions == 0 {
		c.HistoryVersions = DefaultHistoryVersions
	}
	return c
}

// Compactor folds worlds of the commit log into a Store. It keeps no state
// but the result of each world's last pass (Last).
type Compactor struct {
	cfg   Config
	store Store

	mu   sync.Mutex
	last map[string]*Result
	// owed is, per world, the checkpoint whose drops this compactor is
	// carrying out: the one Undropped handed out for a sweep, or the one
	// Fold stored on top of a marked checkpoint. Dropped marks only that
	// one: a checkpoint stored by another compactor, or on top of an
	// unmarked one, may still have versions to sweep.
	owed map[string]uint64
}

var _ projection.Dropper = (*Compactor)(nil)

// New makes a compactor writing to store. One Compactor may fold many
// worlds at once, but each world one pass at a time (as commitlog.FoldWorld
// under commitlog.FoldRunner does).
// It returns what is wrong with cfg, if anything.
func New(cfg Config, store Store) (*Compactor, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Compactor{cfg: cfg.withDefaults(), store: store, last: map[string]*Result{}, owed: map[string]uint64{}}, nil
}

// MustNew is New for configurations known to be valid (tests, tools with
// the defaults).
func MustNew(cfg Config, store Store) *Compactor {
	c, err := New(cfg, store)
	if err != nil {
		panic(err)
	}
	return c
}

// Last is what the last Fold of world did (nil: none yet).
func (c *Compactor) Last(world string) *Result {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.last[world]
}

// Covered is the sequence of the world's latest checkpoint (0: none).
func (c *Compactor) Covered(ctx context.Context, world string) (uint64, error) {
	m, _, err := c.latest(ctx, world)
	if err != nil || m == nil {
		return 0, err
	}
	return m.Seq, nil
}

// droppedSuffix ends the key of the marker that says a checkpoint's drops
// are done; layout.Latest reads only .json keys, so the marker is
// invisible to readers of checkpoints.
const droppedSuffix = ".dropped"

// DroppedKey names the marker written once the stream has dropped what
// the checkpoint at seq made droppable.
func DroppedKey(world string, seq uint64) string {
	return strings.TrimSuffix(layout.CheckpointKey(world, seq), ".json") + droppedSuffix
}

// latest is layout.Latest, and whether the checkpoint's drops are
// marked done, from one listing. A world with no checkpoint is marked:
// nothing is at or below 0.
func (c *Compactor) latest(ctx context.Context, world string) (*layout.Manifest, bool, error) {
	objs, err := c.store.List(ctx, layout.CheckpointPrefix(world))
	if err != nil {
		return nil, false, err
	}
	for i := len(objs) - 1; i >= 0; i-- {
		if !strings.HasSuffix(objs[i].Key, ".json") {
			continue
		}
		data, err := c.store.Get(ctx, objs[i].Key)
		if err != nil {
			return nil, false, err
		}
		var m layout.Manifest
		if err := json.Unmarshal(data, &m); err != nil || m.Format != layout.ManifestFormat || m.World != world {
			return nil, false, fmt.Errorf("commitlog: checkpoint %s is not a format-%d manifest of world %q", objs[i].Key, layout.ManifestFormat, world)
		}
		marker := DroppedKey(world, m.Seq)
		_, marked := slices.BinarySearchFunc(objs, marker, func(o bucket.Object, k string) int { return strings.Compare(o.Key, k) })
		return &m, marked, nil
	}
	return nil, true, nil
}

// Undropped returns the world's latest checkpoint when its drops are not
// marked done, with the version of each document in it (read shard by
// shard, keeping ids and versions only: a sweep of a world of 1,000,000
// documents holds some tens of MB, not their bodies).
func (c *Compactor) Undropped(ctx context.Context, world string) (uint64, func(string) (uint64, bool), error) {
	m, marked, err := c.latest(ctx, world)
	if err != nil || marked {
		return 0, nil, err
	}
	n := 0
	for _, s := range m.Shards {
		n += s.Docs
	}
	ids, vers := make([]string, 0, n), make([]uint64, 0, n)
	for _, s := range m.Shards {
		recs, err := layout.ReadShard(ctx, c.store, s)
		if err != nil {
			return 0, nil, err
		}
		for _, r := range recs {
			ids, vers = append(ids, r.ID), append(vers, r.Version)
		}
	}
	c.mu.Lock()
	c.owed[world] = m.Seq
	c.mu.Unlock()
	return m.Seq, func(doc string) (uint64, bool) {
		i, ok := slices.BinarySearch(ids, doc)
		if !ok {
			return 0, false
		}
		return vers[i], true
	}, nil
}

// Dropped writes the marker of the checkpoint at seq, if it is the one
// this compactor owes: the checkpoint Undropped returned (now swept), or
// the one its last Fold of the world stored on top of a marked checkpoint.
func (c *Compactor) Dropped(ctx context.Context, world string, seq uint64) error {
	c.mu.Lock()
	owed, ok := c.owed[world]
	c.mu.Unlock()
	if !ok || owed != seq {
		return nil
	}
	data, err := json.Marshal(struct {
		World string `json:"world"`
		Seq   uint64 `json:"seq"`
	}{world, seq})
	if err != nil {
		return err
	}
	if err := c.store.Create(ctx, DroppedKey(world, seq), data); err != nil && !errors.Is(err, bucket.ErrExists) {
		return fmt.Errorf("compactor: mark the drops of checkpoint %d of %q: %w", seq, world, err)
	}
	c.mu.Lock()
	if c.owed[world] == seq {
		delete(c.owed, world)
	}
	c.mu.Unlock()
	return nil
}

// ErrLostRace is returned when another compactor wrote a different
// checkpoint at the same sequence first.
var ErrLostRace = errors.New("compactor: another compactor wrote a different checkpoint at this sequence")

// Result tells what one pass did.
type Result struct {
	World       string  `json:"world"`
	From        uint64  `json:"from"` // the previous checkpoint's sequence
	To          uint64  `json:"to"`   // this checkpoint's (From when nothing was new)
	Versions    int     `json:"versions"`
	DocsChanged int     `json:"docs_changed"`
	Docs        int     `json:"docs"`
	ShardsNew   int     `json:"shards_written"`
	ShardsKept  int     `json:"shards_reused"`
	Dropped     int     `json:"versions_dropped"`
	Gets        int     `json:"bucket_gets"`
	Creates     int     `json:"bucket_creates"`
	Raced       bool    `json:"raced,omitempty"` // another compactor wrote this same checkpoint first
	Seconds     float64 `json:"seconds"`
}

// Fold folds versions (in sequence order) into a new checkpoint and
// returns the sequences the stream may drop. Versions at or below the
// latest checkpoint (another compactor got there first) are skipped.
func (c *Compactor) Fold(ctx context.Context, world string, versions []projection.Version) ([]uint64, error) {
	start := time.Now()
	c.mu.Lock()
	delete(c.owed, world)
	c.mu.Unlock()
	m, baseMarked, err := c.latest(ctx, world)
	if err != nil {
		return nil, err
	}
	if m == nil {
		m = &layout.Manifest{Format: layout.ManifestFormat, World: world}
	}
	res := &Result{World: world, From: m.Seq, To: m.Seq}
	defer func() {
		res.Seconds = time.Since(start).Seconds()
		c.mu.Lock()
		c.last[world] = res
		c.mu.Unlock()
	}()
	tail := make([]layout.Record, 0, len(versions))
	for _, v := range versions {
		if v.Seq > m.Seq {
			tail = append(tail, layout.Record{ID: v.Doc, Version: v.Seq, Deleted: v.Deleted, Time: v.Time, Body: v.Body})
		}
	}
	if len(tail) == 0 {
		return nil, nil
	}
	res.Versions, res.To = len(tail), tail[len(tail)-1].Version

	// The history segments: every version of the pass, by id range.
	segs, err := c.writeHistory(ctx, res, world, m.Seq, tail)
	if err != nil {
		return nil, err
	}

	// The latest version of each changed document.
	latest := map[string]layout.Record{}
	for _, r := range tail {
		latest[r.ID] = r
	}
	res.DocsChanged = len(latest)
	shards, existed, err := c.mergeShards(ctx, res, m, latest)
	if err != nil {
		return nil, err
	}

	next := &layout.Manifest{Format: layout.ManifestFormat, World: world, Seq: res.To, Shards: shards,
		History: append(slices.Clone(m.History), segs...)}
	for _, s := range shards {
		next.Docs += s.Live
	}
	res.Docs = next.Docs
	data, err := json.MarshalIndent(next, "", " ")
	if err != nil {
		return nil, err
	}
	key := layout.CheckpointKey(world, res.To)
	// The manifest is the checkpoint: only the fold's leader stores one. A
	// process whose lease is gone leaves orphans, never a checkpoint.
	if err := projection.Fence(ctx); err != nil {
		return nil, fmt.Errorf("compactor: checkpoint %s not stored: %w", key, err)
	}
	switch err := c.store.Create(ctx, key, data); {
	case errors.Is(err, bucket.ErrExists):
		same, eerr := c.store.Equal(ctx, key, data)
		if eerr != nil {
			return nil, eerr
		}
		if !same {
			return nil, fmt.Errorf("%w (%s)", ErrLostRace, key)
		}
		res.Raced = true
	case err != nil:
		return nil, fmt.Errorf("compactor: checkpoint %s: %w", key, err)
	default:
		res.Creates++
	}

	// Now that the checkpoint holds them, the stream may drop the versions
	// that are not their document's last: those of the pass, and the
	// previous checkpoint's last version of each document it changed
	// (kept in the stream until now).
	var drop []uint64
	for _, r := range tail {
		if latest[r.ID].Version != r.Version {
			drop = append(drop, r.Version)
		}
	}
	for _, v := range existed {
		drop = append(drop, v)
	}
	slices.Sort(drop)
	res.Dropped = len(drop)
	// The drops make the new checkpoint whole only if the stream was whole
	// below the old one: otherwise leave it unmarked, to be swept.
	if baseMarked {
		c.mu.Lock()
		c.owed[world] = res.To
		c.mu.Unlock()
	}
	return drop, nil
}

// writeHistory writes the pass's versions (tail, in sequence order) as
// segments sorted by id and version, cut after HistoryVersions versions
// at a change of document, and returns them in id order. A pass redone
// after a crash cuts the same segments and finds them written.
func (c *Compactor) writeHistory(ctx context.Context, res *Result, world string, from uint64, tail []layout.Record) ([]layout.Segment, error) {
	byID := slices.Clone(tail)
	slices.SortStableFunc(byID, func(a, b layout.Record) int { return strings.Compare(a.ID, b.ID) }) // stable: versions stay in order
	var segs []layout.Segment
	for len(byID) > 0 {
		n := min(len(byID), c.cfg.HistoryVersions)
		for n < len(byID) && byID[n].ID == byID[n-1].ID {
			n++
		}
		seg := layout.Segment{Key: layout.HistoryKey(world, from, res.To, len(segs)), From: from, To: res.To,
			First: byID[0].ID, Last: byID[n-1].ID, Versions: n}
		if err := c.create(ctx, res, seg.Key, layout.Encode(layout.KindHistory, byID[:n]), true); err != nil {
			return nil, err
		}
		segs = append(segs, seg)
		byID = byID[n:]
	}
	return segs, nil
}

// create writes an object that must not exist yet; an object already there
// with the same content (content-addressed, or left by a pass that died)
// is fine.
func (c *Compactor) create(ctx context.Context, res *Result, key string, data []byte, mustEqual bool) error {
	err := c.store.Create(ctx, key, data)
	switch {
	case err == nil:
		res.Creates++
		return nil
	case !errors.Is(err, bucket.ErrExists):
		return fmt.Errorf("compactor: write %s: %w", key, err)
	case !mustEqual:
		return nil
	}
	same, err := c.store.Equal(ctx, key, data)
	if err != nil {
		return err
	}
	if !same {
		return fmt.Errorf("compactor: %s exists with other content", key)
	}
	return nil
}

// mergeShards applies the changed documents to the shards whose id ranges
// they fall in and returns the new shard list, and the version each changed
// document had in the old shards.
func (c *Compactor) mergeShards(ctx context.Context, res *Result, m *layout.Manifest, latest map[string]layout.Record) ([]layout.ShardRef, map[string]uint64, error) {
	ids := make([]string, 0, len(latest))
	for id := range latest {
		ids = append(ids, id)
	}
	slices.Sort(ids)
	// Shard i takes the ids from its First up to the next shard's First;
	// ids before the first shard go to shard 0.
	byShard := map[int][]string{}
	for _, id := range ids {
		i, _ := slices.BinarySearchFunc(m.Shards, id, func(s layout.ShardRef, id string) int { return strings.Compare(s.First, id) })
		if i == len(m.Shards) || m.Shards[i].First != id {
			i--
		}
		byShard[max(i, 0)] = append(byShard[max(i, 0)], id)
	}
	existed := map[string]uint64{}
	var out []layout.ShardRef
	emit := func(recs []layout.Record) error {
		for len(recs) > 0 {
			n := len(recs)
			if n > 2*c.cfg.ShardDocs {
				n = c.cfg.ShardDocs
			}
			data := layout.Encode(layout.KindShard, recs[:n])
			sum := sha256.Sum256(data)
			ref := layout.ShardRef{Key: layout.ShardKey(m.World, hex.EncodeToString(sum[:16])),
				First: recs[0].ID, Last: recs[n-1].ID, Docs: n, Bytes: len(data)}
			for _, r := range recs[:n] {
				if !r.Deleted {
					ref.Live++
				}
			}
			if err := c.create(ctx, res, ref.Key, data, false); err != nil {
				return err
			}
			res.ShardsNew++
			out = append(out, ref)
			recs = recs[n:]
		}
		return nil
	}
	if len(m.Shards) == 0 {
		recs := make([]layout.Record, 0, len(ids))
		for _, id := range ids {
			recs = append(recs, latest[id])
		}
		return out, existed, emit(recs)
	}
	for i, s := range m.Shards {
		changes := byShard[i]
		if len(changes) == 0 {
			out = append(out, s)
			res.ShardsKept++
			continue
		}
		old, err := layout.ReadShard(ctx, c.store, s)
		res.Gets++
		if err != nil {
			return nil, nil, err
		}
		merged := make([]layout.Record, 0, len(old)+len(changes))
		j := 0
		for _, r := range old {
			for j < len(changes) && changes[j] < r.ID {
				merged = append(merged, latest[changes[j]])
				j++
			}
			if j < len(changes) && changes[j] == r.ID {
				existed[r.ID] = r.Version
				merged = append(merged, latest[r.ID])
				j++
				continue
			}
			merged = append(merged, r)
		}
		for ; j < len(changes); j++ {
			merged = append(merged, latest[changes[j]])
		}
		if err := emit(merged); err != nil {
			return nil, nil, err
		}
	}
	return out, existed, nil
}

// Description is the help of `millrace project compactor`, beside the
// flags it describes (Config.RegisterFlags, with the fold's
// commitlog.Options).
const Description = `Folds the worlds of the commit log into the bucket (--bucket-url): per world,
shards of its documents at their latest version, history segments of every
version, and a checkpoint manifest; then deletes from COMMITS the folded
versions that are not their document's last (compare-and-set stays
JetStream's), so the stream keeps about one message per document.

Which worlds to fold comes from a durable consumer on commits.> that reads
headers only (--compactor-durable). A world folds once
--compactor-min-versions of its versions wait, or once its oldest waiting
version is --compactor-interval old; at most --compactor-concurrency worlds
fold at once. A version is acknowledged only once its world is folded up to
it, so a crash or a restart re-delivers exactly what was not folded. A pass
that died between its checkpoint and its deletions is finished by the next
pass of the world (a sweep of the versions it left).

A version is never deleted before the exports of COMMITS have it: no
version above the ack floor of a consumer --compactor-hold names, and none
at all while one of them does not exist (a missing export consumer must not
let versions go before they were exported; the compactor warns once). By
default the holder is the Kafka export's consumer of COMMITS
(export-kafka-commits) when --kafka-brokers is set and a --kafka-routes
route reads COMMITS, as the export itself would decide from the same
variables; --compactor-hold=none when nothing exports COMMITS.

One process leads each durable name, by a lease (fold.<durable> in the
millrace_leases bucket); others stand by and take over within
--nats-lease-ttl of its end. A pass stores its checkpoint and each batch of
its deletions only while the lease holds. Metrics (millrace_compactor_*,
and millrace_consumer_*{kind="fold"}) on --http-listen.`
