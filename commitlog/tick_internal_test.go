package commitlog

import (
	"testing"
	"time"
)

// The lead loop's tick waits long while quiet, comes back to its period
// at once when something comes, and is not put off by a busy loop that
// sets it on every turn.
func TestTick(t *testing.T) {
	k := newTick(10*time.Millisecond, time.Hour)
	defer k.stop()
	<-k.C()
	k.fired()
	k.next(true)
	select {
	case <-k.C():
		t.Fatal("a quiet tick fired within 200ms")
	case <-time.After(200 * time.Millisecond): // a window, polling would fire 20 times
	}
	k.next(false)
	select {
	case <-k.C():
		k.fired()
	case <-time.After(10 * time.Second):
		t.Fatal("the tick did not come back to its period when something came")
	}
	// A loop that turns every millisecond still ticks.
	deadline := time.After(10 * time.Second)
	for {
		k.next(false)
		select {
		case <-k.C():
			return
		case <-time.After(time.Millisecond):
		case <-deadline:
			t.Fatal("a busy loop put the tick off")
		}
	}
}
