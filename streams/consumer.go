package streams

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	retry "github.com/millrace/millrace/internal/backoff"
	"github.com/millrace/millrace/streams/projection"
)

// The consumer core: how every consumer of a stream in millrace leads,
// attaches its durable consumer, retries, acks, counts and stops. Its
// users (Runner, Outbox, ExportRunner, and commitlog.FoldRunner) each say
// only where their position lives and what their ack means.
//
//	user                  kind        lease                             position lives in         ack
//	Runner                projection  PGLease millrace.consumer.<name>  consumer_positions        AckAll, after the commit
//	Outbox                outbox      PGLease millrace.outbox           the outbox rows left      (publishes; a row goes once stored)
//	ExportRunner          export      KVLease export.<durable>          its consumer's ack floor  AckAll, after the other system's, fenced
//	commitlog.FoldRunner  fold        KVLease fold.<durable>            the bucket's checkpoints  AckExplicit, once folded; checkpoints and deletions fenced

// Kind is what a consumer does with what it reads; it labels the
// consumer metrics and decides the ack policy.
type Kind string

// The kinds of consumer.
const (
	KindProjection Kind = "projection"
	KindExport     Kind = "export"
	KindOutbox     Kind = "outbox"
	KindFold       Kind = "fold"
)

// AckPolicy is the acknowledgement policy of each kind's durable consumer,
// stated here once. A projection and an export ack the last message of a
// prefix whose effects are durable (AckAll: one ack per batch). The fold
// acks each version once its world is folded (AckExplicit): it deletes
// folded versions that are delivered and unacknowledged, JetStream counts
// such a deletion as the message's ack, and under AckAll that would ack
// every message below it, other worlds' unfolded versions included. The
// outbox reads no stream.
func (k Kind) AckPolicy() jetstream.AckPolicy {
	if k == KindFold {
		return jetstream.AckExplicitPolicy
	}
	return jetstream.AckAllPolicy
}

// Position says where Attach points a durable consumer.
type Position struct {
	// Next is the first sequence to deliver (0 is 1).
	Next uint64
	// AfterFloor delivers from right after the consumer's own ack floor
	// instead, when that is later than Next: for the consumers whose
	// position is their ack floor (the export, the fold), which pass in
	// Next what they last knew of it, so that a consumer deleted under
	// them starts again there rather than at the stream's start.
	AfterFloor bool
}

// Attach points the durable consumer cfg.Durable of stream at a position,
// so that its next delivery is the first message at or after it and
// nothing it delivered before comes first. It returns the consumer and
// the sequence it delivers from. cfg's AckPolicy comes from kind, and its
// deliver policy is DeliverAll: where it starts is set by the reset, not
// the config.
//
// The strategy: create the durable when it is missing; otherwise update
// its mutable config; then reset it to the position
// (ResetConsumerToSequence, which drops what it had in flight at once)
// unless it sits there already (nothing pending, ack floor just below).
// It recreates the durable (delete, create, logged) only when an
// immutable field differs: another ack policy, a push consumer, or a start
// policy that refuses the reset (a consumer made by an older millrace with
// DeliverByStartSequence at a later sequence). Why not recreate it every
// time, as millrace did: the durable is never missing in normal operation,
// so its ack floor stays readable at every moment (the compactor reads
// export consumers' floors to hold deletions back) and a reader never
// finds it gone; the reset is one request; and it works for every user
// alike. TestResetConsumerToSequenceOnTheServer pins the server's
// behaviour this relies on, TestAttachResetsInPlace the strategy.
func Attach(ctx context.Context, js jetstream.JetStream, stream string, kind Kind, cfg jetstream.ConsumerConfig, at Position, log *slog.Logger) (jetstream.Consumer, uint64, error) {
	cfg.AckPolicy = kind.AckPolicy()
	cfg.DeliverPolicy, cfg.OptStartSeq, cfg.OptStartTime = jetstream.DeliverAllPolicy, 0, nil
	s, err := js.Stream(ctx, stream)
	if err != nil {
		return nil, 0, fmt.Errorf("the %s stream: %w", stream, err)
	}
	start := max(at.Next, 1)
	cons, err := s.Consumer(ctx, cfg.Durable)
	switch {
	case errors.Is(err, jetstream.ErrConsumerNotFound):
		if cons, err = s.CreateConsumer(ctx, cfg); err != nil {
			return nil, 0, fmt.Errorf("create consumer %s: %w", cfg.Durable, err)
		}
	case err != nil:
		return nil, 0, fmt.Errorf("look up consumer %s: %w", cfg.Durable, err)
	default:
		ci := cons.CachedInfo()
		if at.AfterFloor {
			start = max(start, ci.AckFloor.Stream+1)
		}
		if cons, err = reconfigure(ctx, s, ci.Config, cfg, start, log); err != nil {
			return nil, 0, err
		}
	}
	if err := place(ctx, s, cons, start); err != nil {
		return nil, 0, err
	}
	return cons, start, nil
}

// reconfigure updates the consumer whose config is have to want, or
// recreates it when an immutable field forbids that or the reset to start.
func reconfigure(ctx context.Context, s jetstream.Stream, have, want jetstream.ConsumerConfig, start uint64, log *slog.Logger) (jetstream.Consumer, error) {
	if why := mustRecreate(have, want, start); why != "" {
		log.Warn("recreating the durable consumer", "consumer", want.Durable, "stream", s.CachedInfo().Config.Name, "reason", why, "from", start)
		if err := s.DeleteConsumer(ctx, want.Durable); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
			return nil, fmt.Errorf("delete consumer %s: %w", want.Durable, err)
		}
		cons, err := s.CreateConsumer(ctx, want)
		if err != nil {
			return nil, fmt.Errorf("create consumer %s: %w", want.Durable, err)
		}
		return cons, nil
	}
	// Kept: where it started cannot change, the rest can.
	want.DeliverPolicy, want.OptStartSeq, want.OptStartTime = have.DeliverPolicy, have.OptStartSeq, have.OptStartTime
	cons, err := s.UpdateConsumer(ctx, want)
	if err != nil {
		return nil, fmt.Errorf("update consumer %s: %w", want.Durable, err)
	}
	return cons, nil
}

// mustRecreate says which immutable field of have keeps it from being
// updated to want and reset to start ("" when none does).
func mustRecreate(have, want jetstream.ConsumerConfig, start uint64) string {
	switch {
	case have.AckPolicy != want.AckPolicy:
		return fmt.Sprintf("ack policy %s, want %s", have.AckPolicy, want.AckPolicy)
	case have.DeliverSubject != "":
		return "a push consumer, want a pull consumer"
	case have.ReplayPolicy != want.ReplayPolicy:
		return fmt.Sprintf("replay policy %s, want %s", have.ReplayPolicy, want.ReplayPolicy)
	case have.DeliverPolicy == jetstream.DeliverAllPolicy:
		return ""
	case have.DeliverPolicy == jetstream.DeliverByStartSequencePolicy && have.OptStartSeq <= start:
		return ""
	}
	return fmt.Sprintf("made to start by %s (sequence %d), which forbids a reset to %d", have.DeliverPolicy, have.OptStartSeq, start)
}

// place resets cons to deliver from start unless it is there already.
func place(ctx context.Context, s jetstream.Stream, cons jetstream.Consumer, start uint64) error {
	ci := cons.CachedInfo()
	if ci.NumAckPending == 0 && ci.AckFloor.Stream+1 == start {
		return nil
	}
	if _, err := s.ResetConsumerToSequence(ctx, ci.Name, start); err != nil {
		return fmt.Errorf("reset consumer %s to %d: %w", ci.Name, start, err)
	}
	return nil
}

// Session is what a consumer does while it leads.
type Session struct {
	// Begin runs once the lease is taken: read the position, attach the
	// durable consumer. An error gives the lease up.
	Begin func(ctx context.Context, h Held) error
	// Step does one unit of work: a batch, a relay, an export session. A
	// step that fails is retried in place after a backoff while the lease
	// holds (Fence); one whose error wraps ErrLeaseLost, or after which
	// Fence fails, ends the lead. A step ends when ctx does, having handed
	// back what it held.
	Step func(ctx context.Context) error
	// Retrying is the line logged when a step fails and is retried.
	// Default "consumer step failed; retrying".
	Retrying string
}

// DefaultStandbyEvery is how often a consumer on standby tries to lead.
const DefaultStandbyEvery = 2 * time.Second

// ReleaseTimeout bounds giving a lease up on shutdown or loss: one
// deadline, whatever the lease.
const ReleaseTimeout = 5 * time.Second

// Loop runs one consumer: take the lease (standing by while another
// process holds it), run Session until the lease is lost or ctx ends,
// release it under ReleaseTimeout, and lead again.
type Loop struct {
	Name  string
	Kind  Kind
	Lease Lease
	// Retry is the backoff after a failed step or a lost lead.
	Retry retry.Backoff
	// StandbyEvery is how often a standby tries to take the lease.
	// Default DefaultStandbyEvery.
	StandbyEvery time.Duration
	Metrics      ConsumerMetrics
	Logger       *slog.Logger
}

// Run leads and serves until ctx ends.
func (l *Loop) Run(ctx context.Context, s Session) {
	for ctx.Err() == nil {
		h := l.Lead(ctx)
		if h == nil {
			return
		}
		err := l.serve(h, s)
		l.Release(h)
		if ctx.Err() != nil {
			return
		}
		d := l.Retry.Next()
		l.log().Warn("gave up the lead; leading again", "err", err, "retry_in", d)
		if !retry.Sleep(ctx, d) {
			return
		}
	}
}

func (l *Loop) log() *slog.Logger {
	if l.Logger == nil {
		return slog.Default()
	}
	return l.Logger
}

// Lead takes the lease, trying every StandbyEvery while another process
// holds it (one log line, millrace_consumer_active 0); nil when ctx ends.
func (l *Loop) Lead(ctx context.Context) Held {
	every := l.StandbyEvery
	if every <= 0 {
		every = DefaultStandbyEvery
	}
	standby := false
	for {
		h, err := l.Lease.Acquire(ctx)
		if err == nil {
			l.Metrics.Active(true)
			return h
		}
		if ctx.Err() != nil {
			return nil
		}
		l.Metrics.Active(false)
		switch {
		case !errors.Is(err, ErrLocked):
			l.log().Warn("cannot take the lead; retrying", "err", err, "retry_in", every)
		case !standby:
			l.log().Info("another process leads this consumer; standing by", "retry_in", every)
		}
		standby = true
		if !retry.Sleep(ctx, every) {
			return nil
		}
	}
}

// serve runs the session on h until the lease is lost or its context
// ends, and returns why.
func (l *Loop) serve(h Held, s Session) error {
	ctx := projection.WithFence(h.Context(), h.Fence)
	if s.Begin != nil {
		if err := s.Begin(ctx, h); err != nil {
			return err
		}
	}
	retrying := s.Retrying
	if retrying == "" {
		retrying = "consumer step failed; retrying"
	}
	ceiling := l.Retry.Max
	if ceiling <= 0 {
		ceiling = retry.DefaultMax
	}
	for {
		began := time.Now()
		err := s.Step(ctx)
		if ctx.Err() != nil {
			return context.Cause(ctx)
		}
		if err == nil {
			l.Retry.Reset()
			continue
		}
		if errors.Is(err, ErrLeaseLost) {
			return err
		}
		if ferr := h.Fence(ctx); ferr != nil {
			return errors.Join(err, ferr)
		}
		l.Metrics.Retry()
		if time.Since(began) > 2*ceiling {
			l.Retry.Reset() // it ran for a while: a new failure, not the same one again
		}
		d := l.Retry.Next()
		l.log().Warn(retrying, "err", err, "retry_in", d)
		if !retry.Sleep(ctx, d) {
			return context.Cause(ctx)
		}
	}
}

// Release gives the lease up under ReleaseTimeout.
func (l *Loop) Release(h Held) {
	releaseHeld(h)
	l.Metrics.Active(false)
}

// releaseHeld is the one way a lease is given up: under ReleaseTimeout,
// after the holder's steps ended (having handed back what they held).
func releaseHeld(h Held) {
	ctx, cancel := context.WithTimeout(context.Background(), ReleaseTimeout)
	defer cancel()
	h.Release(ctx)
}
