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
		Long: `Serves millrace.commits.v1.Commits over gRPC and the same API over HTTP under
/v1/worlds/ (documents as raw bodies, If-Match / If-None-Match for
compare-and-set). Each version is one message on COMMITS
(commits.<world>.<doc>); its stream sequence is the version. Writers
authenticate with API keys per world. Several instances may run behind a
balancer: compare-and-set is JetStream's, not the edge's.

Versions the compactor (millrace project compactor) folded out of the
stream are read from the bucket (--bucket-url, the compactor's): Get of an
old version from its history segment, History across segments and stream.
List opens a world on first use from its latest checkpoint plus the stream
tail after it, then follows the tail; it answers every write acknowledged
before the call.`,
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
		Long: `Folds the worlds of the commit log into the bucket (--bucket-url): per world,
shards of its documents at their latest version, history segments of every
version, and a checkpoint manifest; then deletes from COMMITS the folded
versions that are not their document's last (compare-and-set stays
JetStream's), so the stream keeps about one message per document.

Which worlds to fold comes from a durable consumer on commits.> that reads
headers only (--compactor-durable). A world folds once
--compactor-min-versions of its versions wait, or once its oldest waiting
version is --compactor-interval old; at most --compactor-concurrency worlds
fold at once. A version is acknowledged only once its world is folded up to
it, so a crash or a restart re-delivers exactly what was not folded. A pass
that died between its checkpoint and its deletions is finished by the next
pass of the world (a sweep of the versions it left).

A version is never deleted before the exports of COMMITS have it: no
version above the ack floor of a consumer --compactor-hold names, and none
at all while one of them does not exist (a missing export consumer must not
let versions go before they were exported; the compactor warns once). By
default the holder is the Kafka export's consumer of COMMITS
(export-kafka-commits) when --kafka-brokers is set and a --kafka-routes
route reads COMMITS, as the export itself would decide from the same
variables; --compactor-hold=none when nothing exports COMMITS.

One process leads each durable name, by a lease (fold.<durable> in the
millrace_leases bucket); others stand by and take over within
--nats-lease-ttl of its end. A pass stores its checkpoint and each batch of
its deletions only while the lease holds. Metrics (millrace_compactor_*,
and millrace_consumer_*{kind="fold"}) on --http-listen.`,
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
