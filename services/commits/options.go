package commits

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/grpclimit"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/internal/tlsfiles"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// Options are what a process sets to run the edge: the Config knobs, the
// gRPC listener and its TLS, and where the API keys come from. Its flags
// (RegisterFlags) are the edge's, so that every command that runs it takes
// the same ones; Start turns them into a serving edge.
type Options struct {
	// Config holds the fields set straight from a flag; Load adds Keys.
	Config Config
	// Listen is the gRPC address.
	Listen string
	// TLSCert and TLSKey are the gRPC server's certificate; neither serves
	// plaintext.
	TLSCert, TLSKey string
	// APIKeys (inline) and APIKeysFile (reloaded when it changes) are the
	// API keys together.
	APIKeys, APIKeysFile string
	// DevSecrets, when not empty, is the directory where a development
	// secret is made and kept if none is configured (keyfile.Source). It
	// is no flag: a development process sets it.
	DevSecrets string
}

// RegisterFlags registers the edge's flags on fs, each with its
// MILLRACE_COMMITS_* variable.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	envflag.String(fs, &o.Listen, "commits-listen", "MILLRACE_COMMITS_LISTEN", "127.0.0.1:1987", "commits API gRPC address (JSON and raw bodies over HTTP are served under /v1/worlds/ on --http-listen)")
	envflag.String(fs, &o.TLSCert, "commits-tls-cert", "MILLRACE_COMMITS_TLS_CERT", "", "PEM server certificate for the commits gRPC API (with --commits-tls-key); empty serves plaintext, for loopback and behind a TLS proxy")
	envflag.String(fs, &o.TLSKey, "commits-tls-key", "MILLRACE_COMMITS_TLS_KEY", "", "PEM private key of --commits-tls-cert")
	envflag.String(fs, &o.APIKeys, "commits-api-keys", "MILLRACE_COMMITS_API_KEYS", "", "commits API keys as world=key (one world) or *=key (every world), comma-separated")
	envflag.String(fs, &o.APIKeysFile, "commits-api-keys-file", "MILLRACE_COMMITS_API_KEYS_FILE", "", "file of API key lines (added to --commits-api-keys)")
	envflag.Size(fs, &o.Config.MaxBodyBytes, "commits-max-body-bytes", "MILLRACE_COMMITS_MAX_BODY_BYTES", DefaultMaxBodyBytes, "largest document body")
	envflag.Size(fs, &o.Config.CacheBytes, "commits-cache-bytes", "MILLRACE_COMMITS_CACHE_BYTES", DefaultCacheBytes, "memory for decoded checkpoint objects (shards, history segments) kept to answer reads of folded versions")
	envflag.Int(fs, &o.Config.IndexWorlds, "commits-index-worlds", "MILLRACE_COMMITS_INDEX_WORLDS", DefaultIndexWorlds, "worlds List keeps open in memory (about 100 bytes plus the id per document); the least recently listed closes first")
	envflag.Duration(fs, &o.Config.ListWait, "commits-list-wait", "MILLRACE_COMMITS_LIST_WAIT", DefaultListWait, "how long a List waits for an open world to catch up with the writes acknowledged before it")
}

// Load makes the edge's Config: it reads the keys, and keeps them current
// with their file until ctx ends (keyfile.Load; kf counts the reloads), so
// that a key removed from it is refused without a restart.
func (o Options) Load(ctx context.Context, kf *keyfile.Metrics, log *slog.Logger) (Config, error) {
	c := o.Config
	src := keyfile.Source{Inline: o.APIKeys, File: o.APIKeysFile, DevDir: o.DevSecrets, DevFile: "commits-api-keys", DevName: "*", What: "commits API keys"}
	keys, err := keyfile.Load(ctx, src, keySyntax, kf, log)
	c.Keys = Keys{keys}
	return c, err
}

// Edge is a running edge: its gRPC server, and the same API for an HTTP
// mux (Mount), which belongs to the process rather than to the edge.
type Edge struct {
	*supervise.GRPCServer
	srv *Server
}

// Start makes the edge that o describes on bb's COMMITS stream and listens
// for gRPC; bk is the bucket the compactor folds the log into (nil:
// versions folded out of the stream cannot be read). A mistake in the
// flags is an envflag.UsageError. The caller serves it (Serve) and stops
// it (Stop). A nil log is slog.Default.
func Start(ctx context.Context, o Options, bb *streams.Backbone, bk *bucket.Bucket, reg prometheus.Registerer, kf *keyfile.Metrics, log *slog.Logger) (*Edge, error) {
	if log == nil {
		log = slog.Default()
	}
	log = log.With("component", "commits")
	cfg, err := o.Load(ctx, kf, log)
	if err != nil {
		return nil, err
	}
	if bk != nil { // a nil *bucket.Bucket in the interface would not be a nil Store
		cfg.Store = bk
	}
	tc, err := tlsfiles.ServerFlags(o.TLSCert, o.TLSKey, "--commits-tls-cert", "--commits-tls-key")
	if err != nil {
		return nil, err
	}
	st, err := bb.JS.Stream(ctx, subjects.StreamCommits)
	if err != nil {
		return nil, fmt.Errorf("commits: the %s stream: %w", subjects.StreamCommits, err)
	}
	cfg, lowered, err := cfg.FitPayload(bb.Payload(st))
	if err != nil {
		return nil, err
	}
	if lowered != "" {
		log.Warn(lowered)
	}
	srv, err := New(ctx, cfg, bb.JS, NewMetrics(reg), log)
	if err != nil {
		return nil, err
	}
	opts, err := grpclimit.ServerOptions(grpclimit.Config{})
	if err != nil {
		srv.Close()
		return nil, err
	}
	// A Put carries the body and its request: room for headers beside the
	// largest body.
	g, err := supervise.NewGRPC(supervise.GRPCConfig{Addr: o.Listen, TLS: tc, Options: append(opts, grpc.MaxRecvMsgSize(max(o.Config.MaxBodyBytes, cfg.MaxBodyBytes)+streams.HeaderRoom))})
	if err != nil {
		srv.Close()
		return nil, fmt.Errorf("commits listen: %w", err)
	}
	srv.Register(g.Server)
	log.Info("commits API serving", "addr", g.Addr().String(), "tls", tc != nil)
	return &Edge{GRPCServer: g, srv: srv}, nil
}

// Mount serves the HTTP API under Prefix on mux.
func (e *Edge) Mount(mux *http.ServeMux) { mux.Handle(Prefix, e.srv.Handler()) }

// Stop stops the gRPC server gracefully, then the edge (the worlds List
// keeps open).
func (e *Edge) Stop(ctx context.Context) error {
	err := e.GRPCServer.Stop(ctx)
	e.srv.Close()
	return err
}

// Description is the help of `millrace serve commits`, beside the flags
// it describes (RegisterFlags).
const Description = `Serves millrace.commits.v1.Commits over gRPC and the same API over HTTP under
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
before the call.`
