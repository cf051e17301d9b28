package commitlog

import (
	"cmp"
	"flag"
	"log/slog"
	"strings"
	"time"

	"github.com/millrace/millrace/internal/envflag"
)

// Options are the fold runner's knobs as a process sets them: when a world
// is folded, how many at once, and which consumers hold the deletions
// back. Its flags (RegisterFlags) are the fold's, so that every command
// that folds takes the same ones; Config checks them and fills in a
// FoldRunnerConfig.
type Options struct {
	rc   FoldRunnerConfig
	hold string
}

// RegisterFlags registers the fold's flags on fs, each with its
// MILLRACE_COMPACTOR_* variable. defaultHoldHelp says, in
// --compactor-hold's help, who holds the deletions back when the flag is
// empty (what Config's defaultHold answers): the fold does not know which
// exports run beside it; empty: none.
func (o *Options) RegisterFlags(fs *flag.FlagSet, defaultHoldHelp string) {
	envflag.String(fs, &o.rc.Durable, "compactor-durable", "MILLRACE_COMPACTOR_DURABLE", DefaultDurable,
		"name of the compactor's discovery consumer on COMMITS and of its lease (fold.<name> in the millrace_leases bucket): one process per name folds, others stand by")
	envflag.Int(fs, &o.rc.MinVersions, "compactor-min-versions", "MILLRACE_COMPACTOR_MIN_VERSIONS", DefaultMinVersions,
		"fold a world as soon as this many of its versions wait")
	envflag.Duration(fs, &o.rc.Interval, "compactor-interval", "MILLRACE_COMPACTOR_INTERVAL", DefaultInterval,
		"fold a world once its oldest waiting version is this old")
	envflag.Int(fs, &o.rc.Concurrency, "compactor-concurrency", "MILLRACE_COMPACTOR_CONCURRENCY", DefaultConcurrency,
		"worlds folded at once (one pass per world at a time)")
	envflag.Int(fs, &o.rc.MaxAckPending, "compactor-max-ack-pending", "MILLRACE_COMPACTOR_MAX_ACK_PENDING", DefaultMaxAckPending,
		"versions delivered to the compactor and not folded yet before JetStream pauses deliveries; at half of it the world with the oldest waiting version folds at once (about 120 bytes of memory each)")
	envflag.Duration(fs, &o.rc.AckWait, "compactor-ack-wait", "MILLRACE_COMPACTOR_ACK_WAIT", DefaultAckWait,
		"how long JetStream waits for the compactor to acknowledge a version before delivering it again; keep it well above --compactor-interval")
	envflag.String(fs, &o.hold, "compactor-hold", "MILLRACE_COMPACTOR_HOLD", "",
		`durable consumers on COMMITS, comma-separated, that hold deletions back: no version is deleted above their ack floor, none at all while one does not exist; empty: `+
			cmp.Or(defaultHoldHelp, "none")+`; "none": nothing holds`)
}

// Durable is the discovery consumer's name the flags ask for
// (--compactor-durable; DefaultDurable when not registered): a process
// keeps it, like every durable of its own, off the identities that only
// read.
func (o Options) Durable() string { return cmp.Or(o.rc.Durable, DefaultDurable) }

// holdNone is the --compactor-hold that names no holder.
const holdNone = "none"

// Config checks the options and makes the runner's configuration. drain
// is how long passes in flight may go on once the runner is told to stop;
// defaultHold names the holders when --compactor-hold is empty (nil: none,
// or a nil func), and is asked only then, so that a holder named on the
// command line does not depend on what the default reads. A mistake in
// the flags is an envflag.UsageError.
func (o Options) Config(drain time.Duration, defaultHold func() ([]string, error), log *slog.Logger) (FoldRunnerConfig, error) {
	rc := o.rc
	// The flags' zero is not the default here: the flags show the
	// defaults, so a zero was asked for and would be silently replaced.
	for _, c := range []struct {
		bad bool
		msg string
	}{
		{rc.MinVersions < 1, "--compactor-min-versions must be at least 1"}, {rc.Interval <= 0, "--compactor-interval must be positive"},
		{rc.Concurrency < 1, "--compactor-concurrency must be at least 1"}, {rc.MaxAckPending < 1, "--compactor-max-ack-pending must be positive"},
		{rc.AckWait <= 0, "--compactor-ack-wait must be positive"},
	} {
		if c.bad {
			return rc, envflag.Usage(c.msg)
		}
	}
	hold, err := o.holders(defaultHold)
	if err != nil {
		return rc, err
	}
	rc.Drain, rc.HoldFor, rc.Logger = drain, hold, log
	if err := rc.Validate(); err != nil {
		return rc, envflag.Usage(err.Error())
	}
	return rc, nil
}

// holders is HoldFor: the consumers --compactor-hold names, or by default
// those defaultHold answers.
func (o Options) holders(defaultHold func() ([]string, error)) ([]string, error) {
	switch strings.TrimSpace(o.hold) {
	case "":
		if defaultHold == nil {
			return nil, nil
		}
		return defaultHold()
	case holdNone:
		return []string{}, nil
	}
	names := envflag.SplitList(o.hold)
	if len(names) == 0 {
		return nil, envflag.Usagef("--compactor-hold %q names no consumer (%q: nothing holds)", o.hold, holdNone)
	}
	return names, nil
}
