package layout

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/klauspost/compress/zstd"
)

// The objects a checkpoint is made of, all zstd-compressed record files:
//
//	"MRC1" kind                      4-byte magic, then 'S' (shard) or 'H' (history)
//	record*                          until the end
//	record = uvarint(len(id)) id  uvarint(version)  flags  uvarint(unix ns)  uvarint(len(body)) body
//
// flags bit 0: a tombstone. A shard holds the documents of an id range,
// sorted by id, each at its latest version (a deleted one as its
// tombstone); a history segment holds every version of a sequence range
// of the documents of an id range, sorted by id and then version. The decoder
// checks every length against the limits below before it allocates.

// The kinds of record file.
const (
	KindShard   byte = 'S'
	KindHistory byte = 'H'
)

const (
	magic       = "MRC1"
	flagDeleted = 1

	// Limits the decoder enforces (the edge's are lower: 1 KiB ids, 1 MiB
	// bodies by default; these only bound what a damaged object can ask
	// for).
	maxIDBytes   = 4 << 10
	maxBodyBytes = 64 << 20
	maxDecoded   = 1 << 30
)

// Record is one document version.
type Record struct {
	ID      string
	Version uint64
	Deleted bool
	Time    time.Time
	Body    []byte
}

var (
	encoder = sync.OnceValue(func() *zstd.Encoder {
		e, err := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedDefault), zstd.WithEncoderConcurrency(1))
		if err != nil {
			panic(err)
		}
		return e
	})
	decoder = sync.OnceValue(func() *zstd.Decoder {
		d, err := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxMemory(maxDecoded))
		if err != nil {
			panic(err)
		}
		return d
	})
)

// Encode makes a record file of kind from recs, compressed.
func Encode(kind byte, recs []Record) []byte {
	var buf bytes.Buffer
	buf.WriteString(magic)
	buf.WriteByte(kind)
	var tmp [binary.MaxVarintLen64]byte
	put := func(v uint64) { buf.Write(tmp[:binary.PutUvarint(tmp[:], v)]) }
	for _, r := range recs {
		put(uint64(len(r.ID)))
		buf.WriteString(r.ID)
		put(r.Version)
		var flags byte
		if r.Deleted {
			flags |= flagDeleted
		}
		buf.WriteByte(flags)
		put(uint64(r.Time.UnixNano()))
		put(uint64(len(r.Body)))
		buf.Write(r.Body)
	}
	return encoder().EncodeAll(buf.Bytes(), nil)
}

var ErrCorrupt = errors.New("commitlog: corrupt record file")

// Decode reads a record file of kind.
func Decode(kind byte, data []byte) ([]Record, error) {
	raw, err := decoder().DecodeAll(data, nil)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	if len(raw) < len(magic)+1 || string(raw[:len(magic)]) != magic || raw[len(magic)] != kind {
		return nil, fmt.Errorf("%w: not a %q file", ErrCorrupt, kind)
	}
	p := raw[len(magic)+1:]
	next := func(limit uint64, what string) (uint64, error) {
		v, n := binary.Uvarint(p)
		if n <= 0 || v > limit {
			return 0, fmt.Errorf("%w: bad %s", ErrCorrupt, what)
		}
		p = p[n:]
		return v, nil
	}
	var recs []Record
	for len(p) > 0 {
		var r Record
		n, err := next(maxIDBytes, "id length")
		if err != nil || uint64(len(p)) < n {
			return nil, fmt.Errorf("%w: id", ErrCorrupt)
		}
		r.ID, p = string(p[:n]), p[n:]
		if r.Version, err = next(1<<63, "version"); err != nil {
			return nil, err
		}
		if len(p) == 0 {
			return nil, fmt.Errorf("%w: flags", ErrCorrupt)
		}
		r.Deleted, p = p[0]&flagDeleted != 0, p[1:]
		ns, err := next(1<<63, "time")
		if err != nil {
			return nil, err
		}
		r.Time = time.Unix(0, int64(ns)).UTC()
		if n, err = next(maxBodyBytes, "body length"); err != nil || uint64(len(p)) < n {
			return nil, fmt.Errorf("%w: body", ErrCorrupt)
		}
		r.Body, p = bytes.Clone(p[:n]), p[n:]
		recs = append(recs, r)
	}
	return recs, nil
}
