// Package projection is the contract between the consumer runner in package
// streams and the projectors. It imports neither NATS nor any projector, so a
// projector can depend on it and stay a plain package that is tested against
// PostgreSQL alone.
//
// The runner fetches a batch, opens a transaction, calls Apply, records the
// consumer position in the same transaction, commits and only then acks. A
// projector therefore never sees a message twice in effect: messages at or
// below the recorded position are filtered out before Apply is called.
package projection

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Message is what a projector may read of one stored stream message.
type Message interface {
	Subject() string
	Data() []byte
	// Header returns the first value of a message header, or "".
	Header(key string) string
	// Seq is the message's stream sequence; it is unique and increasing.
	Seq() uint64
	// Time is when JetStream stored the message.
	Time() time.Time
}

// Projector applies batches of messages to PostgreSQL. Apply must do all of
// its work through tx and must not keep state across calls that is not in the
// database: the runner may roll a batch back and retry it, or hand it to
// another process.
type Projector interface {
	// Name is the durable consumer name and the key of the recorded position.
	Name() string
	Apply(ctx context.Context, tx pgx.Tx, batch []Message) error
}

// Sweeper is implemented by projectors that also act on the passage of time
// (for example, marking builds abandoned). The runner calls Sweep in its own
// transaction once it has caught up with the stream (never while it is
// behind: its tables would be stale); now is the wall clock.
type Sweeper interface {
	Sweep(ctx context.Context, tx pgx.Tx, now time.Time) error
}

// Idler is implemented by a Sweeper whose sweeps may have nothing to do
// for long stretches, and which sweeps often when they do (the placer,
// every second, with no reservation waiting and no allocation held). Idle
// says that the last sweep that committed found nothing the passage of
// time could change, and that nothing applied since changed that: the
// runner then sweeps every RunnerConfig.IdleSweepEvery instead of
// SweepEvery, until a batch is applied. A projector answers from what its
// committed transactions left (see Committer), false when it does not
// know.
type Idler interface {
	Idle() bool
}

// PoisonError marks one message that can never be applied (it does not
// decode, or it breaks an invariant). The runner parks it in the dead-letter
// subject with Reason and applies the rest of the batch without it.
type PoisonError struct {
	Seq    uint64
	Reason error
}

func (e *PoisonError) Error() string {
	return fmt.Sprintf("message %d cannot be applied: %v", e.Seq, e.Reason)
}

func (e *PoisonError) Unwrap() error { return e.Reason }

// Poison wraps reason as the PoisonError of message m.
func Poison(m Message, reason error) error {
	return &PoisonError{Seq: m.Seq(), Reason: reason}
}

// AsPoison reports whether err marks a poison message.
func AsPoison(err error) (*PoisonError, bool) {
	var pe *PoisonError
	ok := errors.As(err, &pe)
	return pe, ok
}

// Resetter is implemented by projectors that can be rebuilt by replay:
// Reset empties the projection's tables inside tx (the runner clears the
// position in the same transaction).
type Resetter interface {
	Reset(ctx context.Context, tx pgx.Tx) error
}

// Committer is implemented by projectors that keep a cache of what their
// tables hold (the placer's index of free GPUs). The runner calls Committed
// after a transaction in which it called Apply or Sweep commits, and
// Aborted after one rolls back and whenever it starts to lead (another
// process may have written meanwhile): the projector then forgets what the
// cache learnt since the last commit, or reloads it.
type Committer interface {
	Committed()
	Aborted()
}

// ReplayPlan is how a replay rebuilds a projection whose history is not
// all in the stream any more (the builds projection: its older builds
// live in the archive, and the stream keeps the recent tail). The zero
// plan is a replay of the stream alone.
type ReplayPlan struct {
	// Reset empties what the replay rebuilds, in the transaction that also
	// clears the position. Nil: the projector's Reset (Resetter).
	Reset func(ctx context.Context, tx pgx.Tx) error
	// Prelude, when set, hands the replay the messages kept outside the
	// stream, in batches and in the order they are to be applied, before
	// any message of the stream; apply commits one batch in a transaction
	// of its own (the position does not move: these messages are not the
	// stream's to count). A message the projector names as poison is
	// skipped with a warning: it was dead-lettered when it was first
	// applied, and is not parked a second time.
	Prelude func(ctx context.Context, apply func([]Message) error) error
	// Skip, when set, names stream messages the replay does not apply:
	// the prelude held them, or the rows they would change are kept.
	Skip func(Message) bool
}
