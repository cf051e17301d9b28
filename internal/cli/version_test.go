package cli

import (
	"runtime/debug"
	"testing"
)

// The linked version wins; without one, the build information's, which a
// test binary has too.
func TestVersion(t *testing.T) {
	if v := Version("v1.2.3"); v != "v1.2.3" {
		t.Fatalf("linked v1.2.3: %q", v)
	}
	want := "(devel)"
	if info, ok := debug.ReadBuildInfo(); ok && info.Main.Version != "" {
		want = info.Main.Version
	}
	if v := Version(""); v != want && (len(v) <= len(want) || v[:len(want)+1] != want+" ") {
		t.Fatalf("nothing linked: %q, want %q (and a revision, if any)", v, want)
	}
}
