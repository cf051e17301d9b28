package keyfile

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/millrace/millrace/internal/poll"
)

// writeFile replaces path the way operators and secret mounts do: a new
// file renamed into place.
func writeFile(t *testing.T, path, text string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestWatcherAppliesChangesAndKeepsKeysOnBadFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys")
	writeFile(t, path, "a\n")
	var cur atomic.Pointer[string]
	apply := func(b []byte) error {
		s := strings.TrimSpace(string(b))
		if strings.Contains(s, "bad") {
			return errors.New("does not parse")
		}
		cur.Store(&s)
		return nil
	}
	reg := prometheus.NewRegistry()
	m := NewMetrics(reg)
	w, err := New(path, apply, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	if got := *cur.Load(); got != "a" {
		t.Fatalf("applied %q at start", got)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx, 20*time.Millisecond)

	writeFile(t, path, "a\nb\n")
	poll.Until(t, "the added key", func() bool { return *cur.Load() == "a\nb" }, poll.Within(10*time.Second))

	// In place, same size: the modification time and content still tell.
	os.WriteFile(path, []byte("c\nb\n"), 0o600)
	poll.Until(t, "the edited key", func() bool { return *cur.Load() == "c\nb" }, poll.Within(10*time.Second))

	writeFile(t, path, "bad\n")
	poll.Until(t, "the error counted", func() bool { return testutil.ToFloat64(m.errors.WithLabelValues(path)) == 1 }, poll.Within(10*time.Second))
	if got := *cur.Load(); got != "c\nb" {
		t.Fatalf("a bad file replaced the keys with %q", got)
	}
	if testutil.ToFloat64(m.failing.WithLabelValues(path)) != 1 {
		t.Fatal("failing gauge not set")
	}
	os.Remove(path)
	if err := w.Reload(); err == nil {
		t.Fatal("Reload of a missing file reported no error")
	}
	if got := *cur.Load(); got != "c\nb" {
		t.Fatalf("a missing file replaced the keys with %q", got)
	}
	writeFile(t, path, "d\n")
	poll.Until(t, "recovery", func() bool { return *cur.Load() == "d" }, poll.Within(10*time.Second))
	if testutil.ToFloat64(m.failing.WithLabelValues(path)) != 0 {
		t.Fatal("failing gauge not cleared")
	}
}

// ReloadAll (SIGHUP) applies a change at once, well inside one interval.
func TestReloadAll(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys")
	writeFile(t, path, "a")
	var cur atomic.Pointer[string]
	w, err := New(path, func(b []byte) error { s := string(b); cur.Store(&s); return nil }, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx, time.Hour)
	writeFile(t, path, "b")
	// Run registers itself when it starts: poke until it has.
	poll.Until(t, "the reload", func() bool { ReloadAll(); return *cur.Load() == "b" }, poll.Within(10*time.Second))
}

func TestNewFailsOnBadFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "keys")
	if _, err := New(path, func([]byte) error { return nil }, nil, nil); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("missing file: %v", err)
	}
	writeFile(t, path, "x")
	if _, err := New(path, func([]byte) error { return errors.New("no") }, nil, nil); err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("bad file: %v", err)
	}
}

// The watchers of one interval share one clock, which stops with the
// last of them; each still sees its own file's changes.
func TestWatchersShareAClock(t *testing.T) {
	const every = 15 * time.Millisecond
	dir := t.TempDir()
	var cur [3]atomic.Pointer[string]
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}, len(cur))
	for i := range cur {
		path := filepath.Join(dir, string(rune('a'+i)))
		writeFile(t, path, "x")
		w, err := New(path, func(b []byte) error { s := string(b); cur[i].Store(&s); return nil }, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		go func() { w.Run(ctx, every); done <- struct{}{} }()
	}
	clockOf := func() (running, watching int) {
		clocks.Lock()
		defer clocks.Unlock()
		if c := clocks.by[every]; c != nil {
			return 1, len(c.watchers)
		}
		return 0, 0
	}
	poll.Until(t, "three watchers on one clock", func() bool { r, w := clockOf(); return r == 1 && w == 3 }, poll.Within(10*time.Second))
	for i := range cur {
		writeFile(t, filepath.Join(dir, string(rune('a'+i))), "y")
	}
	for i := range cur {
		poll.Until(t, "each file's change", func() bool { return *cur[i].Load() == "y" }, poll.Within(10*time.Second))
	}
	cancel()
	for range cur {
		<-done
	}
	if r, _ := clockOf(); r != 0 {
		t.Fatal("the clock runs on after its last watcher stopped")
	}
}
