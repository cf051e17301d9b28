package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/projectors/compactor"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// compactorOptions configure the commit log's compactor: when a world is
// folded (commitlog.FoldRunner) and how (compactor.Config).
type compactorOptions struct {
	durable       string
	hold          string
	minVersions   int
	interval      time.Duration
	concurrency   int
	maxAckPending int
	ackWait       time.Duration
	shardDocs     int
}

func (o *compactorOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.durable, "compactor-durable", "MILLRACE_COMPACTOR_DURABLE", "compactor",
		"name of the compactor's discovery consumer on COMMITS and of its lease (fold.<name> in the millrace_leases bucket): one process per name folds, others stand by")
	envflag.Int(fs, &o.minVersions, "compactor-min-versions", "MILLRACE_COMPACTOR_MIN_VERSIONS", 10000,
		"fold a world as soon as this many of its versions wait")
	envflag.Duration(fs, &o.interval, "compactor-interval", "MILLRACE_COMPACTOR_INTERVAL", 30*time.Second,
		"fold a world once its oldest waiting version is this old")
	envflag.Int(fs, &o.concurrency, "compactor-concurrency", "MILLRACE_COMPACTOR_CONCURRENCY", 2,
		"worlds folded at once (one pass per world at a time)")
	envflag.Int(fs, &o.maxAckPending, "compactor-max-ack-pending", "MILLRACE_COMPACTOR_MAX_ACK_PENDING", 200000,
		"versions delivered to the compactor and not folded yet before JetStream pauses deliveries; at half of it the world with the oldest waiting version folds at once (about 120 bytes of memory each)")
	envflag.Duration(fs, &o.ackWait, "compactor-ack-wait", "MILLRACE_COMPACTOR_ACK_WAIT", 5*time.Minute,
		"how long JetStream waits for the compactor to acknowledge a version before delivering it again; keep it well above --compactor-interval")
	envflag.Int(fs, &o.shardDocs, "compactor-shard-docs", "MILLRACE_COMPACTOR_SHARD_DOCS", 4096,
		"documents per shard object of a checkpoint; a shard past twice this is split")
	envflag.String(fs, &o.hold, "compactor-hold", "MILLRACE_COMPACTOR_HOLD", "",
		`durable consumers on COMMITS, comma-separated, that hold deletions back: no version is deleted above their ack floor, none at all while one does not exist; empty: the Kafka export's consumer of COMMITS (`+kafka.Durable(subjects.StreamCommits)+`) when --kafka-brokers is set and a --kafka-routes route reads COMMITS, else none; "none": nothing holds`)
}

// holdNone is the --compactor-hold that names no holder.
const holdNone = "none"

// holders is the fold runner's HoldFor: the consumers --compactor-hold
// names, or by default those of the export that k configures.
func (o *compactorOptions) holders(k kafkaOptions) ([]string, error) {
	switch strings.TrimSpace(o.hold) {
	case "":
		return kafkaHolders(k)
	case holdNone:
		return []string{}, nil
	}
	var names []string
	for _, n := range strings.Split(o.hold, ",") {
		if n = strings.TrimSpace(n); n != "" {
			names = append(names, n)
		}
	}
	if len(names) == 0 {
		return nil, usageError{fmt.Sprintf("--compactor-hold %q names no consumer (%q: nothing holds)", o.hold, holdNone)}
	}
	return names, nil
}

// kafkaHolders is the Kafka export's consumer of COMMITS when k runs the
// export (names a broker) and one of its routes reads COMMITS: the
// compactor must not delete what that export has not sent.
func kafkaHolders(k kafkaOptions) ([]string, error) {
	if strings.Trim(k.brokers, ", \t") == "" {
		return nil, nil
	}
	routes, err := kafka.ParseRoutes(k.routes)
	if err != nil {
		return nil, usageError{"--kafka-routes, which says whether the export holds the compactor back: " + err.Error()}
	}
	for _, r := range routes {
		if stream, ok := streams.StreamOf(r.Filter); ok && stream == subjects.StreamCommits {
			return []string{kafka.Durable(subjects.StreamCommits)}, nil
		}
	}
	return nil, nil
}

// config checks the options; drain is how long passes in flight may go
// on once the compactor is told to stop, k the Kafka export's options
// (its consumer of COMMITS holds deletions back by default).
func (o *compactorOptions) config(drain time.Duration, k kafkaOptions, log *slog.Logger) (commitlog.FoldRunnerConfig, compactor.Config, error) {
	switch {
	case o.minVersions < 1:
		return commitlog.FoldRunnerConfig{}, compactor.Config{}, usageError{"--compactor-min-versions must be at least 1"}
	case o.interval <= 0:
		return commitlog.FoldRunnerConfig{}, compactor.Config{}, usageError{"--compactor-interval must be positive"}
	case o.concurrency < 1:
		return commitlog.FoldRunnerConfig{}, compactor.Config{}, usageError{"--compactor-concurrency must be at least 1"}
	case o.maxAckPending < 1:
		return commitlog.FoldRunnerConfig{}, compactor.Config{}, usageError{"--compactor-max-ack-pending must be positive"}
	case o.ackWait <= 0:
		return commitlog.FoldRunnerConfig{}, compactor.Config{}, usageError{"--compactor-ack-wait must be positive"}
	case o.shardDocs < 1:
		return commitlog.FoldRunnerConfig{}, compactor.Config{}, usageError{"--compactor-shard-docs must be at least 1"}
	}
	hold, err := o.holders(k)
	if err != nil {
		return commitlog.FoldRunnerConfig{}, compactor.Config{}, err
	}
	rc := commitlog.FoldRunnerConfig{
		Durable:       o.durable,
		MinVersions:   o.minVersions,
		Interval:      o.interval,
		Concurrency:   o.concurrency,
		MaxAckPending: o.maxAckPending,
		AckWait:       o.ackWait,
		Drain:         drain,
		HoldFor:       hold,
		Logger:        log,
	}
	if err := rc.Validate(); err != nil {
		return rc, compactor.Config{}, usageError{err.Error()}
	}
	cc := compactor.Config{ShardDocs: o.shardDocs}
	if err := cc.Validate(); err != nil {
		return rc, cc, usageError{err.Error()}
	}
	return rc, cc, nil
}

// newCompactor makes the fold runner of the compactor over bk, with its
// metrics on t.
func newCompactor(rc commitlog.FoldRunnerConfig, cc compactor.Config, js jetstream.JetStream, bk *bucket.Bucket, t *telemetry) *commitlog.FoldRunner {
	ops := bucket.NewOperations(t.reg, "millrace_compactor_bucket_operations_total",
		"Bucket operations of the compactor, by operation (list, get, create, equal) and result (ok, exists, error).")
	rc.Metrics, rc.ConsumerMetrics = commitlog.NewFoldMetrics(t.reg), t.sm
	return commitlog.NewFoldRunner(js, compactor.MustNew(cc, bucket.Count(bk, ops)), rc)
}

// compactor folds the commit log into the process's bucket; passes in
// flight get drain once it is told to stop.
func (p *process) compactor(o compactorOptions, drain time.Duration, k kafkaOptions) (supervise.Component, error) {
	rc, cc, err := o.config(drain, k, p.log)
	if err != nil {
		return supervise.Component{}, err
	}
	var r *commitlog.FoldRunner
	return supervise.Component{
		Name:  "compactor",
		Start: func(context.Context) error { r = newCompactor(rc, cc, p.bb.JS, p.bk, p.t); return nil },
		// Run returns once its context ends and passes in flight have
		// finished or been abandoned (within drain); what they did not
		// fold is folded after the next start.
		Run: func(ctx context.Context) error { return r.Run(ctx) },
	}, nil
}

func projectCompactorCommand() command {
	return command{
		name:    "project compactor",
		summary: "run the commit log's compactor (COMMITS -> checkpoints in the bucket)",
		long: `Folds the worlds of the commit log into the bucket (--bucket-url): per world,
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
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				bo bucketOptions
				co compactorOptions
				ko kafkaOptions
			)
			po.register(fs, "127.0.0.1:8087", "HTTP address: /metrics, /healthz, /readyz",
				"how long the whole shutdown may take; passes in flight get three quarters of it, and a pass cut short is redone after the next start")
			bo.register(fs)
			co.register(fs)
			ko.registerRoutes(fs)
			return po.run("project compactor", "millrace-compactor", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				c, err := p.compactor(co, po.timeout()-po.timeout()/4, ko)
				return []supervise.Component{p.openBucket(bo), c}, nil, err
			})
		},
	}
}
