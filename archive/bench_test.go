package archive_test

import (
	"bytes"
	"io"
	"os"
	"path/filepath"
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

// BenchmarkHeldOut measures the ratio raw/stored of held-out builds with a
// dictionary trained on the recorded fixtures (loadtest/fixtures) and with
// plain zstd, at the archiver's level, and the CPU of writing one. The
// held-out builds are the recordings in $MILLRACE_ARCHIVE_HELD_OUT (a
// directory of .besrec files, recorded as loadtest/fixtures/README.md says
// with other seeds and sizes); without it, none (skipped).
//
//	MILLRACE_ARCHIVE_HELD_OUT=DIR go test -run XXX -bench HeldOut -benchtime 20x ./archive/
func BenchmarkHeldOut(b *testing.B) {
	dir := os.Getenv("MILLRACE_ARCHIVE_HELD_OUT")
	if dir == "" {
		b.Skip("set MILLRACE_ARCHIVE_HELD_OUT to a directory of recordings")
	}
	files, _ := filepath.Glob(filepath.Join(dir, "*.besrec"))
	held, err := archive.FromRecordings(files)
	if err != nil || len(held) == 0 {
		b.Fatalf("%d held-out builds from %s: %v", len(held), dir, err)
	}
	trainOn, _ := filepath.Glob(filepath.Join("..", "loadtest", "fixtures", "*.besrec"))
	train, err := archive.FromRecordings(trainOn)
	if err != nil {
		b.Fatal(err)
	}
	data, err := archive.Train(train, 40002, 0, archive.Level)
	if err != nil {
		b.Fatal(err)
	}
	d := &archive.Dict{ID: 40002, Data: data}
	with, _ := archive.Measure(held, d, archive.Level)
	plain, _ := archive.Measure(held, nil, archive.Level)
	for _, h := range held {
		one, _ := archive.Measure([]archive.Build{h}, d, archive.Level)
		p, _ := archive.Measure([]archive.Build{h}, nil, archive.Level)
		b.Logf("%s: %d events, %d bytes raw: %.2fx with the dictionary, %.2fx plain", h.Subject, one.Messages, one.RawBytes, one.Of(), p.Of())
	}
	b.ResetTimer()
	for b.Loop() {
		archive.Measure(held, d, archive.Level)
	}
	b.ReportMetric(with.Of(), "ratio_dict")
	b.ReportMetric(plain.Of(), "ratio_plain")
	b.ReportMetric(float64(len(data)), "dict_bytes")
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(held)), "ns/build")
	b.ReportMetric(float64(with.Messages)/float64(len(held)), "events/build")
}
