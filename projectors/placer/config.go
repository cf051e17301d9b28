package placer

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"time"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/subjects"
)

// Consumer names: the durable consumers and position keys of the three
// projectors of this package.
const (
	// ConsumerName is the live placer's (FLEET_RESV, filter fleet.resv.>).
	ConsumerName = "placer"
	// DecisionsConsumer is the replay projector of FLEET_PLACE.
	DecisionsConsumer = "placer-decisions"
	// RequestsConsumer is the replay projector of FLEET_RESV.
	RequestsConsumer = "placer-requests"
)

// NotifyChannel is the PostgreSQL NOTIFY channel the placer signals in
// every transaction that writes outbox rows; the outbox relay
// (streams.Outbox) listens on it. PostgreSQL delivers the notification
// when the transaction commits and drops it when it rolls back.
const NotifyChannel = "millrace_outbox"

// Defaults of Config.
const (
	DefaultBindTimeout    = 30 * time.Second
	DefaultPendingTimeout = 10 * time.Minute
	DefaultRounds         = 3
	DefaultReloadEvery    = 10 * time.Minute
	DefaultSweepOverdue   = 10 * time.Second
	DefaultUnbindRetry    = 10 * time.Second
)

// Config configures the placer. A zero field takes its default; a negative
// one is refused by New, unless its comment gives negative a meaning.
type Config struct {
	// BindTimeout is how long an allocation may stay without a BOUND
	// report from its node (fleet_allocation_reports) after it was placed
	// before Sweep releases its reservation ("bind_timeout") and places it
	// again. Zero means DefaultBindTimeout (30s).
	BindTimeout time.Duration
	// PendingTimeout is how long a reservation may wait for capacity
	// (since it was requested, or since it was last released to be placed
	// again) before Sweep fails it ("no capacity: ..."). Zero means
	// DefaultPendingTimeout (10 min).
	PendingTimeout time.Duration
	// Rounds bounds the plan-and-commit rounds of one transaction: when a
	// commit guard rejects plans (another placer booked the GPUs, a node
	// changed under the planner), the index is corrected from the
	// database and the rejected reservations are planned again, at most
	// Rounds times in all; what is left waits for the next Apply or
	// Sweep. Zero means DefaultRounds (3).
	Rounds int
	// ReloadEvery is how often the index of nodes, GPUs and bookings is
	// reloaded from scratch, as a backstop to the incremental refresh by
	// fleet_nodes.rev. Zero means DefaultReloadEvery (10 min); negative
	// never reloads but after Aborted.
	ReloadEvery time.Duration
	// SweepOverdue bounds how long the policies of Sweep may wait: the
	// runner sweeps only when the stream is idle, so when requests keep
	// coming, Apply also does a sweep's work (in its own transaction) once
	// the last sweep is older than this. Zero means DefaultSweepOverdue
	// (10s); negative leaves sweeping to the runner alone.
	SweepOverdue time.Duration
	// UnbindRetry is how often the gateways are asked again (UnbindAgain)
	// to unbind an allocation that was released, or fences its node, and
	// whose node, connected, has not confirmed it. Its GPUs are not
	// bookable until then. Zero means DefaultUnbindRetry (10s).
	UnbindRetry time.Duration
	// Now is the clock that stamps the decisions Apply makes (Sweep uses
	// the time the runner passes). Nil means time.Now.
	Now func() time.Time
	// Subject names the subject a pool's decisions are published on.
	// Nil means subjects.FleetPlace: fleet.place.<pool>, the pool encoded
	// as a subject token (docs/subjects.md).
	Subject func(pool string) string
	// Logger receives the few things worth a line (rejected plans,
	// reloads). Nil means slog.Default().
	Logger *slog.Logger
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	// ReloadEvery and SweepOverdue are missing on purpose: negative has a
	// meaning.
	errs := []error{
		knob.NotNegative("placer", "BindTimeout", c.BindTimeout, DefaultBindTimeout),
		knob.NotNegative("placer", "PendingTimeout", c.PendingTimeout, DefaultPendingTimeout),
		knob.NotNegative("placer", "Rounds", c.Rounds, DefaultRounds),
		knob.NotNegative("placer", "UnbindRetry", c.UnbindRetry, DefaultUnbindRetry),
	}
	d := c.withDefaults()
	if d.PendingTimeout < d.BindTimeout {
		errs = append(errs, fmt.Errorf("placer: PendingTimeout %v is shorter than BindTimeout %v", d.PendingTimeout, d.BindTimeout))
	}
	return errors.Join(errs...)
}

// RegisterFlags registers the flags of the placer's release policies on
// fs, each with its MILLRACE_PLACER_* variable. The other fields are set
// in code.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	envflag.Duration(fs, &c.BindTimeout, "placer-bind-timeout", "MILLRACE_PLACER_BIND_TIMEOUT", DefaultBindTimeout, "an allocation its node has not confirmed within this is released and placed again")
	envflag.Duration(fs, &c.PendingTimeout, "placer-pending-timeout", "MILLRACE_PLACER_PENDING_TIMEOUT", DefaultPendingTimeout, "a reservation that found no capacity within this fails")
	envflag.Duration(fs, &c.UnbindRetry, "placer-unbind-retry", "MILLRACE_PLACER_UNBIND_RETRY", DefaultUnbindRetry, "how often the nodes are asked again to unbind a released allocation they have not confirmed (its GPUs are not bookable until they do)")
}

func (c Config) withDefaults() Config {
	if c.BindTimeout == 0 {
		c.BindTimeout = DefaultBindTimeout
	}
	if c.PendingTimeout == 0 {
		c.PendingTimeout = DefaultPendingTimeout
	}
	if c.Rounds == 0 {
		c.Rounds = DefaultRounds
	}
	if c.ReloadEvery == 0 {
		c.ReloadEvery = DefaultReloadEvery
	}
	if c.SweepOverdue == 0 {
		c.SweepOverdue = DefaultSweepOverdue
	}
	if c.UnbindRetry == 0 {
		c.UnbindRetry = DefaultUnbindRetry
	}
	if c.Now == nil {
		c.Now = time.Now
	}
	if c.Subject == nil {
		c.Subject = subjects.FleetPlace
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}
