package archive_test

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"reflect"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/klauspost/compress/zstd"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
)

func encode(t testing.TB, msgs []*archive.Message, d *archive.Dict) []byte {
	t.Helper()
	var buf bytes.Buffer
	w, err := archive.NewWriter(&buf, d, zstd.SpeedDefault)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range msgs {
		if err := w.Write(m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}

func decode(obj []byte, load archive.DictLoader) ([]*archive.Message, archive.Stats, error) {
	r, err := archive.NewReader(bytes.NewReader(obj), load)
	if err != nil {
		return nil, archive.Stats{}, err
	}
	defer r.Close()
	var out []*archive.Message
	for {
		m, err := r.Next()
		if err == io.EOF {
			return out, r.Stats(), nil
		}
		if err != nil {
			return out, archive.Stats{}, err
		}
		out = append(out, m)
	}
}

func TestRoundTrip(t *testing.T) {
	b := invocation(t, "bazel-test-60.besrec")
	// Headers with several values and an empty one, data empty and not.
	b.Messages[0].Headers["X-Many"] = []string{"b", "a", ""}
	b.Messages[1].Payload = nil
	b.Messages[2].Stored = time.Date(2026, 12, 2, 3, 4, 5, 6, time.UTC)
	for _, d := range []*archive.Dict{nil, train(t, fixture(t, "bazel-build-10.besrec"))} {
		got, st, err := decode(encode(t, b.Messages, d), func(uint32) (*archive.Dict, error) { return d, nil })
		if err != nil {
			t.Fatal(err)
		}
		if len(got) != len(b.Messages) || st.Messages != uint64(len(got)) || st.FirstSeq != b.Messages[0].Sequence || st.LastSeq != b.Messages[len(b.Messages)-1].Sequence {
			t.Fatalf("read %d messages, stats %+v; wrote %d", len(got), st, len(b.Messages))
		}
		for i, m := range got {
			w := b.Messages[i]
			if m.Seq() != w.Seq() || !m.Time().Equal(w.Time()) || m.Subject() != w.Subject() ||
				!bytes.Equal(m.Data(), w.Data()) || !reflect.DeepEqual(m.Headers, w.Headers) {
				t.Fatalf("message %d: read %+v, wrote %+v", i, m, w)
			}
		}
		if got[0].Header("X-Many") != "b" {
			t.Fatalf("Header gives %q, want the first value", got[0].Header("X-Many"))
		}
	}
}

func TestWriterRefusesOutOfOrder(t *testing.T) {
	w, _ := archive.NewWriter(io.Discard, nil, zstd.SpeedDefault)
	w.Write(&archive.Message{Sequence: 5})
	if err := w.Write(&archive.Message{Sequence: 5}); err == nil {
		t.Fatal("a repeated sequence was accepted")
	}
}

func train(t testing.TB, bs []archive.Build) *archive.Dict {
	t.Helper()
	data, err := archive.Train(bs, 40001, 0, zstd.SpeedDefault)
	if err != nil {
		t.Fatal(err)
	}
	return &archive.Dict{ID: 40001, Data: data}
}

// TestCorruptRejected: every way an object can be damaged is an error,
// never a shorter build.
func TestCorruptRejected(t *testing.T) {
	msgs := invocation(t, "bazel-build-10.besrec").Messages
	obj := encode(t, msgs, nil)
	// An object whose trailer lies about its content: the checksum of
	// other records, written by hand.
	var spliced bytes.Buffer
	w, _ := archive.NewWriter(&spliced, nil, zstd.SpeedDefault)
	for _, m := range msgs[:len(msgs)-1] {
		w.Write(m)
	}
	w.Close()
	cases := map[string][]byte{
		"empty":               nil,
		"header only":         obj[:9],
		"bad magic":           append([]byte("XXXX"), obj[4:]...),
		"future version":      append(append([]byte("MRAR\x02"), obj[5:9]...), obj[9:]...),
		"cut at the end":      obj[:len(obj)-1],
		"cut in the middle":   obj[:len(obj)/2],
		"flipped byte":        flip(obj, len(obj)/2),
		"garbage after":       append(append([]byte{}, obj...), 1, 2, 3),
		"another frame after": append(append([]byte{}, obj...), encode(t, msgs[:1], nil)[9:]...),
	}
	// Damage zstd cannot see: the records decompressed, changed and
	// compressed again into a valid zstd stream. Only the trailer tells.
	recs := records(t, obj)
	cases["a record dropped"] = recompress(t, obj[:9], append(append([][]byte{}, recs[:3]...), recs[4:]...))
	cases["records swapped"] = recompress(t, obj[:9], append([][]byte{recs[1], recs[0]}, recs[2:]...))
	cases["no trailer"] = recompress(t, obj[:9], recs[:len(recs)-1])
	cases["cut at a record"] = recompress(t, obj[:9], recs[:5])
	for name, b := range cases {
		got, _, err := decode(b, nil)
		if !errors.Is(err, archive.ErrCorrupt) {
			t.Errorf("%s: read %d messages, err %v; want ErrCorrupt", name, len(got), err)
		}
	}
	if _, _, err := decode(cases["no trailer"], nil); !errors.Is(err, archive.ErrTruncated) {
		t.Errorf("no trailer: %v, want ErrTruncated", err)
	}
	if _, _, err := decode(obj[:len(obj)/2], nil); !errors.Is(err, archive.ErrTruncated) {
		t.Errorf("cut: %v, want ErrTruncated", err)
	}
	if got, _, err := decode(spliced.Bytes(), nil); err != nil || len(got) != len(msgs)-1 {
		t.Fatalf("a shorter object of its own: %d, %v", len(got), err)
	}
}

func flip(b []byte, i int) []byte {
	c := append([]byte{}, b...)
	c[i] ^= 0x40
	return c
}

// TestDictionaries: objects name their dictionary; a missing one is an
// error naming its id and key; objects written with an older dictionary
// stay readable once a newer one is current.
func TestDictionaries(t *testing.T) {
	ctx := context.Background()
	bk, err := bucket.Open(ctx, "mem://")
	if err != nil {
		t.Fatal(err)
	}
	dicts := archive.NewDicts(bk)
	if d, err := dicts.Current(ctx); d != nil || err != nil {
		t.Fatalf("current of an empty bucket: %v, %v", d, err)
	}
	build, test := fixture(t, "bazel-build-10.besrec"), invocation(t, "bazel-test-60.besrec")
	first, err := dicts.Save(ctx, func(id uint32) ([]byte, error) { return archive.Train(build, id, 0, zstd.SpeedDefault) })
	if err != nil {
		t.Fatal(err)
	}
	if !archive.PrivateID(first.ID) {
		t.Fatalf("id %d outside zstd's private range", first.ID)
	}
	old := encode(t, test.Messages, first)
	second, err := dicts.Save(ctx, func(id uint32) ([]byte, error) {
		return archive.Train([]archive.Build{test}, id, 0, zstd.SpeedDefault)
	})
	if err != nil {
		t.Fatal(err)
	}
	if cur, err := dicts.Current(ctx); err != nil || cur.ID != second.ID {
		t.Fatalf("current: %v, %v; want %d", cur, err, second.ID)
	}
	// A fresh cache, as another process reads: the old object decodes
	// with the old dictionary.
	fresh := archive.NewDicts(bk)
	if got, _, err := decode(old, fresh.Loader(ctx)); err != nil || len(got) != len(test.Messages) {
		t.Fatalf("old object after the dictionary changed: %d messages, %v", len(got), err)
	}
	if err := bk.Delete(ctx, archive.DictKey(first.ID)); err != nil {
		t.Fatal(err)
	}
	_, _, err = decode(old, archive.NewDicts(bk).Loader(ctx))
	if !errors.Is(err, archive.ErrDictMissing) || !strings.Contains(err.Error(), fmt.Sprint(first.ID)) ||
		!strings.Contains(err.Error(), archive.DictKey(first.ID)) {
		t.Fatalf("missing dictionary: %v; want ErrDictMissing naming %d and its key", err, first.ID)
	}
}

// TestLargeBuildBoundedMemory streams a build of 400,000 events (about
// 350 MB of records) through the writer into the reader: the heap stays
// under a bound that zstd's windows and buffers (writer and reader both
// in this process) set, whatever the build's size.
func TestLargeBuildBoundedMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("large")
	}
	src := invocation(t, "bazel-test-60.besrec").Messages
	const n = 400_000
	// The heap is the process's: what earlier tests of the package left
	// live (the shared NATS server's streams, fixtures) is there before
	// this one starts, and is not this build's.
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	base := ms.HeapInuse
	pr, pw := io.Pipe()
	go func() {
		w, err := archive.NewWriter(pw, nil, zstd.SpeedDefault)
		if err != nil {
			pw.CloseWithError(err)
			return
		}
		for i := range n {
			m := *src[i%len(src)]
			m.Sequence = uint64(i + 1)
			if err := w.Write(&m); err != nil {
				pw.CloseWithError(err)
				return
			}
		}
		_, err = w.Close()
		pw.CloseWithError(err)
	}()
	r, err := archive.NewReader(pr, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	var peak uint64
	for i := 0; ; i++ {
		m, err := r.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			t.Fatal(err)
		}
		if m.Sequence != uint64(i+1) {
			t.Fatalf("message %d has sequence %d", i, m.Sequence)
		}
		if i%20_000 == 0 {
			runtime.GC()
			runtime.ReadMemStats(&ms)
			peak = max(peak, ms.HeapInuse-min(base, ms.HeapInuse))
		}
	}
	st := r.Stats()
	if st.Messages != n {
		t.Fatalf("read %d messages, want %d", st.Messages, n)
	}
	// The writer (in this process too) and the reader each hold zstd's
	// window and buffers: about 45 MiB on a quiet machine, up to 50 when
	// the writer runs ahead on a busy one. A build held whole would be the
	// records' 350 MB.
	const bound = 64 << 20
	if peak > bound {
		t.Fatalf("heap in use grew by %d bytes (from %d) for %d bytes of records: it grows with the build", peak, base, st.RawBytes)
	}
	t.Logf("%d messages, %d bytes of records, heap in use grew by %d at most (from %d)", st.Messages, st.RawBytes, peak, base)
}

// records splits an object's zstd content into its records (length
// prefixes included).
func records(t *testing.T, obj []byte) [][]byte {
	t.Helper()
	dec, err := zstd.NewReader(bytes.NewReader(obj[9:]))
	if err != nil {
		t.Fatal(err)
	}
	defer dec.Close()
	raw, err := io.ReadAll(dec)
	if err != nil {
		t.Fatal(err)
	}
	var out [][]byte
	for len(raw) > 0 {
		n, k := binary.Uvarint(raw)
		out = append(out, raw[:k+int(n)])
		raw = raw[k+int(n):]
	}
	return out
}

func recompress(t *testing.T, header []byte, recs [][]byte) []byte {
	t.Helper()
	buf := bytes.NewBuffer(append([]byte{}, header...))
	enc, _ := zstd.NewWriter(buf)
	for _, r := range recs {
		enc.Write(r)
	}
	if err := enc.Close(); err != nil {
		t.Fatal(err)
	}
	return buf.Bytes()
}
