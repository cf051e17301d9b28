package bes

import (
	"context"
	"testing"
	"time"
)

// pop waits for the queue's next event as the stream's acker does; false
// once the queue is closed and empty, or ctx ended.
func (a *ackQueue) pop(ctx context.Context) (inflight, bool) {
	for {
		in, ok, done := a.tryPop()
		if ok || done {
			return in, ok
		}
		select {
		case <-a.ready:
		case <-ctx.Done():
			return inflight{}, false
		}
	}
}

func TestAckQueueKeepsOrderAndBound(t *testing.T) {
	ctx := t.Context()
	a := newAckQueue(3)
	for i := int64(1); i <= 3; i++ {
		if err := a.push(ctx, inflight{seq: i}); err != nil {
			t.Fatal(err)
		}
	}
	// A fourth waits for room: the receiver stops reading its stream.
	short, cancel := context.WithTimeout(ctx, 20*time.Millisecond)
	defer cancel()
	if err := a.push(short, inflight{seq: 4}); err == nil {
		t.Fatal("push into a full queue did not wait for room")
	}
	pushed := make(chan error, 1)
	go func() { pushed <- a.push(ctx, inflight{seq: 4}) }()
	for want := int64(1); want <= 4; want++ {
		in, ok := a.pop(ctx)
		if !ok || in.seq != want {
			t.Fatalf("pop = %d, %v; want %d", in.seq, ok, want)
		}
		if want == 1 {
			if err := <-pushed; err != nil { // room made: the waiter goes on
				t.Fatal(err)
			}
		}
	}
	a.close()
	if in, ok := a.pop(ctx); ok {
		t.Fatalf("pop after close of an empty queue = %d", in.seq)
	}
}

func TestAckQueueDrainsBeforeClose(t *testing.T) {
	ctx := t.Context()
	a := newAckQueue(10)
	a.push(ctx, inflight{seq: 1})
	a.push(ctx, inflight{seq: 2})
	a.close()
	for want := int64(1); want <= 2; want++ {
		if in, ok := a.pop(ctx); !ok || in.seq != want {
			t.Fatalf("pop = %d, %v; want %d", in.seq, ok, want)
		}
	}
	if _, ok := a.pop(ctx); ok {
		t.Fatal("pop of a closed, drained queue succeeded")
	}
}

func TestAckQueueWaitersEndWithContext(t *testing.T) {
	ctx, cancel := context.WithCancel(t.Context())
	a := newAckQueue(1)
	a.push(ctx, inflight{seq: 1})
	pushed := make(chan error, 1)
	go func() { pushed <- a.push(ctx, inflight{seq: 2}) }()
	cancel()
	if err := <-pushed; err == nil {
		t.Fatal("push into a full queue after cancel succeeded")
	}
	b := newAckQueue(1)
	if _, ok := b.pop(ctx); ok {
		t.Fatal("pop of an empty queue after cancel succeeded")
	}
}

// A stream that never drains (one event always in flight) must not grow
// its buffer without bound, and an idle stream must give a burst's buffer
// back.
func TestAckQueueBufferStaysSmall(t *testing.T) {
	ctx := t.Context()
	a := newAckQueue(1000)
	a.push(ctx, inflight{seq: 0})
	for i := int64(1); i <= 100_000; i++ {
		a.push(ctx, inflight{seq: i})
		if in, _ := a.pop(ctx); in.seq != i-1 {
			t.Fatalf("pop = %d, want %d", in.seq, i-1)
		}
	}
	if c := cap(a.q); c > 8 {
		t.Fatalf("after 100,000 events with one in flight the buffer holds %d slots", c)
	}
	for i := int64(0); i < 999; i++ { // the queue's 1,000th
		a.push(ctx, inflight{seq: i})
	}
	for range 1000 {
		a.pop(ctx)
	}
	if a.q != nil {
		t.Fatalf("an emptied queue kept a burst's buffer of %d slots", cap(a.q))
	}
}
