package streams

import (
	"context"
	"errors"
	"fmt"

	"github.com/jackc/pgx/v5"

	retry "github.com/millrace/millrace/internal/backoff"
	"github.com/millrace/millrace/streams/projection"
)

// Replay rebuilds the projection from the start of the stream: it takes the
// lock (ErrLocked if the projector runs elsewhere), empties the projection
// and its position in one transaction, applies the stream up to the last
// message stored when Replay began, and sweeps once, as a live runner does
// when it goes idle. A live runner started afterwards carries on from there.
func (r *Runner) Replay(ctx context.Context) error {
	return r.ReplayWith(ctx, projection.ReplayPlan{})
}

// ReplayWith is Replay by plan: its Reset instead of the projector's, its
// Prelude applied first, its Skip left out of the stream.
func (r *Runner) ReplayWith(ctx context.Context, plan projection.ReplayPlan) error {
	return r.ReplayPlanned(ctx, StaticPlan(plan))
}

// Planner makes a replay's plan (ReplayPlanned).
type Planner func(context.Context) (projection.ReplayPlan, error)

// StaticPlan is the Planner of a plan made already.
func StaticPlan(plan projection.ReplayPlan) Planner {
	return func(context.Context) (projection.ReplayPlan, error) { return plan, nil }
}

// ReplayPlanned is ReplayWith with the plan made by planner once the
// replay holds the lock and has pointed the durable consumer at the
// stream's start. A plan reads what the stream and elsewhere (the raw
// archive) hold, and whatever deletes a stream's messages once every
// durable has read them (the archive's trimming) must delete nothing
// between the plan and the replay's reading of the stream: a build
// trimmed from the stream after the plan left it to the stream would be
// in neither. From the pointing on, the durable's ack floor holds it back.
func (r *Runner) ReplayPlanned(ctx context.Context, planner Planner) error {
	stream, err := r.js.Stream(ctx, r.cfg.Stream)
	if err != nil {
		return fmt.Errorf("stream %s: %w", r.cfg.Stream, err)
	}
	target := stream.CachedInfo().State.LastSeq
	h, err := r.lease.AcquirePG(ctx)
	if err != nil {
		return err
	}
	r.m.Active(true)
	defer r.loop.Release(h)
	ctx = h.Context()
	r.held, r.conn = h, h.Conn()
	if err := r.point(ctx, 0); err != nil {
		return err
	}
	plan, err := planner(ctx)
	if err != nil {
		return err
	}
	reset := plan.Reset
	if reset == nil {
		rs, ok := r.p.(projection.Resetter)
		if !ok {
			return fmt.Errorf("projector %s cannot be reset", r.name)
		}
		reset = rs.Reset
	}
	r.settle(false)
	err = r.inTx(ctx, func(tx pgx.Tx) error {
		if err := reset(ctx, tx); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "delete from consumer_positions where consumer = $1", r.name)
		return err
	})
	if err != nil {
		return fmt.Errorf("reset %s: %w", r.name, err)
	}
	r.position = 0
	if plan.Prelude != nil {
		if err := plan.Prelude(ctx, func(batch []projection.Message) error { return r.applyPrelude(ctx, h, batch) }); err != nil {
			return fmt.Errorf("replay %s: %w", r.name, err)
		}
	}
	r.skip = plan.Skip
	defer func() { r.skip = nil }()
	if err := r.point(ctx, 0); err != nil {
		return err
	}
	return r.replayTo(ctx, h, target)
}

// replayTo applies the stream up to target, then sweeps.
func (r *Runner) replayTo(ctx context.Context, h *PGHeld, target uint64) error {
	wait := retry.Backoff{Min: r.cfg.RetryMin, Max: r.cfg.RetryMax}
	for r.position < target {
		err := r.step(ctx)
		if err == nil && r.idle {
			// The last messages stored when the replay began may be gone
			// since (trimmed once archived, deleted on request): the
			// position then never reaches target. A fetch that found
			// nothing, with nothing pending for the consumer, is the end,
			// and the position moves to target over what is gone, as the
			// live runner's would have moved over it.
			var done bool
			if done, err = r.caughtUp(ctx); err == nil && done {
				if _, err = r.commit(ctx, nil, target); err == nil {
					break
				}
			}
		}
		if err == nil {
			wait.Reset()
			continue
		}
		if ctx.Err() != nil {
			return fmt.Errorf("replay %s: %w", r.name, context.Cause(ctx))
		}
		if ferr := h.Fence(ctx); ferr != nil {
			return fmt.Errorf("replay %s: lost the database: %w", r.name, errors.Join(err, ferr))
		}
		r.log.Warn("replay step failed; retrying", "err", err)
		wait.Wait(ctx)
	}
	return r.sweep(ctx)
}

// caughtUp reports whether the consumer has nothing left to deliver.
func (r *Runner) caughtUp(ctx context.Context) (bool, error) {
	info, err := r.cons.Info(ctx)
	if err != nil {
		return false, fmt.Errorf("consumer %s: %w", r.name, err)
	}
	return info.NumPending == 0 && info.NumAckPending == 0, nil
}

// applyPrelude commits one batch of a plan's prelude: transient failures
// are retried while the lock is held; poison is left out; any other data
// error has the batch applied one message at a time, each that fails on
// its own left out.
func (r *Runner) applyPrelude(ctx context.Context, h *PGHeld, batch []projection.Message) error {
	wait := retry.Backoff{Min: r.cfg.RetryMin, Max: r.cfg.RetryMax}
	for len(batch) > 0 {
		err := r.preludeTx(ctx, batch)
		if err == nil {
			r.applied += uint64(len(batch))
			r.m.Messages("applied", len(batch))
			if r.cfg.Progress != nil {
				r.cfg.Progress(Progress{Applied: r.applied, Position: batch[len(batch)-1].Seq()})
			}
			return nil
		}
		if pe, ok := projection.AsPoison(err); ok {
			var found bool
			if batch, found = removeMessage(batch, pe.Seq); !found {
				return fmt.Errorf("projector named message %d, which is not in the batch: %w", pe.Seq, err)
			}
			r.log.Warn("replay leaves out a message the projector refuses (it was dead-lettered when first applied)", "seq", pe.Seq, "err", pe.Reason)
			continue
		}
		if !Transient(err) {
			if len(batch) == 1 {
				r.log.Warn("replay leaves out a message the projector refuses (it was dead-lettered when first applied)", "seq", batch[0].Seq(), "err", err)
				return nil
			}
			for _, m := range batch {
				if err := r.applyPrelude(ctx, h, []projection.Message{m}); err != nil {
					return err
				}
			}
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		if ferr := h.Fence(ctx); ferr != nil {
			return fmt.Errorf("lost the database: %w", errors.Join(err, ferr))
		}
		r.m.Retry()
		r.log.Warn("replay batch failed; retrying", "messages", len(batch), "err", err)
		if !wait.Wait(ctx) {
			return ctx.Err()
		}
	}
	return nil
}

func (r *Runner) preludeTx(ctx context.Context, batch []projection.Message) error {
	err := r.inTx(ctx, func(tx pgx.Tx) error { return r.apply(ctx, tx, batch) })
	r.settle(err == nil)
	return err
}

func removeMessage(batch []projection.Message, seq uint64) ([]projection.Message, bool) {
	for i, m := range batch {
		if m.Seq() == seq {
			return append(append(make([]projection.Message, 0, len(batch)-1), batch[:i]...), batch[i+1:]...), true
		}
	}
	return batch, false
}
