package archive_test

import (
	"bytes"
	"io"
	"testing"

	"github.com/millrace/millrace/archive"
)

// BenchmarkArchiveBuild is the archiver's CPU per build, less the stream
// and the bucket: the recorded 60-target bazel test (517 events) written
// with a dictionary trained on the other recording, then read back whole.
// Run: go test -run XXX -bench ArchiveBuild -benchtime 200x ./archive/
func BenchmarkArchiveBuild(b *testing.B) {
	build := invocation(b, "bazel-test-60.besrec")
	d := train(b, fixture(b, "bazel-build-10.besrec"))
	load := func(uint32) (*archive.Dict, error) { return d, nil }
	var raw, stored int64
	for b.Loop() {
		var buf bytes.Buffer
		w, _ := archive.NewWriter(&buf, d, archive.Level)
		for _, m := range build.Messages {
			w.Write(m)
		}
		st, err := w.Close()
		if err != nil {
			b.Fatal(err)
		}
		r, err := archive.NewReader(&buf, load)
		if err != nil {
			b.Fatal(err)
		}
		stored = int64(buf.Len())
		for {
			if _, err := r.Next(); err == io.EOF {
				break
			} else if err != nil {
				b.Fatal(err)
			}
		}
		r.Close()
		raw = int64(st.RawBytes)
	}
	b.ReportMetric(float64(raw)/float64(stored), "ratio")
	b.ReportMetric(float64(len(build.Messages)), "events/build")
}
