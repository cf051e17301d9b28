package supervise

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/poll"
)

// events records what the components did, in order.
type events struct {
	mu   sync.Mutex
	list []string
}

func (e *events) add(format string, args ...any) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.list = append(e.list, fmt.Sprintf(format, args...))
}

func (e *events) get() []string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return slices.Clone(e.list)
}

func (e *events) has(s string) bool { return slices.Contains(e.get(), s) }

// component records its start, stop and the end of its loop, which runs
// until its context ends.
func (e *events) component(name string) Component {
	return Component{
		Name:  name,
		Start: func(context.Context) error { e.add("start %s", name); return nil },
		Run: func(ctx context.Context) error {
			<-ctx.Done()
			e.add("end %s", name)
			return ctx.Err()
		},
		Stop: func(context.Context) error { e.add("stop %s", name); return nil },
	}
}

func check(t *testing.T, e *events, want ...string) {
	t.Helper()
	if got := e.get(); !slices.Equal(got, want) {
		t.Fatalf("events\n %q\nwant\n %q", got, want)
	}
}

// Components start in order and stop in reverse; a loop runs until its own
// component is stopped, not until the signal, so it outlives the stops of
// the components after it.
func TestStartInOrderStopInReverse(t *testing.T) {
	var e events
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Run(ctx, Config{}, e.component("a"), e.component("b"), e.component("c")) }()
	poll.Until(t, "every component started", func() bool { return e.has("start c") })
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("a signal is a stop, not a failure: %v", err)
	}
	check(t, &e, "start a", "start b", "start c", "stop c", "end c", "stop b", "end b", "stop a", "end a")
}

// A component that fails to start stops those already started, in
// reverse; the ones after it never start; its error is Run's.
func TestStartFailureStopsThoseStarted(t *testing.T) {
	var e events
	boom := errors.New("boom")
	b := e.component("b")
	b.Start = func(context.Context) error { e.add("fail b"); return boom }
	err := Run(context.Background(), Config{}, e.component("a"), b, e.component("c"))
	if !errors.Is(err, boom) {
		t.Fatalf("Run: %v, want the start's error", err)
	}
	check(t, &e, "start a", "fail b", "stop a", "end a")
}

// A loop that ends by itself stops every component, itself included, in
// reverse; its error is Run's. One that ends cleanly stops them too, and
// Run returns nil.
func TestLoopEndingStopsTheRest(t *testing.T) {
	for _, loopErr := range []error{errors.New("listener gone"), nil} {
		var e events
		b := e.component("b")
		b.Run = func(context.Context) error { e.add("end b"); return loopErr }
		c := e.component("c")
		c.Start = func(context.Context) error {
			poll.Until(t, "b's loop to end", func() bool { return e.has("end b") })
			e.add("start c")
			return nil
		}
		err := Run(context.Background(), Config{}, e.component("a"), b, c)
		if err != loopErr {
			t.Fatalf("Run: %v, want the loop's %v", err, loopErr)
		}
		check(t, &e, "start a", "start b", "end b", "start c", "stop c", "end c", "stop b", "stop a", "end a")
	}
}

// Every Stop gets the same deadline: the whole stop is bounded once, not
// once per component.
func TestOneDeadlineForTheWholeStop(t *testing.T) {
	var (
		mu        sync.Mutex
		deadlines []time.Time
	)
	comp := func(name string) Component {
		return Component{Name: name, Stop: func(ctx context.Context) error {
			d, ok := ctx.Deadline()
			if !ok {
				t.Errorf("%s: Stop without a deadline", name)
			}
			mu.Lock()
			deadlines = append(deadlines, d)
			mu.Unlock()
			<-ctx.Done() // uses all the time there is
			return ctx.Err()
		}}
	}
	begin := time.Now()
	Run(context.Background(), Config{ShutdownTimeout: 50 * time.Millisecond}, comp("a"), comp("b"),
		Component{Name: "failing", Start: func(context.Context) error { return errors.New("boom") }})
	if len(deadlines) != 2 || !deadlines[0].Equal(deadlines[1]) {
		t.Fatalf("deadlines %v: want one for both", deadlines)
	}
	if deadlines[0].Before(begin) || deadlines[0].After(time.Now()) {
		t.Fatalf("deadline %v not within the run", deadlines[0])
	}
}

// A loop that ignores its context does not hold the stop past the
// deadline: the components before it are still stopped (and their loops
// told to end, though no longer waited for).
func TestStuckLoopDoesNotHoldTheStop(t *testing.T) {
	var e events
	release := make(chan struct{})
	defer close(release)
	stuck := Component{Name: "stuck", Run: func(context.Context) error { <-release; return nil }}
	ctx, cancel := context.WithCancel(context.Background())
	last := Component{Name: "signal", Start: func(context.Context) error { cancel(); return nil }}
	if err := Run(ctx, Config{ShutdownTimeout: 20 * time.Millisecond}, e.component("a"), stuck, last); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "a's loop to end", func() bool { return e.has("end a") })
	check(t, &e, "start a", "stop a", "end a")
}

// A signal during a Start that then fails because of it is a stop: what
// started stops, nothing after starts, and Run returns nil.
func TestSignalDuringStart(t *testing.T) {
	var e events
	ctx, cancel := context.WithCancel(context.Background())
	waiting := Component{Name: "database", Start: func(ctx context.Context) error {
		cancel()
		<-ctx.Done()
		return ctx.Err()
	}}
	if err := Run(ctx, Config{}, e.component("a"), waiting, e.component("c")); err != nil {
		t.Fatalf("Run: %v, want nil after a signal", err)
	}
	check(t, &e, "start a", "stop a", "end a")
}

func TestNegativeTimeout(t *testing.T) {
	var e events
	if err := Run(context.Background(), Config{ShutdownTimeout: -time.Second}, e.component("a")); err == nil {
		t.Fatal("a negative shutdown timeout was accepted")
	}
	check(t, &e)
}
