package archive

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/klauspost/compress/zstd"

	"github.com/millrace/millrace/bucket"
)

// Dict is a zstd dictionary (the format zstd's own trainer writes, its id
// inside) and its id.
type Dict struct {
	ID   uint32
	Data []byte
}

// ErrDictMissing: an object names a dictionary the bucket does not hold.
var ErrDictMissing = errors.New("archive: dictionary missing from the bucket")

// Where dictionaries live in the bucket: one immutable object per id,
// and a pointer to the one new objects use.
const (
	DictPrefix = "archive/dicts/"
	CurrentKey = DictPrefix + "current"
)

// DictKey is the key of dictionary id.
func DictKey(id uint32) string { return fmt.Sprintf("%s%d.zdict", DictPrefix, id) }

// Private dictionary ids: zstd's format reserves ids below 32768 and from
// 2^31 on for a registrar; an id in between is ours to choose.
const (
	minPrivateID = 1 << 15
	maxPrivateID = 1<<31 - 1
)

// PrivateID reports whether id is in zstd's private range.
func PrivateID(id uint32) bool { return id >= minPrivateID && id <= maxPrivateID }

// Store is what the dictionaries need of the bucket.
type Store interface {
	Get(ctx context.Context, key string) ([]byte, error)
	Put(ctx context.Context, key string, data []byte) error
	Create(ctx context.Context, key string, data []byte) error
}

// Dicts loads dictionaries from the bucket by id and keeps them: a
// dictionary never changes once stored, so the cache is never stale.
// Safe for concurrent use.
type Dicts struct {
	store Store
	mu    sync.Mutex
	byID  map[uint32]*Dict
}

// NewDicts reads dictionaries from store.
func NewDicts(store Store) *Dicts { return &Dicts{store: store, byID: map[uint32]*Dict{}} }

// Load returns dictionary id; ErrDictMissing (naming the id and its key)
// when the bucket does not hold it.
func (d *Dicts) Load(ctx context.Context, id uint32) (*Dict, error) {
	d.mu.Lock()
	dict, ok := d.byID[id]
	d.mu.Unlock()
	if ok {
		return dict, nil
	}
	data, err := d.store.Get(ctx, DictKey(id))
	if errors.Is(err, bucket.ErrNotFound) {
		return nil, fmt.Errorf("%w: dictionary %d (%s)", ErrDictMissing, id, DictKey(id))
	}
	if err != nil {
		return nil, fmt.Errorf("archive: dictionary %d: %w", id, err)
	}
	if got, err := dictID(data); err != nil || got != id {
		return nil, fmt.Errorf("%w: %s holds no dictionary %d (%v)", ErrCorrupt, DictKey(id), id, err)
	}
	dict = &Dict{ID: id, Data: data}
	d.mu.Lock()
	d.byID[id] = dict
	d.mu.Unlock()
	return dict, nil
}

// Loader is Load bound to ctx, for NewReader.
func (d *Dicts) Loader(ctx context.Context) DictLoader {
	return func(id uint32) (*Dict, error) { return d.Load(ctx, id) }
}

// Current returns the dictionary new objects use, nil when none was made
// current (objects are then plain zstd).
func (d *Dicts) Current(ctx context.Context) (*Dict, error) {
	data, err := d.store.Get(ctx, CurrentKey)
	if errors.Is(err, bucket.ErrNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("archive: current dictionary: %w", err)
	}
	id, err := strconv.ParseUint(strings.TrimSpace(string(data)), 10, 32)
	if err != nil || !PrivateID(uint32(id)) {
		return nil, fmt.Errorf("%w: %s holds %q, not a dictionary id", ErrCorrupt, CurrentKey, data)
	}
	return d.Load(ctx, uint32(id))
}

// Save stores a new dictionary under a fresh id and makes it current. The
// dictionary is written with Create, so two trainers never overwrite
// each other's (a taken id is drawn again); the pointer is one whole
// object replaced with Put: the last trainer wins, and either way it
// names a stored dictionary. build makes the dictionary for an id.
func (d *Dicts) Save(ctx context.Context, build func(id uint32) ([]byte, error)) (*Dict, error) {
	for range 8 {
		id := randomID()
		data, err := build(id)
		if err != nil {
			return nil, err
		}
		err = d.store.Create(ctx, DictKey(id), data)
		if errors.Is(err, bucket.ErrExists) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("archive: store dictionary %d: %w", id, err)
		}
		if err := d.store.Put(ctx, CurrentKey, []byte(strconv.FormatUint(uint64(id), 10)+"\n")); err != nil {
			return nil, fmt.Errorf("archive: make dictionary %d current: %w", id, err)
		}
		dict := &Dict{ID: id, Data: data}
		d.mu.Lock()
		d.byID[id] = dict
		d.mu.Unlock()
		return dict, nil
	}
	return nil, errors.New("archive: no free dictionary id after 8 draws")
}

func randomID() uint32 {
	var b [4]byte
	rand.Read(b[:])
	return minPrivateID + binary.BigEndian.Uint32(b[:])%(maxPrivateID-minPrivateID+1)
}

// dictID is the id inside a zstd dictionary.
func dictID(data []byte) (uint32, error) {
	info, err := zstd.InspectDictionary(data)
	if err != nil {
		return 0, err
	}
	if !bytes.HasPrefix(data, []byte{0x37, 0xa4, 0x30, 0xec}) {
		return 0, errors.New("not a zstd dictionary")
	}
	return info.ID(), nil
}
