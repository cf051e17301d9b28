package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/grpclimit"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/internal/tlsfiles"
	"github.com/millrace/millrace/projectors/compactor"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/services/commits"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// commitsOptions configure the commits edge.
type commitsOptions struct {
	c                       commits.Config
	listen, tlsCert, tlsKey string
	keys, keysFile          string
}

func (o *commitsOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.listen, "commits-listen", "MILLRACE_COMMITS_LISTEN", "127.0.0.1:1987", "commits API gRPC address (JSON and raw bodies over HTTP are served under /v1/worlds/ on --http-listen)")
	envflag.String(fs, &o.tlsCert, "commits-tls-cert", "MILLRACE_COMMITS_TLS_CERT", "", "PEM server certificate for the commits gRPC API (with --commits-tls-key); empty serves plaintext, for loopback and behind a TLS proxy")
	envflag.String(fs, &o.tlsKey, "commits-tls-key", "MILLRACE_COMMITS_TLS_KEY", "", "PEM private key of --commits-tls-cert")
	envflag.String(fs, &o.keys, "commits-api-keys", "MILLRACE_COMMITS_API_KEYS", "", "commits API keys as world=key (one world) or *=key (every world), comma-separated")
	envflag.String(fs, &o.keysFile, "commits-api-keys-file", "MILLRACE_COMMITS_API_KEYS_FILE", "", "file of API key lines (added to --commits-api-keys)")
	envflag.Size(fs, &o.c.MaxBodyBytes, "commits-max-body-bytes", "MILLRACE_COMMITS_MAX_BODY_BYTES", commits.DefaultMaxBodyBytes, "largest document body")
	envflag.Size(fs, &o.c.CacheBytes, "commits-cache-bytes", "MILLRACE_COMMITS_CACHE_BYTES", commits.DefaultCacheBytes, "memory for decoded checkpoint objects (shards, history segments) kept to answer reads of folded versions")
	envflag.Int(fs, &o.c.IndexWorlds, "commits-index-worlds", "MILLRACE_COMMITS_INDEX_WORLDS", commits.DefaultIndexWorlds, "worlds List keeps open in memory (about 100 bytes plus the id per document); the least recently listed closes first")
	envflag.Duration(fs, &o.c.ListWait, "commits-list-wait", "MILLRACE_COMMITS_LIST_WAIT", commits.DefaultListWait, "how long a List waits for an open world to catch up with the writes acknowledged before it")
}

// config reads the keys; devSecrets, when not empty, is where a
// development key for every world is kept if none is configured.
func (o *commitsOptions) config(ctx context.Context, t *telemetry, devSecrets string, log *slog.Logger) (commits.Config, error) {
	c := o.c
	c.Keys = &commits.Keys{}
	src := keyfile.Source{Inline: o.keys, File: o.keysFile, DevDir: devSecrets, DevFile: "commits-api-keys", DevName: "*", What: "commits API keys"}
	return c, keyfile.Load(ctx, src, commits.ParseKeys, c.Keys, t.kf, log)
}

// commitsEdge is a running commits edge: its gRPC server, and the API for
// an HTTP mux.
type commitsEdge struct {
	*supervise.GRPCServer
	srv *commits.Server
}

// startCommits starts the edge on bb; bk is the bucket the compactor folds
// the log into (nil: versions folded out of the stream cannot be read).
func startCommits(ctx context.Context, o commitsOptions, devSecrets string, bb *streams.Backbone, bk *bucket.Bucket, t *telemetry, log *slog.Logger) (*commitsEdge, error) {
	log = log.With("component", "commits")
	cfg, err := o.config(ctx, t, devSecrets, log)
	if err != nil {
		return nil, err
	}
	if bk != nil {
		cfg.Store = bk
	}
	tc, err := tlsfiles.ServerFlags(o.tlsCert, o.tlsKey, "--commits-tls-cert", "--commits-tls-key")
	if err != nil {
		return nil, err
	}
	srv, err := commits.New(ctx, cfg, bb.JS, commits.NewMetrics(t.reg), log)
	if err != nil {
		return nil, err
	}
	opts, err := grpclimit.ServerOptions(grpclimit.Config{})
	if err != nil {
		srv.Close()
		return nil, err
	}
	g, err := supervise.NewGRPC(supervise.GRPCConfig{Addr: o.listen, TLS: tc, Options: append(opts, grpc.MaxRecvMsgSize(o.c.MaxBodyBytes+64<<10))})
	if err != nil {
		srv.Close()
		return nil, fmt.Errorf("commits listen: %w", err)
	}
	srv.Register(g.Server)
	log.Info("commits API serving", "addr", g.Addr().String(), "tls", tc != nil)
	return &commitsEdge{GRPCServer: g, srv: srv}, nil
}

// mount serves the HTTP API on mux.
func (e *commitsEdge) mount(mux *http.ServeMux) { mux.Handle(commits.Prefix, e.srv.Handler()) }

// Stop stops the gRPC server, then the edge.
func (e *commitsEdge) Stop(ctx context.Context) error {
	err := e.GRPCServer.Stop(ctx)
	e.srv.Close()
	return err
}

// commits serves the commits edge over gRPC and under /v1/worlds/ on the
// process's mux, reading folded versions from the process's bucket.
func (p *process) commits(o commitsOptions, devSecrets string) supervise.Component {
	return supervise.Serve("commits edge", func(ctx context.Context) (*commitsEdge, error) {
		e, err := startCommits(ctx, o, devSecrets, p.bb, p.bk, p.t, p.log)
		if err == nil {
			e.mount(p.mux)
		}
		return e, err
	})
}

func serveCommitsCommand() command {
	return command{
		name:    "serve commits",
		summary: "run the commits edge (the commit log's API: put, get, delete, history, list)",
		long: `Serves millrace.commits.v1.Commits over gRPC and the same API over HTTP under
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
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				co commitsOptions
				bo bucketOptions
			)
			po.register(fs, "127.0.0.1:8086", "HTTP address: /v1/worlds/, /metrics, /healthz, /readyz", "how long shutdown waits for calls in progress")
			co.register(fs)
			bo.register(fs)
			return po.run("serve commits", "millrace-commits", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				return []supervise.Component{p.openBucket(bo)}, []supervise.Component{p.commits(co, "")}, nil
			})
		},
	}
}

// compactorOptions configure the commit log's compactor: when a world is
// folded (commitlog.FoldRunner) and how (compactor.Config).
type compactorOptions struct {
	rc   commitlog.FoldRunnerConfig
	cc   compactor.Config
	hold string
}

func (o *compactorOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.rc.Durable, "compactor-durable", "MILLRACE_COMPACTOR_DURABLE", "compactor",
		"name of the compactor's discovery consumer on COMMITS and of its lease (fold.<name> in the millrace_leases bucket): one process per name folds, others stand by")
	envflag.Int(fs, &o.rc.MinVersions, "compactor-min-versions", "MILLRACE_COMPACTOR_MIN_VERSIONS", 10000,
		"fold a world as soon as this many of its versions wait")
	envflag.Duration(fs, &o.rc.Interval, "compactor-interval", "MILLRACE_COMPACTOR_INTERVAL", 30*time.Second,
		"fold a world once its oldest waiting version is this old")
	envflag.Int(fs, &o.rc.Concurrency, "compactor-concurrency", "MILLRACE_COMPACTOR_CONCURRENCY", 2,
		"worlds folded at once (one pass per world at a time)")
	envflag.Int(fs, &o.rc.MaxAckPending, "compactor-max-ack-pending", "MILLRACE_COMPACTOR_MAX_ACK_PENDING", 200000,
		"versions delivered to the compactor and not folded yet before JetStream pauses deliveries; at half of it the world with the oldest waiting version folds at once (about 120 bytes of memory each)")
	envflag.Duration(fs, &o.rc.AckWait, "compactor-ack-wait", "MILLRACE_COMPACTOR_ACK_WAIT", 5*time.Minute,
		"how long JetStream waits for the compactor to acknowledge a version before delivering it again; keep it well above --compactor-interval")
	envflag.Int(fs, &o.cc.ShardDocs, "compactor-shard-docs", "MILLRACE_COMPACTOR_SHARD_DOCS", 4096,
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
	names := envflag.SplitList(o.hold)
	if len(names) == 0 {
		return nil, envflag.Usagef("--compactor-hold %q names no consumer (%q: nothing holds)", o.hold, holdNone)
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
		return nil, envflag.Usage("--kafka-routes, which says whether the export holds the compactor back: " + err.Error())
	}
	if kafka.Reads(routes, subjects.StreamCommits, streams.StreamOf) {
		return []string{kafka.Durable(subjects.StreamCommits)}, nil
	}
	return nil, nil
}

// config checks the options; drain is how long passes in flight may go
// on once the compactor is told to stop, k the Kafka export's options
// (its consumer of COMMITS holds deletions back by default).
func (o *compactorOptions) config(drain time.Duration, k kafkaOptions, log *slog.Logger) (commitlog.FoldRunnerConfig, compactor.Config, error) {
	rc := o.rc
	for _, c := range []struct {
		bad  bool
		flag string
	}{
		{rc.MinVersions < 1, "--compactor-min-versions must be at least 1"}, {rc.Interval <= 0, "--compactor-interval must be positive"},
		{rc.Concurrency < 1, "--compactor-concurrency must be at least 1"}, {rc.MaxAckPending < 1, "--compactor-max-ack-pending must be positive"},
		{rc.AckWait <= 0, "--compactor-ack-wait must be positive"}, {o.cc.ShardDocs < 1, "--compactor-shard-docs must be at least 1"},
	} {
		if c.bad {
			return rc, o.cc, envflag.Usage(c.flag)
		}
	}
	hold, err := o.holders(k)
	if err != nil {
		return rc, o.cc, err
	}
	rc.Drain, rc.HoldFor, rc.Logger = drain, hold, log
	if err := rc.Validate(); err != nil {
		return rc, o.cc, envflag.Usage(err.Error())
	}
	if err := o.cc.Validate(); err != nil {
		return rc, o.cc, envflag.Usage(err.Error())
	}
	return rc, o.cc, nil
}

// newCompactor makes the fold runner of the compactor over bk, with its
// metrics on t.
func newCompactor(rc commitlog.FoldRunnerConfig, cc compactor.Config, js jetstream.JetStream, bk *bucket.Bucket, t *telemetry) (*commitlog.FoldRunner, error) {
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
		Start: func(context.Context) (err error) { r, err = newCompactor(rc, cc, p.bb.JS, p.bk, p.t); return err },
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
