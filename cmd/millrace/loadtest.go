package main

import (
	"cmp"
	"context"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/millrace/millrace/internal/cli"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/loadtest/commitsload"
	"github.com/millrace/millrace/loadtest/fleetsim"
)

// The load tools register their own flags and describe themselves
// (loadtest/fleetsim, loadtest/commitsload): the bench orchestrator shares
// them.

func loadtestFleetCommand() command {
	return command{
		Name:    "loadtest fleet",
		Summary: "simulate GPU nodes and reservations against running gateways",
		Long:    fleetsim.Description,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var cfg fleetsim.Config
			cfg.RegisterFlags(fs)
			return loadtest("loadtest fleet", func() error { return cfg.Validate() }, func(ctx context.Context) error {
				rep, err := fleetsim.Run(ctx, cfg, os.Stderr)
				if rep != nil && cfg.Out != "" {
					err = cmp.Or(err, fleetsim.WriteReport(cfg.Out, rep, os.Stdout))
				}
				return err
			})
		},
	}
}

func loadtestCommitsCommand() command {
	return command{
		Name:    "loadtest commits",
		Summary: "write documents through a running commits edge, fold them, and check that none was lost",
		Long:    commitsload.Description,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var cfg commitsload.Config
			cfg.RegisterFlags(fs)
			return loadtest("loadtest commits", func() error { return cfg.Validate() }, func(ctx context.Context) error {
				rep, err := commitsload.Run(ctx, cfg, os.Stderr)
				if rep == nil {
					return err
				}
				if cfg.Out != "" {
					err = cmp.Or(err, commitsload.WriteReport(cfg.Out, rep, os.Stdout))
				}
				if failed := rep.Failed(); err == nil && len(failed) > 0 {
					err = fmt.Errorf("the oracle found: %s", strings.Join(failed, ", "))
				}
				return err
			})
		},
	}
}

// loadtest is the body of a load tool: no arguments, a valid config, run.
func loadtest(cmd string, validate func() error, run func(context.Context) error) func(context.Context, []string) error {
	return func(ctx context.Context, args []string) error {
		if err := cli.NoArgs(cmd, args); err != nil {
			return err
		}
		if err := validate(); err != nil {
			return envflag.Usage(err.Error())
		}
		return run(ctx)
	}
}
