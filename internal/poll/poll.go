// Package poll waits in tests for a condition that something else makes
// true: a consumer catching up, a file reloaded, a session opened. A test
// that waited a fixed time instead would be slow where the machine is
// fast and flaky where it is loaded; a poll returns as soon as the
// condition holds and fails, naming what it waited for, only when it
// never does.
//
// It imports nothing but the standard library, so that any test may use
// it without taking on a dependency.
package poll

import (
	"testing"
	"time"
)

// Defaults: generous, because a deadline only matters when the condition
// never comes, and a machine shared by parallel test binaries can be slow.
const (
	DefaultWithin = 15 * time.Second
	DefaultEvery  = 10 * time.Millisecond
)

// Option changes how long or how often a poll checks.
type Option func(*config)

type config struct {
	within, every time.Duration
}

// Within sets the deadline (DefaultWithin when d <= 0).
func Within(d time.Duration) Option { return func(c *config) { c.within = d } }

// Every sets the interval between checks (DefaultEvery when d <= 0).
func Every(d time.Duration) Option { return func(c *config) { c.every = d } }

func settings(opts []Option) config {
	c := config{}
	for _, o := range opts {
		o(&c)
	}
	if c.within <= 0 {
		c.within = DefaultWithin
	}
	if c.every <= 0 {
		c.every = DefaultEvery
	}
	return c
}

// Until checks cond until it holds. When it has not held by the deadline,
// Until fails t with "timed out after D waiting for what". It calls
// t.Fatalf, so it must run on the test's goroutine; elsewhere use True.
func Until(t testing.TB, what string, cond func() bool, opts ...Option) {
	t.Helper()
	c := settings(opts)
	if !wait(cond, c) {
		t.Fatalf("timed out after %s waiting for %s", c.within, what)
	}
}

// NoError is Until for a condition that says why it does not hold yet:
// the failure ends with the last error cond returned.
func NoError(t testing.TB, what string, cond func() error, opts ...Option) {
	t.Helper()
	c := settings(opts)
	var err error
	if !wait(func() bool { err = cond(); return err == nil }, c) {
		t.Fatalf("timed out after %s waiting for %s: %v", c.within, what, err)
	}
}

// True checks cond until it holds or the deadline passes, and reports
// whether it held. It is for goroutines other than the test's, and for
// callers that word their own failure.
func True(cond func() bool, opts ...Option) bool { return wait(cond, settings(opts)) }

func wait(cond func() bool, c config) bool {
	deadline := time.Now().Add(c.within)
	for !cond() {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(c.every)
	}
	return true
}
