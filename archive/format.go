package archive

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"hash"
	"hash/crc64"
	"io"
	"maps"
	"slices"
	"sync"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/millrace/millrace/streams/projection"
)

// The object format. An object is a header, then one zstd stream:
//
//	header   "MRAR" (4 bytes), format version (1 byte), dictionary id
//	         (uint32, big-endian; 0: none)
//	zstd     records, each a uvarint length then that many bytes:
//	           'M' message: uvarint stream sequence, varint stored time
//	               (Unix nanoseconds), subject, uvarint header count and
//	               per header (keys in byte order) its key, uvarint value
//	               count and the values in stored order, then the data;
//	               every string and the data a uvarint length then bytes
//	           'T' trailer, the last record: uvarint message count, first
//	               and last stream sequence, record bytes, then the
//	               CRC-64 (ECMA, big-endian, 8 bytes) of every message
//	               record as written (length prefix included)
//
// The dictionary id is in the header so that a reader knows which one to
// load before it starts decoding (the zstd frame names it too). A reader
// accepts an object only up to a trailer whose count, sequences and
// checksum match what it read, followed by the end of the stream: a
// truncated, spliced or corrupted object is an error, never a short
// build.
const (
	magic = "MRAR"
	// Version is the format version this package writes; a reader
	// refuses others.
	Version    = 1
	headerSize = len(magic) + 1 + 4

	recMessage = 'M'
	recTrailer = 'T'

	// MaxRecordBytes bounds one record when reading: far above the BES
	// edge's largest event (4 MiB by default), it only stops a corrupt
	// length from allocating gigabytes.
	MaxRecordBytes = 64 << 20
)

// Errors a Reader returns, to test with errors.Is.
var (
	// ErrCorrupt: the object does not decode, or fails its trailer's
	// checks.
	ErrCorrupt = errors.New("archive: corrupt object")
	// ErrTruncated: the object ends before its trailer (also ErrCorrupt).
	ErrTruncated = fmt.Errorf("%w: it ends before its trailer", ErrCorrupt)
)

var crcTable = crc64.MakeTable(crc64.ECMA)

// Stats describe one object's content, as its trailer records it.
type Stats struct {
	Messages uint64
	FirstSeq uint64
	LastSeq  uint64
	// RawBytes are the records uncompressed: each message's subject,
	// headers and data, plus a few bytes of lengths.
	RawBytes uint64
	Checksum uint64
}

// Message is one stored stream message as the archive keeps it: every
// field JetStream stored. It is a projection.Message, so that a replay
// can hand archived messages to a projector as it hands the stream's.
type Message struct {
	Sequence    uint64
	Stored      time.Time
	SubjectName string
	// Headers are every header with every value, as stored.
	Headers map[string][]string
	Payload []byte
}

func (m *Message) Subject() string { return m.SubjectName }
func (m *Message) Data() []byte    { return m.Payload }
func (m *Message) Seq() uint64     { return m.Sequence }
func (m *Message) Time() time.Time { return m.Stored }

// A replay hands archived messages to a projector as it hands the stream's.
var _ projection.Message = (*Message)(nil)

// Header returns the first value of header key, or "".
func (m *Message) Header(key string) string {
	if v := m.Headers[key]; len(v) > 0 {
		return v[0]
	}
	return ""
}

// AppendRecord appends m's record as the Writer writes it (length prefix
// included): what a dictionary is trained on.
func AppendRecord(dst []byte, m *Message) []byte {
	body := make([]byte, 0, 64+len(m.SubjectName)+len(m.Payload))
	body = append(body, recMessage)
	body = binary.AppendUvarint(body, m.Sequence)
	body = binary.AppendVarint(body, m.Stored.UnixNano())
	body = appendBytes(body, m.SubjectName)
	keys := slices.Sorted(maps.Keys(m.Headers))
	body = binary.AppendUvarint(body, uint64(len(keys)))
	for _, k := range keys {
		body = appendBytes(body, k)
		vs := m.Headers[k]
		body = binary.AppendUvarint(body, uint64(len(vs)))
		for _, v := range vs {
			body = appendBytes(body, v)
		}
	}
	body = appendBytes(body, m.Payload)
	dst = binary.AppendUvarint(dst, uint64(len(body)))
	return append(dst, body...)
}

func appendBytes[S string | []byte](dst []byte, s S) []byte {
	dst = binary.AppendUvarint(dst, uint64(len(s)))
	return append(dst, s...)
}

// Writer writes one object to an io.Writer as a stream: it holds one
// record and zstd's window, whatever the build's size.
type Writer struct {
	w     io.Writer
	enc   *zstd.Encoder
	pool  *coderPool
	rec   []byte
	crc   hash.Hash64
	stats Stats
	err   error
}

// NewWriter starts an object on w, compressed at level with dict (nil:
// plain zstd, dictionary id 0).
func NewWriter(w io.Writer, dict *Dict, level zstd.EncoderLevel) (*Writer, error) {
	var id uint32
	opts := []zstd.EOption{zstd.WithEncoderLevel(level), zstd.WithEncoderConcurrency(1)}
	if dict != nil {
		id = dict.ID
		opts = append(opts, zstd.WithEncoderDict(dict.Data))
	}
	var hdr [headerSize]byte
	copy(hdr[:], magic)
	hdr[len(magic)] = Version
	binary.BigEndian.PutUint32(hdr[len(magic)+1:], id)
	if _, err := w.Write(hdr[:]); err != nil {
		return nil, fmt.Errorf("archive: write header: %w", err)
	}
	pool := encoders.pool(coderKey{id: id, level: level}, func() (any, error) { return zstd.NewWriter(nil, opts...) })
	v, err := pool.get()
	if err != nil {
		return nil, fmt.Errorf("archive: dictionary %d: %w", id, err)
	}
	enc := v.(*zstd.Encoder)
	enc.Reset(w)
	return &Writer{w: w, enc: enc, pool: pool, crc: crc64.New(crcTable)}, nil
}

// Write appends m. Messages go in stream order: a sequence at or below
// the last one is refused.
func (w *Writer) Write(m *Message) error {
	if w.err != nil {
		return w.err
	}
	if w.stats.Messages > 0 && m.Sequence <= w.stats.LastSeq {
		return fmt.Errorf("archive: message %d after %d: not in stream order", m.Sequence, w.stats.LastSeq)
	}
	w.rec = AppendRecord(w.rec[:0], m)
	if _, err := w.enc.Write(w.rec); err != nil {
		w.err = fmt.Errorf("archive: write: %w", err)
		return w.err
	}
	w.crc.Write(w.rec)
	if w.stats.Messages == 0 {
		w.stats.FirstSeq = m.Sequence
	}
	w.stats.Messages++
	w.stats.LastSeq = m.Sequence
	w.stats.RawBytes += uint64(len(w.rec))
	return nil
}

// Close writes the trailer and ends the zstd stream (not w's writer) and
// returns what the object holds.
func (w *Writer) Close() (Stats, error) {
	if w.err != nil {
		w.enc.Reset(nil) // drops what it held; not returned, it may be mid-frame
		return Stats{}, w.err
	}
	w.stats.Checksum = w.crc.Sum64()
	body := appendTrailer(nil, w.stats)
	rec := append(binary.AppendUvarint(nil, uint64(len(body))), body...)
	if _, err := w.enc.Write(rec); err != nil {
		return Stats{}, fmt.Errorf("archive: write trailer: %w", err)
	}
	if err := w.enc.Close(); err != nil {
		return Stats{}, fmt.Errorf("archive: finish: %w", err)
	}
	w.enc.Reset(nil)
	w.pool.put(w.enc)
	return w.stats, nil
}

func appendTrailer(dst []byte, s Stats) []byte {
	dst = append(dst, recTrailer)
	for _, v := range []uint64{s.Messages, s.FirstSeq, s.LastSeq, s.RawBytes} {
		dst = binary.AppendUvarint(dst, v)
	}
	return binary.BigEndian.AppendUint64(dst, s.Checksum)
}

// DictID reads the header of an object and returns its dictionary id (0:
// none), leaving r after the header.
func DictID(r io.Reader) (uint32, error) {
	var hdr [headerSize]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, fmt.Errorf("%w: header: %v", ErrTruncated, err)
		}
		return 0, fmt.Errorf("archive: read header: %w", err)
	}
	if string(hdr[:len(magic)]) != magic {
		return 0, fmt.Errorf("%w: no archive header (magic %q)", ErrCorrupt, hdr[:len(magic)])
	}
	if v := hdr[len(magic)]; v != Version {
		return 0, fmt.Errorf("%w: format version %d, this reader knows %d", ErrCorrupt, v, Version)
	}
	return binary.BigEndian.Uint32(hdr[len(magic)+1:]), nil
}

// Reader reads one object's messages in stream order, as a stream: it
// holds one record and zstd's window.
type Reader struct {
	dec   *zstd.Decoder
	pool  *coderPool
	br    *bufio.Reader
	crc   hash.Hash64
	rec   []byte
	stats Stats
	done  bool
	// DictID is the object's dictionary (0: none).
	DictID uint32
}

// DictLoader gives the dictionary an object names (Dicts.Load).
type DictLoader func(id uint32) (*Dict, error)

// NewReader reads an object's header from r and starts decoding it, with
// the dictionary load gives for the id in the header.
func NewReader(r io.Reader, load DictLoader) (*Reader, error) {
	r = source{r}
	id, err := DictID(r)
	if err != nil {
		return nil, err
	}
	opts := []zstd.DOption{zstd.WithDecoderConcurrency(1), zstd.WithDecoderMaxWindow(64 << 20),
		zstd.WithDecoderMaxMemory(1 << 40)}
	if id != 0 {
		if load == nil {
			return nil, fmt.Errorf("archive: the object needs dictionary %d and none can be loaded", id)
		}
		d, err := load(id)
		if err != nil {
			return nil, err
		}
		opts = append(opts, zstd.WithDecoderDicts(d.Data))
	}
	pool := decoders.pool(coderKey{id: id}, func() (any, error) { return zstd.NewReader(nil, opts...) })
	v, err := pool.get()
	if err != nil {
		return nil, fmt.Errorf("archive: dictionary %d: %w", id, err)
	}
	dec := v.(*zstd.Decoder)
	if err := dec.Reset(r); err != nil {
		pool.put(dec)
		return nil, fmt.Errorf("%w: %v", ErrCorrupt, err)
	}
	return &Reader{dec: dec, pool: pool, br: bufio.NewReaderSize(dec, 64<<10), crc: crc64.New(crcTable), DictID: id}, nil
}

// Close releases the decoder.
func (r *Reader) Close() {
	if r.dec != nil {
		r.dec.Reset(nil)
		r.pool.put(r.dec)
		r.dec = nil
	}
}

// Stats are what the trailer recorded; valid once Next returned io.EOF.
func (r *Reader) Stats() Stats { return r.stats }

// Next returns the next message, or io.EOF once the trailer has been read
// and checked and the stream has ended.
func (r *Reader) Next() (*Message, error) {
	if r.done {
		return nil, io.EOF
	}
	n, err := binary.ReadUvarint(r.br)
	if err != nil {
		return nil, r.readErr(err)
	}
	if n == 0 || n > MaxRecordBytes {
		return nil, fmt.Errorf("%w: record %d: length %d", ErrCorrupt, r.stats.Messages, n)
	}
	r.rec = slices.Grow(r.rec[:0], int(n))[:n]
	if _, err := io.ReadFull(r.br, r.rec); err != nil {
		return nil, r.readErr(err)
	}
	switch r.rec[0] {
	case recMessage:
		m, err := decodeMessage(r.rec[1:])
		if err != nil {
			return nil, fmt.Errorf("%w: record %d: %v", ErrCorrupt, r.stats.Messages, err)
		}
		if r.stats.Messages > 0 && m.Sequence <= r.stats.LastSeq {
			return nil, fmt.Errorf("%w: message %d after %d", ErrCorrupt, m.Sequence, r.stats.LastSeq)
		}
		r.crc.Write(binary.AppendUvarint(nil, n))
		r.crc.Write(r.rec)
		if r.stats.Messages == 0 {
			r.stats.FirstSeq = m.Sequence
		}
		r.stats.Messages++
		r.stats.LastSeq = m.Sequence
		r.stats.RawBytes += uint64(uvarintLen(n)) + n
		return m, nil
	case recTrailer:
		return nil, r.trailer(r.rec[1:])
	default:
		return nil, fmt.Errorf("%w: record %d: unknown kind 0x%02x", ErrCorrupt, r.stats.Messages, r.rec[0])
	}
}

func (r *Reader) readErr(err error) error {
	var src sourceError
	switch {
	case errors.As(err, &src):
		return fmt.Errorf("archive: read: %w", src.err) // the store's, not the object's: it may pass
	case errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF):
		return fmt.Errorf("%w (after %d messages)", ErrTruncated, r.stats.Messages)
	}
	return fmt.Errorf("%w: after %d messages: %v", ErrCorrupt, r.stats.Messages, err)
}

// source marks the errors of the object's source, so that a failed read
// of the store is not taken for a corrupt object; io.EOF passes as is.
type source struct{ r io.Reader }

func (s source) Read(p []byte) (int, error) {
	n, err := s.r.Read(p)
	if err != nil && err != io.EOF {
		err = sourceError{err}
	}
	return n, err
}

type sourceError struct{ err error }

func (e sourceError) Error() string { return e.err.Error() }
func (e sourceError) Unwrap() error { return e.err }

func (r *Reader) trailer(b []byte) error {
	var got Stats
	for _, v := range []*uint64{&got.Messages, &got.FirstSeq, &got.LastSeq, &got.RawBytes} {
		x, n := binary.Uvarint(b)
		if n <= 0 {
			return fmt.Errorf("%w: trailer does not decode", ErrCorrupt)
		}
		*v, b = x, b[n:]
	}
	if len(b) != 8 {
		return fmt.Errorf("%w: trailer does not decode", ErrCorrupt)
	}
	got.Checksum = binary.BigEndian.Uint64(b)
	want := r.stats
	want.Checksum = r.crc.Sum64()
	if got != want {
		return fmt.Errorf("%w: trailer says %d messages (%d-%d, %d bytes, checksum %016x), read %d (%d-%d, %d bytes, checksum %016x)",
			ErrCorrupt, got.Messages, got.FirstSeq, got.LastSeq, got.RawBytes, got.Checksum,
			want.Messages, want.FirstSeq, want.LastSeq, want.RawBytes, want.Checksum)
	}
	// Nothing may follow the trailer.
	if _, err := r.br.ReadByte(); err != io.EOF {
		if err == nil {
			return fmt.Errorf("%w: bytes after the trailer", ErrCorrupt)
		}
		return r.readErr(err)
	}
	r.stats, r.done = got, true
	return io.EOF
}

func decodeMessage(b []byte) (*Message, error) {
	d := decoder{b: b}
	m := &Message{Sequence: d.uvarint()}
	m.Stored = time.Unix(0, d.varint())
	m.SubjectName = string(d.bytes())
	nh := d.uvarint()
	if nh > uint64(len(d.b)) {
		return nil, errors.New("header count over the record's size")
	}
	if nh > 0 {
		m.Headers = make(map[string][]string, nh)
	}
	prev := ""
	for i := range nh {
		k := string(d.bytes())
		if i > 0 && k <= prev {
			return nil, errors.New("headers out of order")
		}
		prev = k
		nv := d.uvarint()
		if nv > uint64(len(d.b)) {
			return nil, errors.New("value count over the record's size")
		}
		vs := make([]string, 0, nv)
		for range nv {
			vs = append(vs, string(d.bytes()))
		}
		m.Headers[k] = vs
	}
	m.Payload = append([]byte(nil), d.bytes()...)
	if d.err != nil {
		return nil, d.err
	}
	if len(d.b) != 0 {
		return nil, fmt.Errorf("%d bytes after the data", len(d.b))
	}
	return m, nil
}

type decoder struct {
	b   []byte
	err error
}

func (d *decoder) uvarint() uint64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Uvarint(d.b)
	if n <= 0 {
		d.err = errors.New("bad varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) varint() int64 {
	if d.err != nil {
		return 0
	}
	v, n := binary.Varint(d.b)
	if n <= 0 {
		d.err = errors.New("bad varint")
		return 0
	}
	d.b = d.b[n:]
	return v
}

func (d *decoder) bytes() []byte {
	n := d.uvarint()
	if d.err != nil {
		return nil
	}
	if n > uint64(len(d.b)) {
		d.err = fmt.Errorf("length %d over the %d bytes left", n, len(d.b))
		return nil
	}
	v := d.b[:n]
	d.b = d.b[n:]
	return v
}

func uvarintLen(v uint64) int { return len(binary.AppendUvarint(nil, v)) }

// Encoders and decoders are reused, per dictionary and level: making one
// allocates and clears its tables, which cost more than compressing a
// build of 500 events (BenchmarkArchiveBuild). A dictionary's id names
// its content for good (Dicts), so a pool keyed by id never mixes two.
type coderKey struct {
	id    uint32
	level zstd.EncoderLevel
}

type coderPools struct {
	mu sync.Mutex
	m  map[coderKey]*coderPool
}

var encoders, decoders coderPools

type coderPool struct {
	p    sync.Pool
	make func() (any, error)
}

func (c *coderPools) pool(k coderKey, make func() (any, error)) *coderPool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.m == nil {
		c.m = map[coderKey]*coderPool{}
	}
	p, ok := c.m[k]
	if !ok {
		p = &coderPool{make: make}
		c.m[k] = p
	}
	return p
}

func (p *coderPool) get() (any, error) {
	if v := p.p.Get(); v != nil {
		return v, nil
	}
	return p.make()
}

func (p *coderPool) put(v any) { p.p.Put(v) }
