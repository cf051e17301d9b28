package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/netlimit"
	"github.com/millrace/millrace/internal/supervise"
)

// httpOptions configure a command's HTTP server (console, APIs over HTTP,
// /metrics, /healthz, /readyz).
type httpOptions struct {
	listen           string
	consoleKeysFile  string
	metricsTokenFile string
	insecureOpen     bool
	maxConns         int
	idleTimeout      time.Duration
}

func (o *httpOptions) register(fs *flag.FlagSet, def, help string) {
	envflag.String(fs, &o.listen, "http-listen", "MILLRACE_HTTP_LISTEN", def, help)
	envflag.String(fs, &o.consoleKeysFile, "http-console-keys-file", "MILLRACE_HTTP_CONSOLE_KEYS_FILE", "",
		"file of console keys, one a line (a browser gives one as the password of HTTP basic auth, a script as \"authorization: Bearer KEY\"); required when --http-listen is not loopback")
	envflag.String(fs, &o.metricsTokenFile, "http-metrics-token-file", "MILLRACE_HTTP_METRICS_TOKEN_FILE", "",
		"file of bearer tokens for /metrics, one a line (Prometheus: authorization.credentials_file); required when --http-listen is not loopback")
	envflag.Bool(fs, &o.insecureOpen, "http-insecure-open", "MILLRACE_HTTP_INSECURE_OPEN", false,
		"serve the console and /metrics without keys on an address other hosts can reach (refused otherwise)")
	envflag.Int(fs, &o.maxConns, "http-max-conns", "MILLRACE_HTTP_MAX_CONNS", 1024, "most HTTP connections open at once; more are closed as they arrive")
	envflag.Duration(fs, &o.idleTimeout, "http-idle-timeout", "MILLRACE_HTTP_IDLE_TIMEOUT", 2*time.Minute, "a kept-alive HTTP connection idle this long is closed")
}

// guard loads the console keys and metrics tokens (kept current from
// their files) and wraps next. Without them, a listener other hosts can
// reach is refused unless --http-insecure-open.
func (o httpOptions) guard(ctx context.Context, t *telemetry, next http.Handler, log *slog.Logger) (http.Handler, error) {
	g := &console.Guard{Console: &console.Tokens{}, Metrics: &console.Tokens{}, Next: next}
	if o.consoleKeysFile != "" {
		if err := keyfile.Load(ctx, keyfile.Source{File: o.consoleKeysFile, What: "console keys"}, console.ParseTokens("console key"), g.Console, t.kf, log); err != nil {
			return nil, err
		}
	}
	if o.metricsTokenFile != "" {
		if err := keyfile.Load(ctx, keyfile.Source{File: o.metricsTokenFile, What: "metrics tokens"}, console.ParseTokens("metrics token"), g.Metrics, t.kf, log); err != nil {
			return nil, err
		}
	}
	if !netlimit.IsLoopback(o.listen) && !o.insecureOpen {
		var missing []string
		if g.Console.Len() == 0 {
			missing = append(missing, "console keys (--http-console-keys-file, $MILLRACE_HTTP_CONSOLE_KEYS_FILE)")
		}
		if g.Metrics.Len() == 0 {
			missing = append(missing, "a metrics token (--http-metrics-token-file, $MILLRACE_HTTP_METRICS_TOKEN_FILE)")
		}
		if len(missing) > 0 {
			return nil, errors.New("HTTP: refusing to serve the console and /metrics on " + o.listen +
				", which other hosts can reach, without " + strings.Join(missing, " and ") +
				"; listen on 127.0.0.1, give them, or pass --http-insecure-open ($MILLRACE_HTTP_INSECURE_OPEN=true) if this is intended")
		}
	}
	return g, nil
}

// httpServer serves /metrics, /healthz, /readyz and what the command adds
// to its mux (the console, the APIs over HTTP).
type httpServer struct {
	*supervise.HTTPServer
	lis *netlimit.Listener
}

func startHTTP(ctx context.Context, o httpOptions, t *telemetry, ready func(context.Context) error, mux *http.ServeMux, log *slog.Logger) (*httpServer, error) {
	if mux == nil {
		mux = http.NewServeMux()
	}
	mux.Handle("GET /metrics", promhttp.HandlerFor(t.reg, promhttp.HandlerOpts{Registry: t.reg}))
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
	h, err := o.guard(ctx, t, mux, log)
	if err != nil {
		return nil, err
	}
	// No read or write timeout for whole requests: a reservation waits up
	// to a minute for its placement and a document body may be large. A
	// client still must send its headers promptly, may keep an idle
	// connection only so long, and may hold only so many.
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: o.idleTimeout, MaxHeaderBytes: 64 << 10}
	web := &httpServer{}
	s, err := supervise.NewHTTP(o.listen, srv, func(l net.Listener) (net.Listener, error) {
		var err error
		web.lis, err = netlimit.Wrap(l, netlimit.Config{Max: o.maxConns})
		return web.lis, err
	})
	if err != nil {
		return nil, fmt.Errorf("HTTP listen: %w", err)
	}
	web.HTTPServer = s
	log.Info("HTTP serving", "addr", s.Addr().String())
	return web, nil
}

// web is the process's HTTP server on its mux.
func (p *process) web(o httpOptions) supervise.Component {
	return supervise.Serve("HTTP", func(ctx context.Context) (*httpServer, error) {
		return startHTTP(ctx, o, p.t, p.readiness, p.mux, p.log)
	})
}
