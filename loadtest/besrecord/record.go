// Package besrecord records what a Build Event Service client (Bazel) sends, so that real builds can be
// committed as fixtures and replayed against millrace's BES edge without Bazel.
//
// It owns two things: a minimal but correct google.devtools.build.v1.PublishBuildEvent server (Service,
// Start) that acknowledges everything, and the file format it writes (Writer, Reader, Read).
//
// # File format
//
// A recording is a sequence of records, nothing else: no header, no trailer. Each record is one kind byte
// followed by a length-delimited protobuf message as written by
// google.golang.org/protobuf/encoding/protodelim (a uvarint byte count, then the message):
//
//	'L' (KindLifecycle)  google.devtools.build.v1.PublishLifecycleEventRequest
//	'S' (KindStream)     google.devtools.build.v1.PublishBuildToolEventStreamRequest
//
// Records are in the order the server received them, across all calls. A recording stays readable up to
// its last complete record if the recorder dies mid-write, and recordings can be concatenated.
package besrecord

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/encoding/protodelim"
	"google.golang.org/protobuf/proto"
)

// Kind bytes that prefix every record. They are printable so that a hexdump of a recording is legible.
const (
	KindLifecycle byte = 'L'
	KindStream    byte = 'S'
)

// maxRecordSize bounds one message when reading. Bazel's largest events (progress with captured output,
// command lines) stay far below it; the bound only stops a corrupt length from allocating gigabytes.
const maxRecordSize = 64 << 20

// Record is one request as the server received it. Exactly one field is set.
type Record struct {
	Lifecycle *buildpb.PublishLifecycleEventRequest
	Stream    *buildpb.PublishBuildToolEventStreamRequest
}

// OrderedBuildEvent returns the event that the record carries, whichever kind it is.
func (r Record) OrderedBuildEvent() *buildpb.OrderedBuildEvent {
	if r.Lifecycle != nil {
		return r.Lifecycle.GetBuildEvent()
	}
	return r.Stream.GetOrderedBuildEvent()
}

// Writer appends records to an io.Writer. It does no buffering of its own, so that each record reaches
// the underlying writer (typically a file) before the server acknowledges it. It is not safe for
// concurrent use; Service serialises its calls.
type Writer struct {
	w   io.Writer
	buf bytes.Buffer
}

// NewWriter returns a Writer that appends to w.
func NewWriter(w io.Writer) *Writer { return &Writer{w: w} }

// WriteLifecycle appends a lifecycle request.
func (w *Writer) WriteLifecycle(req *buildpb.PublishLifecycleEventRequest) error {
	return w.write(KindLifecycle, req)
}

// WriteStream appends a stream request.
func (w *Writer) WriteStream(req *buildpb.PublishBuildToolEventStreamRequest) error {
	return w.write(KindStream, req)
}

// Write appends whichever request r holds.
func (w *Writer) Write(r Record) error {
	switch {
	case r.Lifecycle != nil && r.Stream == nil:
		return w.WriteLifecycle(r.Lifecycle)
	case r.Stream != nil && r.Lifecycle == nil:
		return w.WriteStream(r.Stream)
	default:
		return errors.New("besrecord: record must hold exactly one request")
	}
}

func (w *Writer) write(kind byte, m proto.Message) error {
	// Build the whole record in memory and hand it to the writer in one call, so that a file never holds
	// a kind byte without its message (short of a torn write by the OS).
	w.buf.Reset()
	w.buf.WriteByte(kind)
	if _, err := protodelim.MarshalTo(&w.buf, m); err != nil {
		return fmt.Errorf("besrecord: marshal %c record: %w", kind, err)
	}
	if _, err := w.w.Write(w.buf.Bytes()); err != nil {
		return fmt.Errorf("besrecord: write %c record: %w", kind, err)
	}
	return nil
}

// Reader reads records one at a time.
type Reader struct {
	r *bufio.Reader
	n int // records read so far, for error messages
}

// NewReader returns a Reader over r.
func NewReader(r io.Reader) *Reader { return &Reader{r: bufio.NewReaderSize(r, 64<<10)} }

// Next returns the next record, or io.EOF after the last one. A recording cut short inside a record
// gives io.ErrUnexpectedEOF (wrapped), so a caller can tell a clean end from a torn one.
func (r *Reader) Next() (Record, error) {
	kind, err := r.r.ReadByte()
	if err != nil {
		return Record{}, err // io.EOF at a record boundary is the clean end
	}
	var rec Record
	var m proto.Message
	switch kind {
	case KindLifecycle:
		rec.Lifecycle = new(buildpb.PublishLifecycleEventRequest)
		m = rec.Lifecycle
	case KindStream:
		rec.Stream = new(buildpb.PublishBuildToolEventStreamRequest)
		m = rec.Stream
	default:
		return Record{}, fmt.Errorf("besrecord: record %d: unknown kind byte 0x%02x (not a recording?)", r.n, kind)
	}
	opts := protodelim.UnmarshalOptions{MaxSize: maxRecordSize}
	if err := opts.UnmarshalFrom(r.r, m); err != nil {
		if errors.Is(err, io.EOF) {
			err = io.ErrUnexpectedEOF
		}
		return Record{}, fmt.Errorf("besrecord: record %d (%c): %w", r.n, kind, err)
	}
	r.n++
	return rec, nil
}

// Read returns every record in the file at path, in order.
func Read(path string) ([]Record, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var recs []Record
	rd := NewReader(f)
	for {
		rec, err := rd.Next()
		if err == io.EOF { // only a clean end is returned unwrapped

			return recs, nil
		}
		if err != nil {
			return recs, fmt.Errorf("%s: %w", path, err)
		}
		recs = append(recs, rec)
	}
}
