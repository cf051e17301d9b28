package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"google.golang.org/grpc"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/grpclimit"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/services/commits"
	"github.com/millrace/millrace/streams"
)

// commitsOptions configure the commits edge.
type commitsOptions struct {
	listen, tlsCert, tlsKey string
	keys, keysFile          string
	maxBody                 int
	cacheBytes, indexWorlds int
	listWait                time.Duration
}

func (o *commitsOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.listen, "commits-listen", "MILLRACE_COMMITS_LISTEN", "127.0.0.1:1987", "commits API gRPC address (JSON and raw bodies over HTTP are served under /v1/worlds/ on --http-listen)")
	envflag.String(fs, &o.tlsCert, "commits-tls-cert", "MILLRACE_COMMITS_TLS_CERT", "", "PEM server certificate for the commits gRPC API (with --commits-tls-key); empty serves plaintext, for loopback and behind a TLS proxy")
	envflag.String(fs, &o.tlsKey, "commits-tls-key", "MILLRACE_COMMITS_TLS_KEY", "", "PEM private key of --commits-tls-cert")
	envflag.String(fs, &o.keys, "commits-api-keys", "MILLRACE_COMMITS_API_KEYS", "", "commits API keys as world=key (one world) or *=key (every world), comma-separated")
	envflag.String(fs, &o.keysFile, "commits-api-keys-file", "MILLRACE_COMMITS_API_KEYS_FILE", "", "file of API key lines (added to --commits-api-keys)")
	envflag.Size(fs, &o.maxBody, "commits-max-body-bytes", "MILLRACE_COMMITS_MAX_BODY_BYTES", commits.DefaultMaxBodyBytes, "largest document body")
	envflag.Size(fs, &o.cacheBytes, "commits-cache-bytes", "MILLRACE_COMMITS_CACHE_BYTES", commits.DefaultCacheBytes, "memory for decoded checkpoint objects (shards, history segments) kept to answer reads of folded versions")
	envflag.Int(fs, &o.indexWorlds, "commits-index-worlds", "MILLRACE_COMMITS_INDEX_WORLDS", commits.DefaultIndexWorlds, "worlds List keeps open in memory (about 100 bytes plus the id per document); the least recently listed closes first")
	envflag.Duration(fs, &o.listWait, "commits-list-wait", "MILLRACE_COMMITS_LIST_WAIT", commits.DefaultListWait, "how long a List waits for an open world to catch up with the writes acknowledged before it")
}

// config reads the keys; devSecrets, when not empty, is where a
// development key for every world is kept if none is configured.
func (o *commitsOptions) config(ctx context.Context, t *telemetry, devSecrets string, log *slog.Logger) (commits.Config, error) {
	keys := &commits.Keys{}
	src := keyfile.Source{Inline: o.keys, File: o.keysFile, DevDir: devSecrets, DevFile: "commits-api-keys", DevName: "*", What: "commits API keys"}
	if err := keyfile.Load(ctx, src, commits.ParseKeys, keys, t.kf, log); err != nil {
		return commits.Config{}, err
	}
	return commits.Config{Keys: keys, MaxBodyBytes: o.maxBody, CacheBytes: o.cacheBytes,
		IndexWorlds: o.indexWorlds, ListWait: o.listWait}, nil
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
	log = log.With("service", "commits")
	cfg, err := o.config(ctx, t, devSecrets, log)
	if err != nil {
		return nil, err
	}
	if bk != nil {
		cfg.Store = bk
	}
	tc, err := serverTLS(o.tlsCert, o.tlsKey, "--commits-tls-cert", "--commits-tls-key")
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
	g, err := supervise.NewGRPC(supervise.GRPCConfig{Addr: o.listen, TLS: tc, Options: append(opts, grpc.MaxRecvMsgSize(o.maxBody+64<<10))})
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
