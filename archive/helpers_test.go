package archive_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/millrace/millrace/archive"
)

// fixtures are the real Bazel builds recorded in loadtest/fixtures, as
// the stream holds them: one build per subject.
func fixture(t testing.TB, name string) []archive.Build {
	t.Helper()
	f, err := os.Open(filepath.Join("..", "loadtest", "fixtures", name))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	bs, err := archive.FromRecording(f, 1)
	if err != nil {
		t.Fatal(err)
	}
	return bs
}

// invocation is the one build of a fixture on an invocation's subject
// (the others are its build-level lifecycle events).
func invocation(t testing.TB, name string) archive.Build {
	t.Helper()
	var best archive.Build
	for _, b := range fixture(t, name) {
		if len(b.Messages) > len(best.Messages) {
			best = b
		}
	}
	return best
}
