package streams

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/poll"
)

// The export's acker ticks only while something is in flight, acks at
// once when woken, and once more when its context ends.
func TestAckLoopTicksOnlyWhileBusy(t *testing.T) {
	var busy atomic.Bool
	var acks atomic.Int32
	wake := make(chan struct{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); ackLoop(ctx, time.Millisecond, wake, busy.Load, func() { acks.Add(1) }) }()
	// A window, not a wait for something to happen: ticking, the loop
	// would ack about 200 times in it.
	time.Sleep(200 * time.Millisecond)
	if n := acks.Load(); n != 0 {
		t.Fatalf("an idle acker acked %d times", n)
	}
	busy.Store(true)
	wake <- struct{}{}
	poll.Until(t, "acks every tick while busy", func() bool { return acks.Load() >= 10 }, poll.Within(10*time.Second))
	busy.Store(false)
	wake <- struct{}{} // the loop sees busy false by the next turn
	poll.Until(t, "the wake taken", func() bool { return len(wake) == 0 }, poll.Within(10*time.Second))
	before := acks.Load()
	time.Sleep(200 * time.Millisecond)
	if n := acks.Load() - before; n > 2 {
		t.Fatalf("an acker with nothing in flight acked %d times", n)
	}
	before = acks.Load()
	cancel()
	<-done
	if acks.Load() != before+1 {
		t.Fatalf("%d acks when the context ended, want 1", acks.Load()-before)
	}
}
