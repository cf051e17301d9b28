package bes

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/netlimit"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/internal/tlsfiles"
	"github.com/millrace/millrace/services/bes/redact"
	"github.com/millrace/millrace/streams"
)

// Options are the edge's knobs as an operator sets them (RegisterFlags):
// the parts of Config that are plain values, and what Start turns into the
// rest of a running edge (keys, redaction rules, TLS, the listener).
type Options struct {
	// Config holds the limits and timeouts; Start fills in Keys,
	// Redactor and NoRedaction from the fields below.
	Config Config
	// Listen is the gRPC address (host:port; port 0 picks one).
	Listen string
	// APIKeys are API keys as project=key,project=key; APIKeysFile a file
	// of project=key lines, reloaded while the edge runs. Both empty: any
	// client is accepted (on loopback only, unless InsecureOpen).
	APIKeys, APIKeysFile string
	// TLSCert and TLSKey are a PEM certificate (chain) and its key; both
	// empty serves plaintext.
	TLSCert, TLSKey string
	// InsecureOpen is the operator saying that an edge without keys on an
	// address other hosts can reach is intended (CheckExposure).
	InsecureOpen bool
	// Redact are the redaction rules; Redaction false stores events as
	// sent (Config.NoRedaction), only to measure what redaction costs.
	Redact    redact.Options
	Redaction bool
	// ConnsPerAddr caps the connections one client IP may hold open
	// (loopback exempt); 0: no cap.
	ConnsPerAddr int
}

// RegisterKeyFlags registers the API keys' flags alone (the console's
// too, whose BES keys read their projects); what says what the keys do.
func (o *Options) RegisterKeyFlags(fs *flag.FlagSet, what string) {
	envflag.String(fs, &o.APIKeys, "bes-api-keys", "MILLRACE_BES_API_KEYS", "", "API keys as project=key,project=key; "+what)
	envflag.String(fs, &o.APIKeysFile, "bes-api-keys-file", "MILLRACE_BES_API_KEYS_FILE", "", "file of project=key lines (added to --bes-api-keys)")
}

// RegisterFlags registers the --bes-* flags that set o, each with its
// variable.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	envflag.String(fs, &o.Listen, "bes-listen", "MILLRACE_BES_LISTEN", "127.0.0.1:1985", "BES gRPC address (bazel --bes_backend=grpc://ADDR)")
	o.RegisterKeyFlags(fs, "empty accepts any client")
	envflag.Size(fs, &o.Config.MaxEventBytes, "bes-max-event-bytes", "MILLRACE_BES_MAX_EVENT_BYTES", DefaultMaxEventBytes, "largest build event accepted")
	envflag.Int(fs, &o.Config.MaxStreams, "bes-max-streams", "MILLRACE_BES_MAX_STREAMS", DefaultMaxStreams, "most build event streams open at once")
	envflag.Int(fs, &o.Config.MaxStreamsPerProject, "bes-max-streams-per-project", "MILLRACE_BES_MAX_STREAMS_PER_PROJECT", 0, "most streams one project may hold open (0: half of --bes-max-streams)")
	envflag.Int(fs, &o.Config.MaxInFlight, "bes-max-in-flight", "MILLRACE_BES_MAX_IN_FLIGHT", DefaultMaxInFlight, "events of one stream awaiting storage before the edge stops reading it")
	o.Redact.RegisterFlags(fs)
	envflag.Bool(fs, &o.Redaction, "bes-redact", "MILLRACE_BES_REDACT", true, "redact secrets from build events before they are stored; false only to measure what redaction costs")
	envflag.String(fs, &o.TLSCert, "bes-tls-cert", "MILLRACE_BES_TLS_CERT", "", "PEM server certificate (chain) for the BES edge, with --bes-tls-key: Bazel then connects with --bes_backend=grpcs://HOST:PORT; empty serves plaintext")
	envflag.String(fs, &o.TLSKey, "bes-tls-key", "MILLRACE_BES_TLS_KEY", "", "PEM private key of --bes-tls-cert")
	envflag.Bool(fs, &o.InsecureOpen, "bes-insecure-open", "MILLRACE_BES_INSECURE_OPEN", false, "serve without API keys on an address other hosts can reach (refused otherwise): anyone who reaches the edge can publish as any project")
	envflag.Int(fs, &o.Config.MaxStreamsPerConn, "bes-max-streams-per-conn", "MILLRACE_BES_MAX_STREAMS_PER_CONN", DefaultMaxStreamsPerConn, "streams one client connection may hold open at once (a Bazel client holds one or two)")
	envflag.Int(fs, &o.ConnsPerAddr, "bes-max-conns-per-addr", "MILLRACE_BES_MAX_CONNS_PER_ADDR", 256, "connections one client IP may hold open (loopback clients, such as a local proxy, are exempt; 0: no cap)")
	envflag.Int(fs, &o.Config.MaxPendingPerAddr, "bes-max-pending-per-addr", "MILLRACE_BES_MAX_PENDING_PER_ADDR", DefaultMaxPendingPerAddr, "streams one client IP may hold before their first request (streams with a valid key in their headers do not count)")
	envflag.Duration(fs, &o.Config.FirstMessageTimeout, "bes-first-message-timeout", "MILLRACE_BES_FIRST_MESSAGE_TIMEOUT", DefaultFirstMessageTimeout, "how long a new stream may wait before its first event (which authenticates it)")
	envflag.Duration(fs, &o.Config.IdleTimeout, "bes-idle-timeout", "MILLRACE_BES_IDLE_TIMEOUT", DefaultIdleTimeout, "a stream whose client sends nothing for this long is closed (Bazel resumes it)")
}

// Load is the edge's Config: o.Config with the API keys loaded (a
// keys file is kept current until ctx ends, its reloads counted in kf) and
// the redactor built. A pattern the redactor refuses is an
// envflag.UsageError. kf and log may be nil.
func (o Options) Load(ctx context.Context, kf *keyfile.Metrics, log *slog.Logger) (Config, error) {
	c := o.Config
	var err error
	if c.Keys, err = o.LoadKeys(ctx, kf, log); err != nil {
		return c, err
	}
	c.Redactor, err = o.Redact.Redactor()
	c.NoRedaction = !o.Redaction
	return c, err
}

// LoadKeys loads the API keys (a keys file is kept current until ctx
// ends): the edge's, and the console's read keys of their projects.
func (o Options) LoadKeys(ctx context.Context, kf *keyfile.Metrics, log *slog.Logger) (Keys, error) {
	src := keyfile.Source{Inline: o.APIKeys, File: o.APIKeysFile, What: "BES API keys"}
	keys, err := keyfile.Load(ctx, src, keySyntax, kf, log)
	return Keys{keys}, err
}

// Start listens on o.Listen and serves the edge on bb's BES stream and
// publisher, with its metrics registered in reg. An event limit above
// what the backbone carries is lowered to fit, with a warning
// (Config.FitPayload). It refuses, before listening, what cannot be
// served: a backbone whose largest message leaves no room for events, an
// edge without keys open to other hosts (CheckExposure), half a TLS pair
// (an envflag.UsageError). The returned server serves once its Serve is
// called. kf and log may be nil.
func Start(ctx context.Context, o Options, bb *streams.Backbone, reg prometheus.Registerer, kf *keyfile.Metrics, log *slog.Logger) (*supervise.GRPCServer, error) {
	if log == nil {
		log = slog.Default()
	}
	log = log.With("component", "bes")
	cfg, err := o.Load(ctx, kf, log)
	if err != nil {
		return nil, err
	}
	parts := make([]jetstream.Stream, bb.Layout.N())
	for p := range parts {
		if parts[p], err = bb.JS.Stream(ctx, bb.Layout.Stream(p)); err != nil {
			return nil, fmt.Errorf("stream %s: %w", bb.Layout.Stream(p), err)
		}
	}
	stream := parts[0] // the partitions' streams share their limits
	cfg, lowered, err := cfg.FitPayload(bb.Payload(stream))
	if err != nil {
		return nil, err
	}
	if lowered != "" {
		log.Warn(lowered)
	}
	if err := cfg.Validate(bb.Conn.MaxPayload()); err != nil {
		return nil, err
	}
	if err := CheckExposure(o.Listen, cfg.Keys.Len(), o.InsecureOpen); err != nil {
		return nil, err
	}
	if cfg.Keys.Len() == 0 && o.InsecureOpen && !netlimit.IsLoopback(o.Listen) {
		log.Warn("BES edge open to every client: no API keys and --bes-insecure-open", "addr", o.Listen)
	}
	tc, err := tlsfiles.ServerFlags(o.TLSCert, o.TLSKey, "--bes-tls-cert", "--bes-tls-key")
	if err != nil {
		return nil, err
	}
	m := NewMetrics(reg)
	srv, err := New(cfg, bb.Publisher(), stream, m, log)
	if err != nil {
		return nil, err
	}
	if bb.Layout.Partitioned() {
		if err := srv.UseLayout(bb.Layout, parts); err != nil {
			return nil, err
		}
	}
	g, err := supervise.NewGRPC(supervise.GRPCConfig{Addr: o.Listen, TLS: tc, Options: srv.ServerOptions(),
		Listener: func(l net.Listener) (net.Listener, error) {
			return netlimit.Wrap(l, netlimit.Config{PerAddr: o.ConnsPerAddr, ExemptLoopback: true, OnRefuse: m.RefusedConnection})
		}})
	if err != nil {
		return nil, fmt.Errorf("BES listen: %w", err)
	}
	srv.Register(g.Server)
	log.Info("BES edge serving", "addr", g.Addr().String(), "api_keys", cfg.Keys.Len(), "tls", tc != nil, "redaction", !cfg.NoRedaction)
	if cfg.NoRedaction {
		log.Warn("BES redaction is off (MILLRACE_BES_REDACT=false): build events are stored with the secrets Bazel sent")
	}
	return g, nil
}
