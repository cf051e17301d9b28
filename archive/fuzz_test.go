package archive_test

import (
	"bytes"
	"errors"
	"io"
	"testing"

	"github.com/millrace/millrace/archive"
)

// FuzzReader: whatever an object holds, the reader returns messages then
// io.EOF, or an error; it never panics, and accepts an object only when
// its trailer matches what it read. Seeded with objects of the recorded
// builds, plain and with a dictionary.
func FuzzReader(f *testing.F) {
	build := fixture(f, "bazel-build-10.besrec")
	d := train(f, build)
	for _, b := range build {
		f.Add(encode(f, b.Messages, nil))
		f.Add(encode(f, b.Messages, d))
	}
	f.Add(encode(f, nil, nil))
	f.Fuzz(func(t *testing.T, obj []byte) {
		r, err := archive.NewReader(bytes.NewReader(obj), func(uint32) (*archive.Dict, error) { return d, nil })
		if err != nil {
			return
		}
		defer r.Close()
		var n uint64
		var size int
		for {
			m, err := r.Next()
			if err == io.EOF {
				if st := r.Stats(); st.Messages != n {
					t.Fatalf("accepted %d messages, the trailer says %d", n, st.Messages)
				}
				return
			}
			if err != nil {
				if !errors.Is(err, archive.ErrCorrupt) && !errors.Is(err, archive.ErrDictMissing) {
					t.Fatalf("error of no class: %v", err)
				}
				return
			}
			n++
			_ = m.Header("Nats-Msg-Id")
			// A few bytes of zstd can stand for gigabytes (RLE blocks):
			// past a budget the input has made its point.
			if size += len(m.Payload); size > 64<<20 {
				return
			}
		}
	})
}
