// Package gcpace paces Go's garbage collector by a headroom in bytes: after
// every collection it sets GOGC so that the heap may grow by about a
// headroom over the live data before the next one, instead of by a fixed
// multiple of it (within MinPercent and MaxPercent). The headroom is what
// the process allocates in Interval at the rate it allocated since the
// last collection, between MinHeadroom and Headroom: a busy process gets
// the whole of Headroom and is collected rarely, a quiet one a small
// headroom that its open streams' live data, not the collector's slack,
// dominates.
//
// Why: the event edges allocate per event, and a small heap collected
// often costs CPU (the edge once spent a third of its CPU in the collector
// at GOGC=100). A fixed GOGC=400 fixed that for a small heap but made
// memory grow five times as fast as what open streams hold: at 1,000 open
// Bazel streams a 54 MB live heap let the process grow past 400 MB. With a
// headroom, what each open stream costs is its live data only, and a small
// heap still gets a large GOGC. A fixed headroom of 64 MiB was still a
// large share of the edge's heap at 1,000 paced streams (76 KiB of RSS per
// stream on a server that only acks, the bench's grpc-floor); a fixed 16
// MiB cost the edge a quarter more CPU per event flat out. Following the
// allocation rate gives each its own.
package gcpace

import (
	"math"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"time"
)

// Config bounds the pacing. Zero fields take the defaults.
type Config struct {
	// Headroom is the most the heap may grow over its live data between
	// collections. Default 64 MiB.
	Headroom uint64
	// MinHeadroom is the least (default 16 MiB, or Headroom when that is
	// smaller).
	MinHeadroom uint64
	// Interval: between the two, the headroom is what the process would
	// allocate in Interval at its rate since the last collection, so
	// that a collection comes about every Interval. Default 2 s.
	Interval time.Duration
	// MinPercent and MaxPercent bound the GOGC it sets: at least
	// MinPercent (a heap much larger than Headroom is not collected
	// ever more often), at most MaxPercent (a tiny heap is not left
	// unchecked). Defaults 50 and 800.
	MinPercent, MaxPercent int
}

// Config's defaults.
const (
	DefaultHeadroom    = 64 << 20
	DefaultMinHeadroom = 16 << 20
	DefaultInterval    = 2 * time.Second
	DefaultMinPercent  = 50
	DefaultMaxPercent  = 800
)

func (c Config) withDefaults() Config {
	if c.Headroom == 0 {
		c.Headroom = DefaultHeadroom
	}
	if c.MinHeadroom == 0 {
		c.MinHeadroom = DefaultMinHeadroom
	}
	c.MinHeadroom = min(c.MinHeadroom, c.Headroom)
	if c.Interval == 0 {
		c.Interval = DefaultInterval
	}
	if c.MinPercent == 0 {
		c.MinPercent = DefaultMinPercent
	}
	if c.MaxPercent == 0 {
		c.MaxPercent = DefaultMaxPercent
	}
	return c
}

// Percent is the GOGC that gives c's Headroom over base bytes: the live
// heap, stacks and globals the collector's goal is a multiple of.
func (c Config) Percent(base uint64) int {
	return c.percent(base, c.withDefaults().Headroom)
}

// percent is the GOGC that gives headroom over base bytes.
func (c Config) percent(base, headroom uint64) int {
	c = c.withDefaults()
	if base == 0 {
		return c.MaxPercent
	}
	p := math.Round(float64(headroom) * 100 / float64(base))
	return int(min(max(p, float64(c.MinPercent)), float64(c.MaxPercent)))
}

// headroomFor is the headroom at an allocation rate in bytes per second:
// Interval's worth, between MinHeadroom and Headroom.
func (c Config) headroomFor(rate float64) uint64 {
	c = c.withDefaults()
	h := rate * c.Interval.Seconds()
	return uint64(min(max(h, float64(c.MinHeadroom)), float64(c.Headroom)))
}

var (
	mu      sync.Mutex
	running *pacer
)

// Start paces the collector by c until Stop. It sets GOGC at once from the
// current live heap and again after every collection. A second Start
// replaces the first's configuration.
func Start(c Config) {
	mu.Lock()
	defer mu.Unlock()
	if running != nil {
		running.cfg = c.withDefaults()
		running.tune()
		return
	}
	running = &pacer{cfg: c.withDefaults(), sample: []metrics.Sample{
		{Name: "/gc/heap/live:bytes"}, {Name: "/gc/scan/stack:bytes"}, {Name: "/gc/scan/globals:bytes"},
		{Name: "/gc/heap/allocs:bytes"},
	}}
	running.tune()
	running.arm()
}

// Stop ends the pacing and leaves GOGC at what it last set.
func Stop() {
	mu.Lock()
	defer mu.Unlock()
	running = nil
}

// Percent is the GOGC the pacer last set (0: not started).
func Percent() int {
	mu.Lock()
	defer mu.Unlock()
	if running == nil {
		return 0
	}
	return running.percent
}

type pacer struct {
	cfg     Config
	sample  []metrics.Sample
	percent int
	// allocs and at: the bytes allocated so far and the time, at the
	// last tune (at is zero before the first).
	allocs uint64
	at     time.Time
}

// sentinel is garbage the moment it is made: its cleanup runs after the
// collection that finds it, and arms the next. It holds a pointer and is
// larger than 16 bytes, so the tiny allocator does not batch it with other
// objects that would keep it alive.
type sentinel struct {
	p    *pacer
	_pad [3]uint64
}

func (p *pacer) arm() {
	s := &sentinel{p: p}
	runtime.AddCleanup(s, afterGC, p)
}

func afterGC(p *pacer) {
	mu.Lock()
	defer mu.Unlock()
	if running != p {
		return // stopped, or replaced
	}
	p.tune()
	p.arm()
}

// tune sets GOGC from the last collection. Callers hold mu.
func (p *pacer) tune() {
	metrics.Read(p.sample)
	// The collector's goal is live heap + (live heap + stacks + globals) x
	// GOGC/100: with thousands of goroutines the stacks are a good part of
	// the base, and leaving them out gave a larger process a larger
	// headroom.
	var base uint64
	for _, s := range p.sample[:3] {
		base += s.Value.Uint64()
	}
	p.apply(base, p.sample[3].Value.Uint64(), time.Now())
}

// apply sets GOGC for base bytes of live data, allocs bytes allocated
// since the process started, at now.
func (p *pacer) apply(base, allocs uint64, now time.Time) {
	// The first tune has no rate yet: the whole headroom, as a busy
	// process would have.
	headroom := p.cfg.Headroom
	if dt := now.Sub(p.at); !p.at.IsZero() && dt > 0 && allocs >= p.allocs {
		headroom = p.cfg.headroomFor(float64(allocs-p.allocs) / dt.Seconds())
	}
	p.allocs, p.at = allocs, now
	want := p.cfg.percent(base, headroom)
	// SetGCPercent recomputes the collector's goal: skip changes of less
	// than a tenth, which move the goal by little.
	if p.percent != 0 && math.Abs(float64(want-p.percent)) < float64(p.percent)/10 {
		return
	}
	setGCPercent(want)
	p.percent = want
}

// setGCPercent is debug.SetGCPercent (a variable for the tests of apply).
var setGCPercent = debug.SetGCPercent
