package bes

import (
	"context"
	"sync"
)

// ackQueue carries a stream's published events from its receiver to its
// acker, in order, and bounds them at max: a receiver facing a full queue
// waits, which stops it reading the stream (back pressure to the client).
//
// It holds only what is in flight. A channel of capacity MaxInFlight did
// the same job but allocated its whole buffer (48 KB at the default 1,000)
// for every open stream, busy or not; at 2.5 events per second a Bazel
// stream has one or two events in flight.
type ackQueue struct {
	max   int
	ready chan struct{} // capacity 1: an event was pushed, or the queue closed (tryPop)
	room  chan struct{} // capacity 1: the acker took an event

	mu     sync.Mutex
	q      []inflight
	head   int
	closed bool
}

// keepCap is the largest buffer an emptied queue keeps; a longer one (a
// burst) is given back to the collector.
const keepCap = 16

func newAckQueue(max int) *ackQueue {
	return &ackQueue{max: max, ready: make(chan struct{}, 1), room: make(chan struct{}, 1)}
}

// push appends in, waiting while max events are in flight; it fails only
// when ctx ends.
func (a *ackQueue) push(ctx context.Context, in inflight) error {
	for {
		a.mu.Lock()
		if len(a.q)-a.head < a.max {
			if len(a.q) == cap(a.q) && a.head > 0 {
				// Full at the back with room at the front: move what is in
				// flight down rather than grow, so a stream that never
				// drains does not grow its buffer for ever.
				n := copy(a.q, a.q[a.head:])
				clear(a.q[n:])
				a.q, a.head = a.q[:n], 0
			}
			a.q = append(a.q, in)
			a.mu.Unlock()
			signal(a.ready)
			return nil
		}
		a.mu.Unlock()
		select {
		case <-a.room:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// close tells the acker that nothing more comes once the queue is empty.
func (a *ackQueue) close() {
	a.mu.Lock()
	a.closed = true
	a.mu.Unlock()
	signal(a.ready)
}

// tryPop takes the oldest event without waiting. With none, done tells
// whether one may still come: false until the queue is closed; the caller
// then waits on ready.
func (a *ackQueue) tryPop() (in inflight, ok, done bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.head == len(a.q) {
		return inflight{}, false, a.closed
	}
	in = a.q[a.head]
	a.q[a.head] = inflight{} // drop the references
	a.head++
	if a.head == len(a.q) {
		a.head = 0
		a.q = a.q[:0]
		if cap(a.q) > keepCap {
			a.q = nil
		}
	}
	signal(a.room)
	return in, true, false
}

// signal wakes the waiter on c, if any, without blocking.
func signal(c chan struct{}) {
	select {
	case c <- struct{}{}:
	default:
	}
}
