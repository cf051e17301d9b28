package streams_test

import (
	"bytes"
	"context"
	"errors"
	"regexp"
	"strings"
	"testing"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
)

// A reported replay says where it is on one line rewritten in place and
// how it ended; beside a running projector it tells the operator to stop
// it first.
func TestReplayReported(t *testing.T) {
	e := setup(t)
	e.publish(t, bodies(120, "r")...)
	stop := start(t, e, &rowsProjector{name: "rows"}, runnerConfig())
	poll.Until(t, "120 rows", func() bool { return len(e.rows(t, "rows")) == 120 }, waitWithin)
	var out bytes.Buffer
	err := newRunner(t, e.js, e.pool, &rowsProjector{name: "rows"}, runnerConfig(), nil).ReplayReported(context.Background(), streams.StaticPlan(projection.ReplayPlan{}), &out, "replay rows", "events")
	if err == nil || err.Error() != "the rows projector is running (it holds its lock): stop it, replay, then start it again" || !errors.Is(err, streams.ErrLocked) {
		t.Fatalf("beside a running projector: %v", err)
	}
	stop()
	out.Reset()
	if err := newRunner(t, e.js, e.pool, &rowsProjector{name: "rows"}, runnerConfig(), nil).ReplayReported(context.Background(), streams.StaticPlan(projection.ReplayPlan{}), &out, "replay rows", "events"); err != nil {
		t.Fatal(err)
	}
	if got := e.rows(t, "rows"); len(got) != 120 {
		t.Fatalf("after the replay: %d rows", len(got))
	}
	// The last batch is reported whatever the second since the previous
	// one; then the end, on the same line.
	lines := strings.Split(out.String(), "\r")
	end := regexp.MustCompile(`^replay rows: done, 120 events in [0-9.]+m?s\n$`)
	if len(lines) < 3 || lines[0] != "" || !end.MatchString(lines[len(lines)-1]) ||
		!regexp.MustCompile(`^replay rows: 120/120 events \([0-9]+/s\)   $`).MatchString(lines[len(lines)-2]) {
		t.Fatalf("reported %q", out.String())
	}
}
