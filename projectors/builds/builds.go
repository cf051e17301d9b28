package builds

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
)

// ConsumerName is the projector's durable consumer name and position key.
const ConsumerName = "builds"

// DefaultAbandonAfter is Config.AbandonAfter's default.
const DefaultAbandonAfter = 30 * time.Minute

// Config configures the builds projector. A zero field takes its default;
// a negative one is refused by New.
type Config struct {
	// AbandonAfter is how long a running invocation may go without any
	// event before Sweep marks it abandoned. Zero means DefaultAbandonAfter.
	AbandonAfter time.Duration
}

// RegisterFlags registers the flag that sets c, with its variable. The
// consumer's knobs (--builds-batch, ...) belong to the runner that feeds the
// projector, not to c.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	envflag.Duration(fs, &c.AbandonAfter, "builds-abandon-after", "MILLRACE_BUILDS_ABANDON_AFTER", DefaultAbandonAfter, "a running build with no event for this long is marked abandoned")
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	return knob.NotNegative("builds", "AbandonAfter", c.AbandonAfter, DefaultAbandonAfter)
}

func (c Config) withDefaults() Config {
	if c.AbandonAfter == 0 {
		c.AbandonAfter = DefaultAbandonAfter
	}
	return c
}

// Projector projects the BES stream into the builds tables. Between calls
// it keeps only a cache of what its last batches wrote (cache), used when
// the runner says which transactions committed (projection.Committer).
// Its methods may be called from several goroutines, but a caller that
// settles transactions (Committed, Aborted) must not overlap them.
type Projector struct {
	cfg   Config
	cache cache
}

var (
	_ projection.Projector = (*Projector)(nil)
	_ projection.Sweeper   = (*Projector)(nil)
	_ projection.Committer = (*Projector)(nil)
)

// New returns a projector with cfg's defaults applied, or what is wrong
// with cfg.
func New(cfg Config) (*Projector, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	return &Projector{cfg: cfg.withDefaults()}, nil
}

// Name is the durable consumer name.
func (p *Projector) Name() string { return ConsumerName }

// DefaultProject is the project of a message whose Millrace-Project header
// is empty. The BES edge always names one (its own default for clients
// that send none is also "default", services/bes Config.DefaultProject), so
// only messages written by other tools take it.
const DefaultProject = "default"

// event is one decoded stream message.
type event struct {
	body
	inv     string    // invocation id
	project string    // Millrace-Project, else DefaultProject
	at      time.Time // JetStream storage time (or the event's own time)
	seq     uint64    // the message's stream sequence
}

// key is the build the event belongs to.
func (e *event) key() invKey { return invKey{e.project, e.inv} }

// Apply projects a batch. A message that cannot be decoded makes Apply
// return its *projection.PoisonError before anything is written.
func (p *Projector) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	evs := make([]event, 0, len(batch))
	for _, m := range batch {
		ev, keep, err := decodeMessage(m)
		if err != nil {
			return projection.Poison(m, err)
		}
		if keep {
			evs = append(evs, ev)
		}
	}
	if len(evs) == 0 {
		return nil
	}
	s := newState()
	for i := range evs {
		s.add(&evs[i])
	}
	s.recall(p.cache.begin())
	if err := s.load(ctx, tx); err != nil {
		return err
	}
	for i := range evs {
		s.apply(&evs[i])
	}
	p.cache.wrote()
	return s.write(ctx, tx)
}

// errNoInvocation marks an invocation-level event without an invocation id.
var errNoInvocation = errors.New("event has no invocation id")

// decodeMessage decodes headers and body. keep is false for messages that
// are valid but not part of the projection (build-level lifecycle events).
func decodeMessage(m projection.Message) (ev event, keep bool, err error) {
	if s := m.Header(envelope.Schema); s != envelope.SchemaBESv1 {
		return ev, false, fmt.Errorf("unknown schema %q in header %s (want %q)", s, envelope.Schema, envelope.SchemaBESv1)
	}
	kind := m.Header(envelope.Kind)
	if kind != envelope.KindTool && kind != envelope.KindLifecycle {
		return ev, false, fmt.Errorf("unknown kind %q in header %s", kind, envelope.Kind)
	}
	ev.body, err = decodeBody(m.Data())
	if err != nil {
		return ev, false, err
	}
	if kind == envelope.KindTool {
		if ev.kind == kindIgnore || ev.kind == kindAttemptStarted || ev.kind == kindAttemptFinished {
			if ev.kind != kindIgnore {
				return ev, false, errors.New("tool message holds a lifecycle event")
			}
			ev.kind = kindOtherTool // e.g. console_output: still a numbered tool event
		}
		if ev.sequence <= 0 {
			return ev, false, fmt.Errorf("tool event has sequence number %d", ev.sequence)
		}
	} else {
		if ev.kind.tool() {
			return ev, false, errors.New("lifecycle message holds a tool event")
		}
		if ev.kind == kindIgnore {
			return ev, false, nil // build enqueued / build finished: build-level
		}
	}
	ev.inv = clean(m.Header(envelope.InvocationID))
	switch {
	case ev.inv == "":
		ev.inv = ev.invocationID
	case ev.invocationID != "" && ev.invocationID != ev.inv:
		return ev, false, fmt.Errorf("header %s %q differs from the event's invocation id %q",
			envelope.InvocationID, ev.inv, ev.invocationID)
	}
	if ev.inv == "" {
		return ev, false, errNoInvocation
	}
	ev.project = clean(m.Header(envelope.Project))
	if ev.project == "" {
		ev.project = DefaultProject
	}
	if b := clean(m.Header(envelope.BuildID)); b != "" {
		ev.buildID = b
	}
	ev.seq = m.Seq()
	ev.at = validTime(m.Time())
	if ev.at.IsZero() {
		ev.at = ev.eventTime
	}
	if ev.at.IsZero() {
		ev.at = time.Unix(0, 0).UTC()
	}
	return ev, true, nil
}

// Sweep marks running invocations without events for AbandonAfter as
// abandoned (finished at their last event), folds their output and that of
// other idle finished invocations into the canonical rows, and counts them
// in the rollups. now is the wall clock; the rows it writes depend only on
// the events (and on which invocations it abandons).
func (p *Projector) Sweep(ctx context.Context, tx pgx.Tx, now time.Time) error {
	cutoff := now.Add(-p.cfg.AbandonAfter)
	if _, err := tx.Exec(ctx, sqlKeyedPlans); err != nil {
		return fmt.Errorf("builds: sweep: %w", err)
	}
	rows, err := tx.Query(ctx, sqlAbandon, cutoff)
	if err != nil {
		return fmt.Errorf("builds: sweep: %w", err)
	}
	var (
		abandoned []invKey
		keys      []int64
		k         invKey
		key       int64
	)
	_, err = pgx.ForEachRow(rows, []any{&k.project, &k.id, &key}, func() error {
		abandoned, keys = append(abandoned, k), append(keys, key)
		return nil
	})
	if err != nil {
		return fmt.Errorf("builds: sweep: %w", err)
	}
	// Abandoned, they are finished: their rows leave the running tables.
	if err := finishRunning(ctx, tx, keys); err != nil {
		return fmt.Errorf("builds: sweep: %w", err)
	}
	// Of what the cache holds, the sweep changes only the status of the
	// invocations it abandons: the next batch that names them reads them.
	p.cache.dropAll(abandoned)
	rows, err = tx.Query(ctx, sqlIdleOutput, cutoff)
	if err != nil {
		return fmt.Errorf("builds: sweep output: %w", err)
	}
	idle, err := pgx.CollectRows(rows, scanKey)
	if err != nil {
		return fmt.Errorf("builds: sweep output: %w", err)
	}
	if len(idle) > 0 {
		fin := make(map[invKey]*inv, len(idle))
		for _, k := range idle {
			fin[k] = &inv{key: k, stored: true}
		}
		b := &pgx.Batch{}
		if err := fold(ctx, tx, b, fin, idle); err != nil {
			return err
		}
		if err := tx.SendBatch(ctx, b).Close(); err != nil {
			return fmt.Errorf("builds: sweep output: %w", err)
		}
	}
	if len(abandoned) > 0 {
		if err := reconcile(ctx, tx, abandoned); err != nil {
			return fmt.Errorf("builds: sweep rollups: %w", err)
		}
	}
	return nil
}

// scanKey reads a (project, invocation id) row.
func scanKey(row pgx.CollectableRow) (invKey, error) {
	var k invKey
	err := row.Scan(&k.project, &k.id)
	return k, err
}
