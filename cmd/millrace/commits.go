package main

import (
	"context"
	"flag"
	"log/slog"
	"time"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/projectors/compactor"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/services/commits"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// commits serves the commits edge over gRPC and under /v1/worlds/ on the
// process's mux, reading folded versions from the process's bucket.
func (p *process) commits(o commits.Options) supervise.Component {
	return supervise.Serve("commits edge", func(ctx context.Context) (*commits.Edge, error) {
		e, err := commits.Start(ctx, o, p.bb, p.bk, p.t.reg, p.t.kf, p.log)
		if err == nil {
			e.Mount(p.mux)
		}
		return e, err
	})
}

func serveCommitsCommand() command {
	return command{
		Name:    "serve commits",
		Summary: "run the commits edge (the commit log's API: put, get, delete, history, list)",
		Long:    commits.Description,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				co commits.Options
				bo bucket.Options
			)
			po.register(fs, "127.0.0.1:8086", "HTTP address: /v1/worlds/, /metrics, /healthz, /readyz", "how long shutdown waits for calls in progress")
			co.RegisterFlags(fs)
			bo.RegisterFlags(fs)
			return po.run("serve commits", "millrace-commits", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				return []supervise.Component{p.openBucket(bo)}, []supervise.Component{p.commits(co)}, nil
			})
		},
	}
}

// compactorOptions configure the commit log's compactor: when a world is
// folded (the fold runner's) and how (the compactor's).
type compactorOptions struct {
	fold commitlog.Options
	cc   compactor.Config
}

func (o *compactorOptions) register(fs *flag.FlagSet) {
	o.fold.RegisterFlags(fs, kafka.HoldersHelp(subjects.StreamCommits))
	o.cc.RegisterFlags(fs)
}

// durables are the fold's durable consumers, which a process keeps off
// the backbone's reader as it does serviceConsumers: its discovery
// consumer, whatever --compactor-durable names it.
func (o *compactorOptions) durables() []string { return []string{o.fold.Durable()} }

// config checks the options; drain is how long passes in flight may go
// on once the compactor is told to stop, k the Kafka export's options
// (its consumer of COMMITS holds deletions back by default).
func (o *compactorOptions) config(drain time.Duration, k kafka.Options, log *slog.Logger) (commitlog.FoldRunnerConfig, compactor.Config, error) {
	rc, err := o.fold.Config(drain, func() ([]string, error) {
		return k.Holders(subjects.StreamCommits, streams.StreamOf)
	}, log)
	if err == nil {
		err = o.cc.CheckFlags()
	}
	return rc, o.cc, err
}

// compactor folds the commit log into the process's bucket; passes in
// flight get drain once it is told to stop.
func (p *process) compactor(o compactorOptions, drain time.Duration, k kafka.Options) (supervise.Component, error) {
	rc, cc, err := o.config(drain, k, p.log)
	if err != nil {
		return supervise.Component{}, err
	}
	p.durables = append(p.durables, o.durables()...)
	var r *commitlog.FoldRunner
	return supervise.Component{
		Name: "compactor",
		Start: func(context.Context) (err error) {
			ops := bucket.NewOperations(p.t.reg, "millrace_compactor_bucket_operations_total",
				"Bucket operations of the compactor, by operation (list, get, create, equal) and result (ok, exists, error).")
			rc.Metrics, rc.ConsumerMetrics = commitlog.NewFoldMetrics(p.t.reg), p.t.sm
			r, err = commitlog.NewFoldRunner(p.bb.JS, compactor.MustNew(cc, bucket.Count(p.bk, ops)), rc)
			return err
		},
		// Run returns once its context ends and passes in flight have
		// finished or been abandoned (within drain); what they did not
		// fold is folded after the next start.
		Run: func(ctx context.Context) error { return r.Run(ctx) },
	}, nil
}

func projectCompactorCommand() command {
	return command{
		Name:    "project compactor",
		Summary: "run the commit log's compactor (COMMITS -> checkpoints in the bucket)",
		Long:    compactor.Description,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				bo bucket.Options
				co compactorOptions
				ko kafka.Options
			)
			po.register(fs, "127.0.0.1:8087", "HTTP address: /metrics, /healthz, /readyz",
				"how long the whole shutdown may take; passes in flight get three quarters of it, and a pass cut short is redone after the next start")
			bo.RegisterFlags(fs)
			co.register(fs)
			ko.RegisterRouteFlags(fs)
			return po.run("project compactor", "millrace-compactor", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				c, err := p.compactor(co, po.timeout()-po.timeout()/4, ko)
				return []supervise.Component{p.openBucket(bo), c}, nil, err
			})
		},
	}
}
