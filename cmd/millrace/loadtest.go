package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/millrace/millrace/loadtest/commitsload"
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

func loadtestCommitsCommand() command {
	return command{
		name:    "loadtest commits",
		summary: "write documents through a running commits edge, fold them, and check that none was lost",
		long: `Puts document versions through the commits edge (gRPC, --addr): --writers
clients, each with its own connection (--shared-conn: one for all) and up to
--in-flight puts outstanding, on one world or --worlds, over --docs documents
per world: first each document once (--fill), then random updates for
--writes or --duration, flat out or at --rate puts/s, blind or a
--cas-fraction with compare-and-set. With --fold it then folds every world
into the bucket in this process (the compactor over --nats-url into
--bucket-url, which must be the bucket the edge reads).

Then the oracle reads back, from --read-addr (default --addr; a freshly
started edge measures a cold start): List of each world (the first page
timed, every document at its latest acknowledged version), Get of every
acknowledged version (same body) and each document's History (every
acknowledged version, in order). Lost, mismatched and gaps must be 0.
--ledger keeps the acknowledged versions in a file; --verify-only checks
them again later without writing.

Prints progress to stderr every second and writes a JSON report (--out; -
for stdout): acked writes/s, latency p50/p99/p99.9/max, errors by gRPC code,
the fold's documents/s and bucket operations per document, the oracle's
counts, and the CPU of --pids processes per 1,000 writes. Exits non-zero
when the oracle finds a problem. See loadtest/commitsload/README.md.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var cfg commitsload.Config
			cfg.RegisterFlags(fs)
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"loadtest commits takes no arguments"}
				}
				if err := cfg.Validate(); err != nil {
					return usageError{err.Error()}
				}
				rep, err := commitsload.Run(ctx, cfg, os.Stderr)
				if rep != nil && cfg.Out != "" {
					if werr := commitsload.WriteReport(cfg.Out, rep, os.Stdout); werr != nil && err == nil {
						err = werr
					}
				}
				if err == nil && rep != nil {
					if failed := rep.Failed(); len(failed) > 0 {
						err = fmt.Errorf("the oracle found: %s", strings.Join(failed, ", "))
					}
				}
				return err
			}
		},
	}
}
