package fleet

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/streams/projection"
)

// ConsumerName is the projector's durable consumer name and position key.
const ConsumerName = "fleet"

// Defaults of Config.
const (
	// DefaultSuspectAfter: a node heartbeats every 10 s and its gateway
	// flushes liveness every 5 s, so a healthy node's recorded age reaches
	// about 15 s plus the projection's lag; 25 s is that plus one late
	// heartbeat.
	DefaultSuspectAfter = 25 * time.Second
	// DefaultUnreachableAfter: long enough for a node whose gateway died to
	// notice, back off and re-home through another gateway (the protocol
	// allows a few seconds of jittered retry_after), short enough that a
	// dead node's GPUs are freed within about a minute.
	DefaultUnreachableAfter = 60 * time.Second
	// DefaultClockSlack: three gateway flush intervals. Liveness batches
	// arrive every 5 s from each gateway; when none has arrived for 15 s,
	// the control plane, not the nodes, is what went quiet.
	DefaultClockSlack = 15 * time.Second
	// DefaultSweepTick: one gateway flush interval, a small fraction of
	// the thresholds.
	DefaultSweepTick = 5 * time.Second
)

// Config configures the fleet projector. A zero field takes its default; a
// negative one is refused by New.
// Durations are cut to whole microseconds (PostgreSQL's resolution).
type Config struct {
	// SuspectAfter is how long a node may go unheard before it is suspect:
	// visibly late: the placer places nothing new on it, and what it holds stays. Zero means DefaultSuspectAfter.
	SuspectAfter time.Duration
	// UnreachableAfter is how long a node may go unheard before it is
	// unreachable: the placer stops placing on it and releases what it
	// holds. It must exceed SuspectAfter. Zero means
	// DefaultUnreachableAfter.
	UnreachableAfter time.Duration
	// ClockSlack bounds how far the sweep may age nodes past the stored
	// time of the newest liveness batch; a longer silence of the whole
	// stream counts as an outage of the control plane (README.md: the
	// clock guard). Zero means DefaultClockSlack.
	ClockSlack time.Duration
	// SweepTick: Apply itself ages every node, as of the stream's clock,
	// each time the newest liveness batch's stored time crosses a multiple
	// of SweepTick (README.md: sweeping on stream time). Zero means
	// DefaultSweepTick.
	SweepTick time.Duration
	// Logger receives a debug line per batch that ignored events, and one
	// per sweep that changed states. Nil means slog.Default().
	Logger *slog.Logger
	// ForeignReports, when set, counts allocation reports from a node
	// other than the one the allocation is placed on (Stats.ForeignReports;
	// NewForeignReportsCounter makes the Prometheus counter). Such a report
	// is stored under its reporter and changes no allocation.
	ForeignReports prometheus.Counter
}

// NewForeignReportsCounter registers (with reg, unless nil) the counter of
// Config.ForeignReports, millrace_fleet_projector_foreign_reports_total.
func NewForeignReportsCounter(reg prometheus.Registerer) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{
		Name: "millrace_fleet_projector_foreign_reports_total",
		Help: "Allocation reports (bound, unbound, failed) from a node other than the one the allocation is placed on: stored under the reporter, they change no allocation.",
	})
	if reg != nil {
		reg.MustRegister(c)
	}
	return c
}

// Validate reports a configuration that cannot work: thresholds must
// satisfy UnreachableAfter > SuspectAfter > 0 (after defaults), the sweep
// tick must be positive and no duration negative.
func (c Config) Validate() error {
	if err := errors.Join(
		knob.NotNegative("fleet", "SuspectAfter", c.SuspectAfter, DefaultSuspectAfter),
		knob.NotNegative("fleet", "UnreachableAfter", c.UnreachableAfter, DefaultUnreachableAfter),
		knob.NotNegative("fleet", "ClockSlack", c.ClockSlack, DefaultClockSlack),
		knob.NotNegative("fleet", "SweepTick", c.SweepTick, DefaultSweepTick),
	); err != nil {
		return err
	}
	d := c.withDefaults()
	if d.SuspectAfter <= 0 {
		return fmt.Errorf("fleet: SuspectAfter %v is below a microsecond", c.SuspectAfter)
	}
	if d.SweepTick <= 0 {
		return fmt.Errorf("fleet: SweepTick %v is below a microsecond", c.SweepTick)
	}
	if d.UnreachableAfter <= d.SuspectAfter {
		return fmt.Errorf("fleet: UnreachableAfter %v must exceed SuspectAfter %v", d.UnreachableAfter, d.SuspectAfter)
	}
	return nil
}

// RegisterFlags registers the flags of the liveness thresholds on fs, each
// with its MILLRACE_FLEET_* variable, so that every process that runs the
// projector (or replays it) offers the same knobs. The other fields are
// set in code.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	envflag.Duration(fs, &c.SuspectAfter, "fleet-suspect-after", "MILLRACE_FLEET_SUSPECT_AFTER", DefaultSuspectAfter, "a node unheard for this long is suspect: nothing new is placed on it, what it holds stays")
	envflag.Duration(fs, &c.UnreachableAfter, "fleet-unreachable-after", "MILLRACE_FLEET_UNREACHABLE_AFTER", DefaultUnreachableAfter, "a node unheard for this long is unreachable: nothing is placed on it and its reservations are placed elsewhere")
	envflag.Duration(fs, &c.ClockSlack, "fleet-clock-slack", "MILLRACE_FLEET_CLOCK_SLACK", DefaultClockSlack, "how far past the newest liveness batch nodes may age (a silent control plane marks nothing)")
}

func (c Config) withDefaults() Config {
	if c.SuspectAfter == 0 {
		c.SuspectAfter = DefaultSuspectAfter
	}
	if c.UnreachableAfter == 0 {
		c.UnreachableAfter = DefaultUnreachableAfter
	}
	if c.ClockSlack == 0 {
		c.ClockSlack = DefaultClockSlack
	}
	if c.SweepTick == 0 {
		c.SweepTick = DefaultSweepTick
	}
	c.SuspectAfter = c.SuspectAfter.Truncate(time.Microsecond)
	c.UnreachableAfter = c.UnreachableAfter.Truncate(time.Microsecond)
	c.ClockSlack = c.ClockSlack.Truncate(time.Microsecond)
	c.SweepTick = c.SweepTick.Truncate(time.Microsecond)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Projector projects FLEET_NODES into the node-side fleet tables. It holds
// no state between calls; it is safe for concurrent use, though the runner
// lets one process apply at a time, which the rev ordering relies on.
type Projector struct {
	cfg Config
	log *slog.Logger
	// idle: the last call was a sweep that found no liveness clock
	// (projection.Idler).
	idle bool
}

var (
	_ projection.Projector = (*Projector)(nil)
	_ projection.Sweeper   = (*Projector)(nil)
	_ projection.Resetter  = (*Projector)(nil)
	_ projection.Idler     = (*Projector)(nil)
	_ projection.Committer = (*Projector)(nil)
)

// Idle says the last call was a sweep that found no liveness batch ever
// projected (no fleet_clock row): no node has been heard of, and until a
// batch is applied the passage of time changes nothing, so the runner
// sweeps seldom (projection.Idler) rather than every few seconds. Only
// this projector writes the clock, and only in Apply.
func (p *Projector) Idle() bool { return p.idle }

// Committed implements projection.Committer: Idle holds what the
// committed call found.
func (p *Projector) Committed() {}

// Aborted implements projection.Committer: a lead that begins (another
// process may have applied batches meanwhile) or a transaction that did
// not commit leaves Idle unknown, so false.
func (p *Projector) Aborted() { p.idle = false }

// New returns a projector with cfg's defaults applied, or what is wrong
// with cfg.
func New(cfg Config) (*Projector, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	return &Projector{cfg: cfg, log: cfg.Logger.With("consumer", ConsumerName)}, nil
}

// Name is the durable consumer name.
func (p *Projector) Name() string { return ConsumerName }

// Stats says what one batch did besides writing rows.
type Stats struct {
	Messages int
	// Liveness counts liveness entries read; IgnoredLiveness those that
	// changed nothing: they name a node the projection does not know (its
	// connected event was cut off by the stream's retention; it appears
	// with its next one), or are no newer than its last_seen (a
	// redelivery, or a node two gateways list around a re-home).
	Liveness, IgnoredLiveness int
	// IgnoredEvents counts disconnects and status changes of an unknown
	// node or of a session the node no longer holds (a gateway it left).
	IgnoredEvents int
	// ForeignReports counts allocation reports from a node (pool, node)
	// other than the one fleet_allocations says the allocation is placed
	// on. They are stored under their reporter, where no reader looks.
	ForeignReports int
}

// Apply projects a batch (projection.Projector). A message that cannot be
// decoded makes Apply return its *projection.PoisonError before anything
// is written.
func (p *Projector) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	st, err := p.ApplyStats(ctx, tx, batch)
	if err == nil && st.ForeignReports > 0 {
		if p.cfg.ForeignReports != nil {
			p.cfg.ForeignReports.Add(float64(st.ForeignReports))
		}
		p.log.Warn("allocation reports from nodes the allocations are not placed on; they change nothing",
			"reports", st.ForeignReports)
	}
	if err == nil && st.IgnoredLiveness+st.IgnoredEvents > 0 {
		p.log.Debug("ignored events of unknown nodes or old sessions", "messages", st.Messages,
			"liveness_ignored", st.IgnoredLiveness, "events_ignored", st.IgnoredEvents)
	}
	return err
}

// ApplyStats is Apply, also returning what the batch did; the stats of a
// batch whose transaction rolls back are void.
func (p *Projector) ApplyStats(ctx context.Context, tx pgx.Tx, batch []projection.Message) (Stats, error) {
	p.idle = false
	evs := make([]event, 0, len(batch))
	for _, m := range batch {
		ev, err := decodeMessage(m)
		if err != nil {
			return Stats{}, projection.Poison(m, err)
		}
		evs = append(evs, ev)
	}
	if len(evs) == 0 {
		return Stats{}, nil
	}
	// Nearly always one fold; more only when the liveness clock resumes
	// after a silence in the middle of the batch (fold.liveness).
	var st Stats
	for rest := evs; len(rest) > 0; {
		f := newFold(p.cfg)
		for i := range rest {
			f.mention(&rest[i])
		}
		if err := f.load(ctx, tx); err != nil {
			return Stats{}, err
		}
		n := f.run(rest)
		if err := f.write(ctx, tx); err != nil {
			return Stats{}, err
		}
		st.Liveness += f.stats.Liveness
		st.IgnoredLiveness += f.stats.IgnoredLiveness
		st.IgnoredEvents += f.stats.IgnoredEvents
		st.ForeignReports += f.stats.ForeignReports
		rest = rest[n:]
	}
	st.Messages = len(evs)
	return st, nil
}

// Sweep ages nodes that have not been heard from (projection.Sweeper): as
// of the horizon min(now, newest liveness batch + ClockSlack), healthy
// nodes unheard for SuspectAfter become suspect, and nodes unheard for
// UnreachableAfter unreachable, each since the moment it crossed the
// threshold. now is the wall clock; the rows written depend only on the
// stream, and on now only through which nodes have crossed a threshold.
// Without any liveness batch yet there is no horizon and nothing changes.
func (p *Projector) Sweep(ctx context.Context, tx pgx.Tx, now time.Time) error {
	var clock time.Time
	var resumed *time.Time
	p.idle = false
	err := tx.QueryRow(ctx, sqlLoadClock).Scan(&clock, &resumed)
	if errors.Is(err, pgx.ErrNoRows) {
		p.idle = true
		return nil
	}
	if err != nil {
		return fmt.Errorf("fleet: sweep: %w", err)
	}
	horizon := clock.Add(p.cfg.ClockSlack)
	if now = now.Truncate(time.Microsecond); now.Before(horizon) {
		horizon = now
	}
	// The horizon and resumed time go in as parameters, not as a join with
	// fleet_clock, whose row estimate would make the planner JIT-compile
	// the statement (a quarter of a second, every time).
	tag, err := tx.Exec(ctx, sqlSweepAt, horizon, resumed, p.cfg.SuspectAfter, p.cfg.UnreachableAfter)
	if err != nil {
		return fmt.Errorf("fleet: sweep: %w", err)
	}
	if n := tag.RowsAffected(); n > 0 {
		p.log.Debug("sweep changed node states", "nodes", n, "horizon", horizon)
	}
	return nil
}

// Reset empties the projection so that a replay can build it again
// (projection.Resetter). The fleet_rev sequence goes on where it was, so a
// reader that loads changes by rev (the placer) sees every replayed row as
// changed; rev is left out of Digest for that reason.
func (p *Projector) Reset(ctx context.Context, tx pgx.Tx) error {
	if _, err := tx.Exec(ctx, "truncate "+strings.Join(DigestTables, ", ")); err != nil {
		return fmt.Errorf("fleet: reset: %w", err)
	}
	return nil
}
