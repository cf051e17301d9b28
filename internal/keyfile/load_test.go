package keyfile

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/poll"
)

// named reads name=key entries; each key acts for its name.
var named = apikey.Syntax[string]{
	What: "test key", Name: "name", Form: "name=key",
	Principal: func(name string) (string, error) { return name, nil },
}

const (
	keyA = "key-a-0123456789abcdef"
	keyB = "key-b-0123456789abcdef"
	keyC = "key-c-0123456789abcdef"
	keyD = "key-d-0123456789abcdef"
)

// holds reports whether t holds exactly the keys of want (key -> name).
func holds(t *apikey.Table[string], want map[string]string) bool {
	for key, name := range want {
		if got, ok := t.Lookup(key); !ok || got != name {
			return false
		}
	}
	return t.Len() == len(want)
}

// Inline keys and a file's are one set, kept current from the file; a
// file that no longer parses, or holds no key, keeps the keys in force.
func TestLoadKeepsKeysCurrent(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dir := t.TempDir()
	both := filepath.Join(dir, "both")
	writeFile(t, both, "b="+keyB+"\n")
	merged, err := Load(ctx, Source{Inline: "a=" + keyA, File: both, What: "test keys"}, named, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !holds(merged, map[string]string{keyA: "a", keyB: "b"}) {
		t.Fatalf("inline and file: %d keys", merged.Len())
	}

	path := filepath.Join(dir, "keys")
	writeFile(t, path, "b="+keyB+"\n")
	m := NewMetrics(prometheus.NewRegistry())
	held, err := Load(ctx, Source{File: path, What: "test keys"}, named, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	cd := map[string]string{keyC: "c", keyD: "d"}
	writeFile(t, path, "c="+keyC+"\nd="+keyD+"\n")
	poll.Until(t, "the file's new keys", func() bool { return holds(held, cd) })
	errs := func() float64 { return testutil.ToFloat64(m.errors.WithLabelValues(path)) }
	writeFile(t, path, "bad\n")
	poll.Until(t, "the bad file refused", func() bool { return errs() >= 1 })
	writeFile(t, path, "# none\n")
	poll.Until(t, "the empty file refused", func() bool { return errs() >= 2 })
	if !holds(held, cd) {
		t.Fatalf("after a bad and an empty file: %d keys", held.Len())
	}
	if _, err := Load(ctx, Source{File: filepath.Join(dir, "none"), What: "test keys"}, named, nil, nil); !errors.Is(err, os.ErrNotExist) ||
		!strings.Contains(err.Error(), "test keys file") {
		t.Fatalf("a missing file: %v", err)
	}
	// Errors are the syntax's, its package's name in front.
	prefixed := named
	prefixed.Package = "svc"
	if _, err := Load(ctx, Source{Inline: "bad", What: "test keys"}, prefixed, nil, nil); err == nil || err.Error() != "svc: line 1: test keys are written name=key" {
		t.Fatalf("inline keys that do not parse: %v", err)
	}
}

// With nothing configured and a development directory, one key is made
// there on first use (mode 0600) and the same one is used after.
func TestLoadDevSecret(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "dev")
	src := Source{DevDir: dir, DevFile: "api-keys", DevName: "dev", What: "test keys"}
	first, err := Load(context.Background(), src, named, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "api-keys")
	st, err := os.Stat(path)
	b, _ := os.ReadFile(path)
	_, key, _ := strings.Cut(strings.TrimSpace(string(b)), "=")
	if p, ok := first.Lookup(key); err != nil || st.Mode().Perm() != 0o600 || first.Len() != 1 || len(key) != 32 || !ok || p != "dev" {
		t.Fatalf("development key: %v, %v, %q acts for %q", st, err, key, p)
	}
	again, err := Load(context.Background(), src, named, nil, nil)
	if _, ok := again.Lookup(key); err != nil || !ok || again.Len() != 1 {
		t.Fatalf("second start: %d keys, %v; want the same key", again.Len(), err)
	}
	inline, err := Load(context.Background(), Source{Inline: "given=" + keyA, DevDir: dir, DevFile: "other", DevName: "dev"}, named, nil, nil)
	if err != nil || inline.Len() != 1 {
		t.Fatalf("inline keys: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "other")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a development key was made although keys were given: %v", err)
	}
}
