package builds

import (
	"sync"

	"github.com/klauspost/compress/zstd"
)

// Console output is stored as zstd frames. The canonical row of an
// invocation must come out byte for byte the same in a replay, so its
// encoder is fixed: one goroutine (EncodeAll never starts any), a fixed
// level, no dictionary, a checksum, and the library version pinned by
// go.mod. Scratch chunks, whose exact bytes do not matter and which are
// small and many, use the fastest level.
var (
	canonicalEncoder = sync.OnceValue(func() *zstd.Encoder { return newEncoder(zstd.SpeedDefault) })
	chunkEncoder     = sync.OnceValue(func() *zstd.Encoder { return newEncoder(zstd.SpeedFastest) })
	decoder          = sync.OnceValue(func() *zstd.Decoder {
		d, err := zstd.NewReader(nil,
			zstd.WithDecoderConcurrency(1),
			zstd.WithDecoderMaxMemory(1<<30))
		if err != nil {
			panic(err) // only on invalid options
		}
		return d
	})
)

func newEncoder(level zstd.EncoderLevel) *zstd.Encoder {
	e, err := zstd.NewWriter(nil,
		zstd.WithEncoderConcurrency(1),
		zstd.WithEncoderLevel(level),
		zstd.WithEncoderCRC(true),
		zstd.WithZeroFrames(true))
	if err != nil {
		panic(err) // only on invalid options
	}
	return e
}

// compress returns src as the one zstd frame of a canonical output row.
func compress(src []byte) []byte {
	return canonicalEncoder().EncodeAll(src, make([]byte, 0, len(src)/4+64))
}

// compressChunk returns src as one zstd frame for the scratch table.
func compressChunk(src []byte) []byte {
	return chunkEncoder().EncodeAll(src, make([]byte, 0, len(src)/2+64))
}

// decompressor appends the content of zstd frames to a buffer, decoding
// each into reused scratch space so that a long run of small chunks costs
// amortised, not quadratic, copying.
type decompressor struct{ scratch []byte }

func (d *decompressor) appendTo(dst, src []byte) ([]byte, error) {
	if len(src) == 0 {
		return dst, nil
	}
	var err error
	d.scratch, err = decoder().DecodeAll(src, d.scratch[:0])
	if err != nil {
		return dst, err
	}
	return append(dst, d.scratch...), nil
}

// decode returns the content of one zstd frame, valid until the next call.
func (d *decompressor) decode(src []byte) ([]byte, error) {
	var err error
	d.scratch, err = decoder().DecodeAll(src, d.scratch[:0])
	return d.scratch, err
}
