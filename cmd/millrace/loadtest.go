package main

import (
	"context"
	"flag"

	"os"

	"github.com/millrace/millrace/loadtest/fleetsim"
)

func loadtestFleetCommand() command {
	return command{
		name:    "loadtest fleet",
		summary: "simulate GPU nodes and reservations against running gateways",
		long: `Runs N simulated GPU nodes in this process, each with a real session over TLS to
the given gateways: heartbeats, status changes, crashes and a reconnect storm;
creates reservations at a rate through the reservations API. Prints progress
to stderr and writes a JSON report (-out; - for stdout): sessions held, gateway
RSS per session, placements/s, place-to-active p50/p99, re-home times,
liveness lag, false unreachable marks and double bookings (must be 0).
See loadtest/fleetsim/README.md.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var cfg fleetsim.Config
			cfg.RegisterFlags(fs)
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"loadtest fleet takes no arguments"}
				}
				if err := cfg.Validate(); err != nil {
					return usageError{err.Error()}
				}
				rep, err := fleetsim.Run(ctx, cfg, os.Stderr)
				if rep != nil && cfg.Out != "" {
					if werr := fleetsim.WriteReport(cfg.Out, rep, os.Stdout); werr != nil && err == nil {
						err = werr
					}
				}
				return err
			}
		},
	}
}
