package replay

import (
	"context"
	"strings"
	"testing"
	"time"
)

// TestRunRefusesNegatives: a negative count, rate or duration is refused
// before anything is dialled, naming the field (RateJitter alone means
// something negative: no jitter); zero fields take their defaults.
func TestRunRefusesNegatives(t *testing.T) {
	for field, set := range map[string]func(*Config){
		"Streams -1":          func(c *Config) { c.Streams = -1 },
		"Conns -1":            func(c *Config) { c.Conns = -1 },
		"Events -1":           func(c *Config) { c.Events = -1 },
		"Duration -1ns":       func(c *Config) { c.Duration = -1 },
		"Rate -1":             func(c *Config) { c.Rate = -1 },
		"Warmup -1ns":         func(c *Config) { c.Warmup = -1 },
		"WarmupPhase -0.5 is": func(c *Config) { c.WarmupPhase = -0.5 },
		"WarmupPhase 1.5 is":  func(c *Config) { c.WarmupPhase = 1.5 },
		"WarmupEvents -1":     func(c *Config) { c.WarmupEvents = -1 },
		"Ramp -1ns":           func(c *Config) { c.Ramp = -1 },
		"Ramp is for paced":   func(c *Config) { c.Ramp = time.Second },
		"Ramp is for paced runs without a warm-up": func(c *Config) { c.Ramp, c.Rate, c.Warmup = time.Second, 100, time.Second },
	} {
		c := Config{Target: "127.0.0.1:1", Scripts: []*Script{{}}}
		set(&c)
		if _, err := Run(context.Background(), c); err == nil || !strings.Contains(err.Error(), "replay: "+field) {
			t.Errorf("%s: Run returned %v, want an error naming the field", field, err)
		}
	}
	if err := (Config{Target: "127.0.0.1:1", Scripts: []*Script{{}}, RateJitter: -1}).Validate(); err != nil {
		t.Errorf("negative RateJitter (none): %v", err)
	}
	d := Config{}.withDefaults()
	if d.Streams != 1 || d.Conns != 1 || d.RateJitter != 0.2 || d.WarmupPhase != 1 {
		t.Errorf("defaults %+v", d)
	}
}

// TestWarmupPoint: the warm-up's starting point is within the first
// WarmupPhase of the script and, when WarmupEvents is set, within that
// many events, so that long builds start early and short ones anywhere.
func TestWarmupPoint(t *testing.T) {
	for _, c := range []struct {
		u, phase  float64
		maxEvents int
		n         int64
		want      int
	}{
		{0.5, 1, 0, 500, 250},   // no bound: halfway
		{0.5, 0.5, 0, 500, 125}, // within the first half
		{0.5, 1, 100, 500, 50},  // a long build: within its first 100 events
		{0.5, 1, 100, 86, 43},   // a build shorter than the bound: anywhere in it
		{0.99, 0.1, 100, 86, 8}, // the smaller bound wins
		{0, 1, 100, 500, 0},
	} {
		if got := warmupPoint(c.u, c.phase, c.maxEvents, c.n); got != c.want {
			t.Errorf("warmupPoint(%v, %v, %d, %d) = %d, want %d", c.u, c.phase, c.maxEvents, c.n, got, c.want)
		}
	}
}

// TestRampStart: workers start evenly over the ramp, the first at once.
func TestRampStart(t *testing.T) {
	t0 := time.Unix(1000, 0)
	for _, c := range []struct {
		ramp       time.Duration
		i, streams int
		want       time.Duration
	}{
		{20 * time.Second, 0, 5000, 0},
		{20 * time.Second, 2500, 5000, 10 * time.Second},
		{20 * time.Second, 4999, 5000, 20*time.Second - 4*time.Millisecond},
		{0, 4999, 5000, 0},
	} {
		if got := rampStart(t0, c.ramp, c.i, c.streams).Sub(t0); got != c.want {
			t.Errorf("rampStart(ramp %s, worker %d of %d) = +%s, want +%s", c.ramp, c.i, c.streams, got, c.want)
		}
	}
	if err := (Config{Target: "x", Scripts: []*Script{{}}, Rate: 100, Ramp: time.Second}).Validate(); err != nil {
		t.Errorf("a paced run with a ramp: %v", err)
	}
}
