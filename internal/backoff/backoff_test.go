package backoff

import (
	"context"
	"testing"
	"time"
)

func TestDoublesToMaxAndResets(t *testing.T) {
	b := Backoff{Min: 10 * time.Millisecond, Max: 50 * time.Millisecond}
	var got []time.Duration
	for range 5 {
		got = append(got, b.Next())
	}
	want := []time.Duration{10, 20, 40, 50, 50}
	for i := range want {
		if got[i] != want[i]*time.Millisecond {
			t.Fatalf("pauses %v, want %v ms", got, want)
		}
	}
	b.Reset()
	if d := b.Next(); d != 10*time.Millisecond {
		t.Fatalf("after Reset: %v, want Min", d)
	}
}

func TestZeroTakesDefaults(t *testing.T) {
	var b Backoff
	if d := b.Next(); d != DefaultMin {
		t.Fatalf("first pause %v, want %v", d, DefaultMin)
	}
	for range 20 {
		b.Next()
	}
	if d := b.Next(); d != DefaultMax {
		t.Fatalf("pause %v after many failures, want %v", d, DefaultMax)
	}
	// A Max below Min is Min: the pause never shrinks below what was asked.
	b = Backoff{Min: time.Second, Max: time.Millisecond}
	if d := b.Next(); d != time.Second {
		t.Fatalf("Max below Min: %v, want 1s", d)
	}
}

func TestWaitEndsWithTheContext(t *testing.T) {
	b := Backoff{Min: time.Hour}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if b.Wait(ctx) {
		t.Fatal("Wait reported a full pause on an ended context")
	}
	b = Backoff{Min: time.Millisecond}
	if !b.Wait(context.Background()) {
		t.Fatal("Wait did not report its full pause")
	}
}

// TestJitter: a jittered pause lies between half of the unjittered one and
// all of it, the doubling goes on from the whole pause, and the pauses of
// clients that failed together differ.
func TestJitter(t *testing.T) {
	whole := []time.Duration{8, 16, 32, 64, 64}
	seen := map[time.Duration]bool{}
	for range 50 {
		b := Backoff{Min: 8 * time.Millisecond, Max: 64 * time.Millisecond, Jitter: true}
		for i, w := range whole {
			w *= time.Millisecond
			d := b.Next()
			if d < w/2 || d > w {
				t.Fatalf("pause %d: %v, want between %v and %v", i, d, w/2, w)
			}
			if i == 0 {
				seen[d] = true
			}
		}
		b.Reset()
		if d := b.Next(); d > 8*time.Millisecond {
			t.Fatalf("after Reset: %v, want at most Min", d)
		}
	}
	if len(seen) < 2 {
		t.Fatalf("50 first pauses all %v: not jittered", seen)
	}
}
