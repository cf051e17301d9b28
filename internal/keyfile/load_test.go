package keyfile

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/millrace/millrace/internal/poll"
)

// keys is a key set as a server keeps one: replaced whole on reload.
type keys struct{ list atomic.Pointer[[]string] }

func (k *keys) List() []string {
	if l := k.list.Load(); l != nil {
		return *l
	}
	return nil
}
func (k *keys) Len() int           { return len(k.List()) }
func (k *keys) Replace(from *keys) { l := from.List(); k.list.Store(&l) }

// parseSet reads one key a line ("bad" refuses the file).
func parseSet(text string) (*keys, error) {
	var l []string
	for _, line := range strings.Split(text, "\n") {
		if line = strings.TrimSpace(line); line == "bad" {
			return nil, errors.New("bad line")
		} else if line != "" && !strings.HasPrefix(line, "#") {
			l = append(l, line)
		}
	}
	k := &keys{}
	k.list.Store(&l)
	return k, nil
}

// Inline keys and a file's are one set, kept current from the file; a
// file that no longer parses, or holds no key, keeps the keys in force.
func TestLoadKeepsKeysCurrent(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	dir := t.TempDir()
	both := filepath.Join(dir, "both")
	writeFile(t, both, "b\n")
	merged := &keys{}
	if err := Load(ctx, Source{Inline: "a", File: both, What: "test keys"}, parseSet, merged, nil, nil); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(merged.List(), ","); got != "a,b" {
		t.Fatalf("inline and file: %s", got)
	}

	path := filepath.Join(dir, "keys")
	writeFile(t, path, "b\n")
	held := &keys{}
	m := NewMetrics(prometheus.NewRegistry())
	if err := Load(ctx, Source{File: path, What: "test keys"}, parseSet, held, m, nil); err != nil {
		t.Fatal(err)
	}
	writeFile(t, path, "c\nd\n")
	poll.Until(t, "the file's new keys", func() bool { return held.Len() == 2 })
	errs := func() float64 { return testutil.ToFloat64(m.errors.WithLabelValues(path)) }
	writeFile(t, path, "bad\n")
	poll.Until(t, "the bad file refused", func() bool { return errs() >= 1 })
	writeFile(t, path, "# none\n")
	poll.Until(t, "the empty file refused", func() bool { return errs() >= 2 })
	if got := strings.Join(held.List(), ","); got != "c,d" {
		t.Fatalf("after a bad and an empty file: %s", got)
	}
	if err := Load(ctx, Source{File: filepath.Join(dir, "none"), What: "test keys"}, parseSet, &keys{}, nil, nil); !errors.Is(err, os.ErrNotExist) ||
		!strings.Contains(err.Error(), "test keys file") {
		t.Fatalf("a missing file: %v", err)
	}
}

// With nothing configured and a development directory, one key is made
// there on first use (mode 0600) and the same one is used after.
func TestLoadDevSecret(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "dev")
	src := Source{DevDir: dir, DevFile: "api-keys", DevName: "dev", What: "test keys"}
	parse := func(text string) (*keys, error) { return parseSet(strings.ReplaceAll(text, "dev=", "")) }
	first := &keys{}
	if err := Load(context.Background(), src, parse, first, nil, nil); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(filepath.Join(dir, "api-keys"))
	if err != nil || st.Mode().Perm() != 0o600 || first.Len() != 1 || len(first.List()[0]) != 32 {
		t.Fatalf("development key: %v, %v, %q", st, err, first.List())
	}
	again := &keys{}
	if err := Load(context.Background(), src, parse, again, nil, nil); err != nil || again.List()[0] != first.List()[0] {
		t.Fatalf("second start: %q, %v; want the same key", again.List(), err)
	}
	inline := &keys{}
	if err := Load(context.Background(), Source{Inline: "given", DevDir: dir, DevFile: "other", DevName: "dev"}, parseSet, inline, nil, nil); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "other")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("a development key was made although keys were given: %v", err)
	}
}
