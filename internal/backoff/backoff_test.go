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
