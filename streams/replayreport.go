package streams

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"
)

// ReplayReported is ReplayPlanned as the replay commands run it, for an
// operator watching: the position on w at most once a second and at the
// end, on one line rewritten in place under label (unit names the
// stream's messages), then how long it took. ErrLocked becomes what the
// operator must do: stop the live projector first.
func (r *Runner) ReplayReported(ctx context.Context, plan Planner, w io.Writer, label, unit string) error {
	st, err := r.js.Stream(ctx, r.cfg.Stream)
	if err != nil {
		return fmt.Errorf("stream %s: %w", r.cfg.Stream, err)
	}
	total, start := st.CachedInfo().State.LastSeq, time.Now()
	r.cfg.Progress = progressLine(w, label, unit, total)
	err = r.ReplayPlanned(ctx, plan)
	if errors.Is(err, ErrLocked) {
		return runningError{r.name}
	}
	if err == nil {
		fmt.Fprintf(w, "\r%s: done, %d %s in %s\n", label, total, unit, time.Since(start).Round(time.Millisecond))
	}
	return err
}

// progressLine writes a replay's position and rate to w, at most once a
// second and at the end (total), on one line rewritten in place.
func progressLine(w io.Writer, label, unit string, total uint64) func(Progress) {
	start, last := time.Now(), time.Time{}
	return func(p Progress) {
		if time.Since(last) < time.Second && p.Position < total {
			return
		}
		last = time.Now()
		rate := float64(p.Applied) / max(time.Since(start).Seconds(), 0.001)
		fmt.Fprintf(w, "\r%s: %d/%d %s (%.0f/s)   ", label, p.Position, total, unit, rate)
	}
}

// runningError is ErrLocked as the operator of a replay reads it.
type runningError struct{ name string }

func (e runningError) Error() string {
	return fmt.Sprintf("the %s projector is running (it holds its lock): stop it, replay, then start it again", e.name)
}

func (e runningError) Unwrap() error { return ErrLocked }
