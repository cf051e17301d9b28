// Package logs makes a process's logger from its two flags, the level and
// the format. It is a package of its own because every command, the
// long-running servers and the one-shot tools alike, makes its logger this
// one way, and no other package owns logging: internal/supervise runs
// components and internal/envflag maps flags, and neither should decide
// where log lines go. Libraries never call it; they take a *slog.Logger.
package logs

import (
	"flag"
	"io"
	"log/slog"
	"os"

	"github.com/millrace/millrace/internal/envflag"
)

// Options are the logging flags.
type Options struct {
	// Level is debug, info, warn or error (slog.Level's names).
	Level string
	// Format is text or json: slog's text or JSON handler.
	Format string
}

// RegisterFlags registers the logging flags on fs, each with its
// environment variable (internal/envflag).
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	envflag.String(fs, &o.Level, "log-level", "MILLRACE_LOG_LEVEL", "info", "log level: debug, info, warn, error")
	envflag.String(fs, &o.Format, "log-format", "MILLRACE_LOG_FORMAT", "text", "log format: text or json")
}

// Logger makes the logger the options say, writing to standard error, and
// makes it slog's default too, so that a line logged through slog's
// package functions looks like every other. A level or format it does not
// know is the command line's mistake (an envflag.UsageError).
func (o Options) Logger() (*slog.Logger, error) {
	l, err := o.logger(os.Stderr)
	if err != nil {
		return nil, err
	}
	slog.SetDefault(l)
	return l, nil
}

func (o Options) logger(w io.Writer) (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.Level)); err != nil {
		return nil, envflag.Usagef("log level %q: want debug, info, warn or error", o.Level)
	}
	opts := &slog.HandlerOptions{Level: level}
	switch o.Format {
	case "text":
		return slog.New(slog.NewTextHandler(w, opts)), nil
	case "json":
		return slog.New(slog.NewJSONHandler(w, opts)), nil
	}
	return nil, envflag.Usagef("log format %q: want text or json", o.Format)
}
