// Package backoff is the one retry pause of millrace's loops: a wait that
// doubles from Min to Max after each failure and starts again at Min after
// a success, jittered if asked.
//
// It imports nothing but the standard library: the agent, which runs on
// GPU nodes, uses it too.
package backoff

import (
	"context"
	"math/rand/v2"
	"time"
)

// Defaults taken by a zero Min or Max.
const (
	DefaultMin = 100 * time.Millisecond
	DefaultMax = 5 * time.Second
)

// Backoff is the pause before the next attempt. The zero value is ready
// (DefaultMin doubling to DefaultMax); it is not safe for concurrent use.
type Backoff struct {
	Min, Max time.Duration
	// Jitter takes each pause at random between half of it and all of it,
	// so that clients that failed together do not all try again at once.
	// The doubling goes on from the whole pause.
	Jitter bool
	next   time.Duration
}

func (b *Backoff) bounds() (lo, hi time.Duration) {
	lo, hi = b.Min, b.Max
	if lo <= 0 {
		lo = DefaultMin
	}
	if hi <= 0 {
		hi = DefaultMax
	}
	return lo, max(lo, hi)
}

// Next returns the pause to take now and doubles the one after it, up to
// Max.
func (b *Backoff) Next() time.Duration {
	lo, hi := b.bounds()
	d := min(max(b.next, lo), hi)
	b.next = min(2*d, hi)
	if b.Jitter {
		return d/2 + rand.N(d/2+1)
	}
	return d
}

// Reset starts the doubling again at Min: the last attempt succeeded.
func (b *Backoff) Reset() { b.next = 0 }

// Wait pauses for Next, or until ctx ends; it reports whether the whole
// pause passed.
func (b *Backoff) Wait(ctx context.Context) bool { return Sleep(ctx, b.Next()) }

// Sleep waits d or until ctx ends; it reports whether it slept the whole d.
func Sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	}
}
