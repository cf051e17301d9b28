// Package keyfile keeps secrets read from files (API keys, join tokens,
// bearer tokens) current while a server runs, so that a leaked key is
// revoked by editing its file: the change is applied within a second (or at
// once on Reload, which a command calls on SIGHUP), with no restart.
//
// A Watcher reads its file at start (an error there is the caller's to
// report: the process should not start), then checks the file's size,
// modification time and identity every interval. When they change it reads
// the file and hands the bytes to apply; apply parses them and swaps them
// into place. A file that cannot be read or does not parse keeps the
// previous keys in force: the error is logged and counted
// (millrace_keyfile_reload_errors_total), and the next change is tried
// again. Keys are never half replaced.
//
// Load is what a server calls: it reads a Source (keys given inline, a
// file, or in development a file made with a random key on first use,
// DevSecret) in the server's syntax into an apikey.Table and keeps it
// current.
package keyfile

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// DefaultInterval is how often a file is checked for changes.
const DefaultInterval = time.Second

// Metrics count reloads per file.
type Metrics struct {
	reloads *prometheus.CounterVec
	errors  *prometheus.CounterVec
	failing *prometheus.GaugeVec
}

// NewMetrics registers the metrics on reg.
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		reloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_keyfile_reloads_total", Help: "Key files read again after a change and applied.",
		}, []string{"file"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_keyfile_reload_errors_total", Help: "Key file changes that could not be read or parsed; the previous keys stay in force.",
		}, []string{"file"}),
		failing: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_keyfile_reload_failing", Help: "1 while the last change of a key file could not be applied (its previous keys are in force).",
		}, []string{"file"}),
	}
	reg.MustRegister(m.reloads, m.errors, m.failing)
	return m
}

// Watcher keeps one file applied.
type Watcher struct {
	path  string
	apply func([]byte) error
	log   *slog.Logger
	m     *Metrics

	mu      sync.Mutex // one read-and-apply at a time
	stamp   stamp
	digest  [32]byte // of what was last applied: a touch alone changes nothing
	lastErr string   // reported already: a file missing for a minute is logged once
	poke    chan struct{}
}

// stamp is what a cheap stat says about a file.
type stamp struct {
	info os.FileInfo
	size int64
	mod  time.Time
}

func (a stamp) same(b stamp) bool {
	if a.info == nil || b.info == nil {
		return a.info == b.info
	}
	return a.size == b.size && a.mod.Equal(b.mod) && os.SameFile(a.info, b.info)
}

// New reads path and applies it; an error means nothing was applied. m
// and log may be nil.
func New(path string, apply func([]byte) error, m *Metrics, log *slog.Logger) (*Watcher, error) {
	if log == nil {
		log = slog.Default()
	}
	w := &Watcher{path: path, apply: apply, log: log, m: m, poke: make(chan struct{}, 1)}
	st, b, err := w.read()
	if err != nil {
		return nil, err
	}
	if err := apply(b); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	w.stamp, w.digest = st, sha256.Sum256(b)
	if m != nil {
		m.failing.WithLabelValues(path).Set(0)
	}
	return w, nil
}

// read returns the file and its stamp. An editor or a script that
// truncates a file and then writes it can be caught half way: the file is
// read again until it is the same before and after the read (and as long as
// its size says), a few times, so that half a key file is never applied.
// Replacing the file by a rename is atomic and needs none of this.
func (w *Watcher) read() (stamp, []byte, error) {
	for attempt := 0; ; attempt++ {
		fi, err := os.Stat(w.path)
		if err != nil {
			return stamp{}, nil, err
		}
		b, err := os.ReadFile(w.path)
		if err != nil {
			return stamp{}, nil, err
		}
		st := stamp{info: fi, size: fi.Size(), mod: fi.ModTime()}
		after, err := os.Stat(w.path)
		if err == nil && int64(len(b)) == st.size && st.same(stamp{info: after, size: after.Size(), mod: after.ModTime()}) {
			return st, b, nil
		}
		if attempt == 4 {
			return stamp{}, nil, fmt.Errorf("the file kept changing while it was read")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// Run checks the file every interval (DefaultInterval if 0) and when
// Reload or ReloadAll is called, until ctx ends. The watchers of one
// interval share a clock (joinClock).
func (w *Watcher) Run(ctx context.Context, interval time.Duration) {
	if interval <= 0 {
		interval = DefaultInterval
	}
	unregister := register(w)
	defer unregister()
	leave := joinClock(interval, w)
	defer leave()
	for {
		select {
		case <-ctx.Done():
			return
		case <-w.poke:
			w.check(true)
		}
	}
}

// clocks are the running watchers by interval, each interval's checked
// by one goroutine in turn: a process with a key file per edge (four in
// millrace dev) wakes once a second for them, not once per file, which is
// most of what an idle process would otherwise do of its own.
var clocks struct {
	sync.Mutex
	by map[time.Duration]*clock
}

type clock struct {
	watchers map[*Watcher]struct{} // under clocks' lock
	stop     chan struct{}
}

// joinClock has w checked every interval until leave is called; the
// clock of an interval runs while it has watchers.
func joinClock(interval time.Duration, w *Watcher) (leave func()) {
	clocks.Lock()
	defer clocks.Unlock()
	if clocks.by == nil {
		clocks.by = map[time.Duration]*clock{}
	}
	c := clocks.by[interval]
	if c == nil {
		c = &clock{watchers: map[*Watcher]struct{}{}, stop: make(chan struct{})}
		clocks.by[interval] = c
		go c.run(interval)
	}
	c.watchers[w] = struct{}{}
	return func() {
		clocks.Lock()
		defer clocks.Unlock()
		delete(c.watchers, w)
		if len(c.watchers) == 0 {
			close(c.stop)
			delete(clocks.by, interval)
		}
	}
}

// run checks the clock's watchers every interval until it stops. A check
// that is under way when its watcher leaves finishes: it applies the file
// to keys no one reads any more.
func (c *clock) run(interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-c.stop:
			return
		case <-t.C:
		}
		clocks.Lock()
		ws := slices.Collect(maps.Keys(c.watchers))
		clocks.Unlock()
		for _, w := range ws {
			w.check(false)
		}
	}
}

// Reload reads the file now, changed or not, and applies it. It returns
// the error that kept the previous keys in force, if any.
func (w *Watcher) Reload() error { return w.check(true) }

func (w *Watcher) check(force bool) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !force {
		fi, err := os.Stat(w.path)
		if err == nil && w.stamp.same(stamp{info: fi, size: fi.Size(), mod: fi.ModTime()}) {
			return nil
		}
	}
	st, b, err := w.read()
	if err == nil {
		if d := sha256.Sum256(b); d == w.digest {
			w.stamp = st
			return nil
		}
		err = w.apply(b)
	}
	if err != nil {
		// A bad file is read again only when it changes (its stamp is
		// kept); a missing one every interval. Either is reported once
		// until the error changes.
		if msg := err.Error(); msg != w.lastErr || force {
			w.lastErr = msg
			w.log.Error("key file not reloaded; the previous keys stay in force", "file", w.path, "err", err)
			if w.m != nil {
				w.m.errors.WithLabelValues(w.path).Inc()
			}
		}
		if w.m != nil {
			w.m.failing.WithLabelValues(w.path).Set(1)
		}
		if st.info != nil {
			w.stamp = st
		}
		return err
	}
	w.stamp, w.digest, w.lastErr = st, sha256.Sum256(b), ""
	w.log.Info("key file reloaded", "file", w.path)
	if w.m != nil {
		w.m.reloads.WithLabelValues(w.path).Inc()
		w.m.failing.WithLabelValues(w.path).Set(0)
	}
	return nil
}

// Running watchers, for ReloadAll.
var running struct {
	sync.Mutex
	set map[*Watcher]struct{}
}

func register(w *Watcher) func() {
	running.Lock()
	defer running.Unlock()
	if running.set == nil {
		running.set = map[*Watcher]struct{}{}
	}
	running.set[w] = struct{}{}
	return func() {
		running.Lock()
		defer running.Unlock()
		delete(running.set, w)
	}
}

// ReloadAll makes every running watcher read its file now (a command calls
// it on SIGHUP).
func ReloadAll() {
	running.Lock()
	defer running.Unlock()
	for w := range running.set {
		select {
		case w.poke <- struct{}{}:
		default:
		}
	}
}

// Lines is the text of inline followed by that of a file's bytes, the
// way key flags combine a value given inline with a file.
func Lines(inline string, file []byte) string {
	if len(bytes.TrimSpace(file)) == 0 {
		return inline
	}
	return inline + "\n" + string(file)
}
