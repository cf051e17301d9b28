package builds

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
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
	// layout and part: the one partition of build events this projector
	// applies (ForPartition); every build when layout is not partitioned.
	layout subjects.BESLayout
	part   int
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

// Name is the durable consumer name: ConsumerName, or its partition's
// (ForPartition).
func (p *Projector) Name() string { return p.layout.Durable(ConsumerName, p.part) }

// ForPartition is a projector of partition part of layout's build events
// alone, for the runner of that partition (several instances of the
// builds projector share the partitions: streams.Group). The rows of a
// build are its partition's alone, and its runner applies them; what a
// projector does beyond its batch keeps to its partition too: its sweep
// abandons and folds only its own builds (another partition's runner
// holds those in its cache), and its reset (a replay of the partition)
// empties only its own. The rollups and test history that builds of
// several partitions share are kept as differences per build, so each
// partition adds and takes away only what its builds count.
func (p *Projector) ForPartition(layout subjects.BESLayout, part int) *Projector {
	return &Projector{cfg: p.cfg, layout: layout, part: part}
}

// owns reports whether the build is this projector's to sweep and reset.
func (p *Projector) owns(k invKey) bool {
	return !p.layout.Partitioned() || p.layout.Partition(k.project, k.id) == p.part
}

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
	s.layout, s.part = p.layout, p.part
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
	abandoned, keys, err := p.abandon(ctx, tx, cutoff)
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
	rows, err := tx.Query(ctx, sqlIdleOutput, cutoff)
	if err != nil {
		return fmt.Errorf("builds: sweep output: %w", err)
	}
	idle, err := pgx.CollectRows(rows, scanKey)
	if err != nil {
		return fmt.Errorf("builds: sweep output: %w", err)
	}
	idle = slices.DeleteFunc(idle, func(k invKey) bool { return !p.owns(k) })
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

// abandon marks the running invocations without an event since cutoff
// abandoned, and returns them with their build keys. A partition's
// projector first reads which they are and takes its own (the partition
// is a hash the database does not compute).
func (p *Projector) abandon(ctx context.Context, tx pgx.Tx, cutoff time.Time) ([]invKey, []int64, error) {
	var (
		abandoned []invKey
		keys      []int64
		k         invKey
		key       int64
	)
	collect := func(rows pgx.Rows, err error) ([]invKey, []int64, error) {
		if err != nil {
			return nil, nil, err
		}
		_, err = pgx.ForEachRow(rows, []any{&k.project, &k.id, &key}, func() error {
			abandoned, keys = append(abandoned, k), append(keys, key)
			return nil
		})
		return abandoned, keys, err
	}
	if !p.layout.Partitioned() {
		return collect(tx.Query(ctx, sqlAbandon, cutoff))
	}
	rows, err := tx.Query(ctx, sqlAbandonCandidates, cutoff)
	if err != nil {
		return nil, nil, err
	}
	var mine []int64
	_, err = pgx.ForEachRow(rows, []any{&k.project, &k.id, &key}, func() error {
		if p.owns(k) {
			mine = append(mine, key)
		}
		return nil
	})
	if err != nil || len(mine) == 0 {
		return nil, nil, err
	}
	return collect(tx.Query(ctx, sqlAbandonThese, mine))
}

// scanKey reads a (project, invocation id) row.
func scanKey(row pgx.CollectableRow) (invKey, error) {
	var k invKey
	err := row.Scan(&k.project, &k.id)
	return k, err
}
