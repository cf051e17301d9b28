// Package web is a process's HTTP server: /metrics, /healthz and /readyz
// beside what the process adds to its mux (the console, the APIs over
// HTTP), behind the console's Guard (console keys and metrics tokens, kept
// current from their files), with a cap on open connections and timeouts
// for slow or idle clients. Every long-running command serves one, so its
// flags and its start live here once.
package web

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/netlimit"
	"github.com/millrace/millrace/internal/supervise"
)

// Options configure the HTTP server.
type Options struct {
	// Listen is the server's address.
	Listen string
	// ConsoleKeysFile and MetricsTokenFile hold the console keys and the
	// /metrics bearer tokens, one a line; required on an address other
	// hosts can reach unless InsecureOpen.
	ConsoleKeysFile, MetricsTokenFile string
	// InsecureOpen serves the console and /metrics without keys on such
	// an address.
	InsecureOpen bool
	// MaxConns caps the connections open at once (netlimit.Config.Max).
	MaxConns int
	// IdleTimeout closes a kept-alive connection idle this long.
	IdleTimeout time.Duration
	// ProjectKeys, when set, loads the BES API keys (project=key), which
	// the console also takes as read keys of their projects (set by the
	// command that serves both, not a flag).
	ProjectKeys func(context.Context) (*apikey.Table[string], error)
}

// RegisterFlags registers the HTTP server's flags on fs, each with its
// environment variable (internal/envflag). The address's default and help
// are the caller's: each command has its own port and serves its own
// pages there.
func (o *Options) RegisterFlags(fs *flag.FlagSet, listen, help string) {
	envflag.String(fs, &o.Listen, "http-listen", "MILLRACE_HTTP_LISTEN", listen, help)
	envflag.String(fs, &o.ConsoleKeysFile, "http-console-keys-file", "MILLRACE_HTTP_CONSOLE_KEYS_FILE", "",
		"file of console keys, one a line: project=KEY reads that project, KEY alone is an operator's (every project, the fleet, the commit log); a browser gives one as the password of HTTP basic auth, a script as \"authorization: Bearer KEY\"; required when --http-listen is not loopback")
	envflag.String(fs, &o.MetricsTokenFile, "http-metrics-token-file", "MILLRACE_HTTP_METRICS_TOKEN_FILE", "",
		"file of bearer tokens for /metrics, one a line (Prometheus: authorization.credentials_file); required when --http-listen is not loopback")
	envflag.Bool(fs, &o.InsecureOpen, "http-insecure-open", "MILLRACE_HTTP_INSECURE_OPEN", false,
		"serve the console and /metrics without keys on an address other hosts can reach (refused otherwise)")
	envflag.Int(fs, &o.MaxConns, "http-max-conns", "MILLRACE_HTTP_MAX_CONNS", 1024, "most HTTP connections open at once; more are closed as they arrive")
	envflag.Duration(fs, &o.IdleTimeout, "http-idle-timeout", "MILLRACE_HTTP_IDLE_TIMEOUT", 2*time.Minute, "a kept-alive HTTP connection idle this long is closed")
}

// guard loads the console keys and metrics tokens (kept current from
// their files while ctx lasts) and wraps next. Without them, a listener
// other hosts can reach is refused unless InsecureOpen.
func (o Options) guard(ctx context.Context, next http.Handler, kf *keyfile.Metrics, log *slog.Logger) (http.Handler, error) {
	g := &console.Guard{Next: next}
	if o.ConsoleKeysFile != "" {
		t, err := keyfile.Load(ctx, keyfile.Source{File: o.ConsoleKeysFile, What: "console keys"}, console.KeySyntax, kf, log)
		if err != nil {
			return nil, err
		}
		g.Console = console.Keys{Table: t}
	}
	if o.ProjectKeys != nil {
		t, err := o.ProjectKeys(ctx)
		if err != nil {
			return nil, err
		}
		g.Projects = t
	}
	if o.MetricsTokenFile != "" {
		t, err := keyfile.Load(ctx, keyfile.Source{File: o.MetricsTokenFile, What: "metrics tokens"}, console.TokenSyntax("metrics token"), kf, log)
		if err != nil {
			return nil, err
		}
		g.Metrics = console.Tokens{Table: t}
	}
	return g, g.CheckExposure(o.Listen, o.InsecureOpen)
}

// Server is the HTTP server, listening; Serve and Stop run it under
// internal/supervise.
type Server struct {
	*supervise.HTTPServer
	lis *netlimit.Listener
}

// Start listens on o.Listen and returns the server that serves mux (nil:
// a new one) with /metrics (reg's), /healthz (the process is up) and
// /readyz (ready says whether it serves) added. The key files stay
// watched while ctx lasts.
func Start(ctx context.Context, o Options, mux *http.ServeMux, ready func(context.Context) error, reg *prometheus.Registry, kf *keyfile.Metrics, log *slog.Logger) (*Server, error) {
	if mux == nil {
		mux = http.NewServeMux()
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), 2*time.Second)
		defer cancel()
		if err := ready(ctx); err != nil {
			http.Error(w, "not ready: "+err.Error(), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ready")
	})
	h, err := o.guard(ctx, mux, kf, log)
	if err != nil {
		return nil, err
	}
	// No read or write timeout for whole requests: a reservation waits up
	// to a minute for its placement and a document body may be large. A
	// client still must send its headers promptly, may keep an idle
	// connection only so long, and may hold only so many.
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: o.IdleTimeout, MaxHeaderBytes: 64 << 10}
	web := &Server{}
	s, err := supervise.NewHTTP(o.Listen, srv, func(l net.Listener) (net.Listener, error) {
		var err error
		web.lis, err = netlimit.Wrap(l, netlimit.Config{Max: o.MaxConns})
		return web.lis, err
	})
	if err != nil {
		return nil, fmt.Errorf("HTTP listen: %w", err)
	}
	web.HTTPServer = s
	log.Info("HTTP serving", "addr", s.Addr().String())
	return web, nil
}
