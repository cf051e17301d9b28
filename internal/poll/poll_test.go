package poll

import (
	"fmt"
	"testing"
	"time"
)

// recorder stands in for a test that Until fails: it keeps the message
// instead of ending the goroutine.
type recorder struct {
	testing.TB
	failed string
}

func (r *recorder) Fatalf(format string, args ...any) { r.failed = fmt.Sprintf(format, args...) }

func TestUntilReturnsOnceTheConditionHolds(t *testing.T) {
	calls := 0
	r := &recorder{TB: t}
	Until(r, "the third call", func() bool { calls++; return calls == 3 })
	if r.failed != "" || calls != 3 {
		t.Fatalf("failed %q after %d calls", r.failed, calls)
	}
}

func TestUntilNamesWhatAndHowLong(t *testing.T) {
	r := &recorder{TB: t}
	start := time.Now()
	Until(r, "the moon", func() bool { return false }, Within(50*time.Millisecond))
	if took := time.Since(start); took < 50*time.Millisecond || took > 10*time.Second {
		t.Errorf("gave up after %s, want just past 50ms", took)
	}
	if want := "timed out after 50ms waiting for the moon"; r.failed != want {
		t.Errorf("message %q, want %q", r.failed, want)
	}
}

func TestZeroOrNegativeIsTheDefault(t *testing.T) {
	for _, opts := range [][]Option{nil, {Within(0), Every(0)}, {Within(-time.Second), Every(-time.Second)}} {
		if c := settings(opts); c.within != DefaultWithin || c.every != DefaultEvery {
			t.Errorf("%d options: %+v", len(opts), c)
		}
	}
}

// The interval is the pause between checks: with one longer than the
// deadline, cond is checked once before the pause and once after.
func TestEvery(t *testing.T) {
	calls := 0
	if True(func() bool { calls++; return false }, Within(20*time.Millisecond), Every(100*time.Millisecond)) {
		t.Fatal("True reported a condition that never held")
	}
	if calls != 2 {
		t.Fatalf("%d checks, want 2", calls)
	}
}

func TestTrue(t *testing.T) {
	done := time.Now().Add(30 * time.Millisecond)
	if !True(func() bool { return time.Now().After(done) }) {
		t.Fatal("True missed a condition that came")
	}
}

func TestNoErrorEndsWithTheLastError(t *testing.T) {
	r := &recorder{TB: t}
	calls := 0
	NoError(r, "the count", func() error { calls++; return fmt.Errorf("count %d", calls) }, Within(20*time.Millisecond), Every(100*time.Millisecond))
	if want := "timed out after 20ms waiting for the count: count 2"; r.failed != want {
		t.Errorf("message %q, want %q", r.failed, want)
	}
	r.failed = ""
	NoError(r, "the fifth call", func() error {
		if calls++; calls < 5 {
			return fmt.Errorf("call %d", calls)
		}
		return nil
	})
	if r.failed != "" || calls != 5 {
		t.Errorf("failed %q after %d calls", r.failed, calls)
	}
}
