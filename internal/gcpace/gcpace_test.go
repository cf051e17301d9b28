package gcpace

import (
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"slices"
	"testing"
	"time"
)

func TestPercent(t *testing.T) {
	c := Config{Headroom: 100 << 20, MinPercent: 50, MaxPercent: 800}
	for _, tc := range []struct {
		live uint64
		want int
	}{
		{0, 800},
		{1 << 20, 800},   // 10,000% capped
		{50 << 20, 200},  // 100 MiB over 50
		{100 << 20, 100}, // as GOGC=100
		{400 << 20, 50},  // 25% floored
		{200 << 20, 50},  // exactly the floor
		{125 << 20, 80},  // 100/125
		{1 << 30, 50},    // far above the headroom
		{13 << 20, 769},  // rounds
		{1<<20 + 1, 800}, // still capped
		{16 << 20, 625},  // 100/16
		{80 << 20, 125},  // 100/80
		{250 << 20, 50},  // 40% floored
		{110 << 20, 91},  // 90.9 rounds up
		{300 << 20, 50},  // floored
		{99 << 20, 101},  // 101.01
		{101 << 20, 99},  // 99.0
		{12.5 * (1 << 20), 800},
	} {
		if got := c.Percent(tc.live); got != tc.want {
			t.Errorf("Percent(%d MiB) = %d, want %d", tc.live>>20, got, tc.want)
		}
	}
	if got := (Config{}).Percent(32 << 20); got != 200 {
		t.Errorf("default headroom over 32 MiB: %d, want 200", got)
	}
}

func gogc() int {
	s := []metrics.Sample{{Name: "/gc/gogc:percent"}}
	metrics.Read(s)
	return int(s[0].Value.Uint64())
}

// After each collection the pacer sets GOGC from the live heap: a heap that
// grows gets a smaller GOGC, so what it may add stays near the headroom.
func TestStartFollowsTheLiveHeap(t *testing.T) {
	defer debug.SetGCPercent(debug.SetGCPercent(100))
	// A fixed headroom (MinHeadroom = Headroom): this is about the live heap.
	c := Config{Headroom: 32 << 20, MinHeadroom: 32 << 20, MinPercent: 10, MaxPercent: 10000}
	Start(c)
	defer Stop()

	var hold [][]byte
	for range 64 << 20 / (1 << 16) { // 64 MiB live, twice the headroom
		hold = append(hold, make([]byte, 1<<16))
	}
	want := func() int {
		s := []metrics.Sample{{Name: "/gc/heap/live:bytes"}, {Name: "/gc/scan/stack:bytes"}, {Name: "/gc/scan/globals:bytes"}}
		metrics.Read(s)
		return c.Percent(s[0].Value.Uint64() + s[1].Value.Uint64() + s[2].Value.Uint64())
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		runtime.GC()
		if w, got := want(), gogc(); w <= 50 && got > w*9/10 && got < w*11/10 {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("with 64 MiB live and 32 MiB headroom GOGC is %d, want about %d", got, w)
		}
		time.Sleep(10 * time.Millisecond) // the cleanup runs after the collection, in its own goroutine
	}
	runtime.KeepAlive(hold)
	hold = nil

	for {
		runtime.GC()
		if w, got := want(), gogc(); w >= 200 && got > w*9/10 && got < w*11/10 {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("with the 64 MiB freed GOGC is %d, want about %d", got, w)
		}
		time.Sleep(10 * time.Millisecond)
	}

	Stop()
	before := gogc()
	hold = nil
	for range 3 {
		runtime.GC()
	}
	if got := gogc(); got != before {
		t.Fatalf("after Stop GOGC moved from %d to %d", before, got)
	}
}

// Between MinHeadroom and Headroom the pacer gives the heap what the
// process allocates in Interval at its last rate: a quiet process a small
// headroom (little memory), a busy one the whole of Headroom (few
// collections).
func TestHeadroomFollowsTheAllocationRate(t *testing.T) {
	var set []int
	defer func(f func(int) int) { setGCPercent = f }(setGCPercent)
	setGCPercent = func(p int) int { set = append(set, p); return 100 }

	p := &pacer{cfg: Config{}.withDefaults()} // 16-64 MiB, 2 s
	const base = 16 << 20
	t0 := time.Unix(1000, 0)
	steps := []struct {
		allocs uint64 // bytes allocated so far
		at     time.Duration
		want   int
	}{
		{0, 0, 400},                        // no rate yet: 64 MiB over 16
		{4 << 20, time.Second, 100},        // 4 MiB/s: 8 MiB in 2 s, floored at 16
		{16 << 20, 2 * time.Second, 150},   // 12 MiB/s: 24 MiB
		{416 << 20, 3 * time.Second, 400},  // 400 MiB/s: capped at 64
		{420 << 20, 13 * time.Second, 100}, // idle again
		{420 << 20, 14 * time.Second, 100}, // nothing allocated
	}
	for i, s := range steps {
		p.apply(base, s.allocs, t0.Add(s.at))
		if p.percent != s.want {
			t.Fatalf("step %d (%d MiB allocated at %s): GOGC %d, want %d", i, s.allocs>>20, s.at, p.percent, s.want)
		}
	}
	// Only changes of a tenth or more reach the runtime.
	if want := []int{400, 100, 150, 400, 100}; !slices.Equal(set, want) {
		t.Fatalf("GOGC set to %v, want %v", set, want)
	}

	// A headroom set below the default floor is also the floor.
	if got := (Config{Headroom: 8 << 20}).headroomFor(0); got != 8<<20 {
		t.Fatalf("Headroom 8 MiB, idle: headroom %d, want 8 MiB", got)
	}
}
