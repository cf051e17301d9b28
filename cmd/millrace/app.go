package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/millrace/millrace/internal/devdb"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/netlimit"
	"github.com/millrace/millrace/internal/tlsfiles"
	"github.com/millrace/millrace/migrations"
	"github.com/millrace/millrace/services/bes"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// devDatabase is the database the development defaults create and use.
const devDatabase = "millrace"

// databaseURL returns DATABASE_URL, or the development default: database
// "millrace" on the server devdb finds (created when missing).
func databaseURL(ctx context.Context, o dbOptions, log *slog.Logger) (string, error) {
	if o.url != "" {
		return o.url, nil
	}
	srv, err := devdb.Find(ctx, o.dir)
	if err != nil {
		return "", fmt.Errorf("no DATABASE_URL and no development database: %w", err)
	}
	if srv.Private {
		log.Info("using the private PostgreSQL cluster", "dir", srv.DataDir())
	}
	return srv.EnsureDatabase(ctx, devDatabase)
}

// openPool connects to the database and, when migrate is set, brings its
// schema up to date first.
func openPool(ctx context.Context, o dbOptions, migrate bool, log *slog.Logger) (*pgxpool.Pool, error) {
	url, err := databaseURL(ctx, o, log)
	if err != nil {
		return nil, err
	}
	if migrate {
		from, to, err := migrations.ApplyURL(ctx, url)
		if err != nil {
			return nil, err
		}
		if from != to {
			log.Info("migrated the database", "from", from, "to", to)
		}
	}
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		return nil, fmt.Errorf("database URL: %w", err)
	}
	// millrace's statements are short and run thousands of times; a
	// planner estimate over jit_above_cost made PostgreSQL JIT-compile the
	// fleet sweep (~240 ms each time for a 2 ms statement). A URL that sets
	// jit itself wins.
	if _, ok := cfg.ConnConfig.RuntimeParams["jit"]; !ok {
		cfg.ConnConfig.RuntimeParams["jit"] = "off"
	}
	pool, err := pgxpool.NewWithConfig(ctx, cfg)
	if err != nil {
		return nil, fmt.Errorf("database: %w", err)
	}
	return pool, nil
}

// telemetry is the process's metrics registry and the backbone's metrics.
type telemetry struct {
	reg *prometheus.Registry
	sm  *streams.Metrics
	kf  *keyfile.Metrics
}

func newTelemetry() *telemetry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return &telemetry{reg: reg, sm: streams.NewMetrics(reg), kf: keyfile.NewMetrics(reg)}
}

// besEdge is a running BES gRPC server.
type besEdge struct {
	grpc *grpc.Server
	addr net.Addr
	done chan error
}

// startBES listens on o.listen and serves the BES edge on bb.
func startBES(ctx context.Context, o besOptions, bb *streams.Backbone, t *telemetry, log *slog.Logger) (*besEdge, error) {
	cfg, err := o.config(ctx, t, log)
	if err != nil {
		return nil, err
	}
	if err := cfg.Validate(bb.Conn.MaxPayload()); err != nil {
		return nil, err
	}
	stream, err := bb.JS.Stream(ctx, subjects.StreamBES)
	if err != nil {
		return nil, fmt.Errorf("BES stream: %w", err)
	}
	if err := bes.CheckExposure(o.listen, cfg.Keys.Len(), o.insecureOpen); err != nil {
		return nil, err
	}
	if cfg.Keys.Len() == 0 && o.insecureOpen && !netlimit.IsLoopback(o.listen) {
		log.Warn("BES edge open to every client: no API keys and --bes-insecure-open", "addr", o.listen)
	}
	m := bes.NewMetrics(t.reg)
	srv, err := bes.New(cfg, bb.Publisher(), stream, m, log.With("service", "bes"))
	if err != nil {
		return nil, err
	}
	opts := srv.ServerOptions()
	creds, err := serverTLS(o.tlsCert, o.tlsKey, "--bes-tls-cert", "--bes-tls-key")
	if err != nil {
		return nil, err
	}
	if creds != nil {
		opts = append(opts, creds)
	}
	g := grpc.NewServer(opts...)
	srv.Register(g)
	lis, err := net.Listen("tcp", o.listen)
	if err != nil {
		return nil, fmt.Errorf("BES listen: %w", err)
	}
	capped, err := netlimit.Wrap(lis, netlimit.Config{PerAddr: o.connsPerAddr, ExemptLoopback: true, OnRefuse: m.RefusedConnection})
	if err != nil {
		lis.Close()
		return nil, err
	}
	e := &besEdge{grpc: g, addr: lis.Addr(), done: make(chan error, 1)}
	go func() { e.done <- g.Serve(capped) }()
	log.Info("BES edge serving", "addr", lis.Addr().String(), "api_keys", cfg.Keys.Len(), "tls", creds != nil, "redaction", !cfg.NoRedaction)
	if cfg.NoRedaction {
		log.Warn("BES redaction is off (MILLRACE_BES_REDACT=false): build events are stored with the secrets Bazel sent")
	}
	return e, nil
}

// serverTLS loads a PEM certificate and key for a gRPC server; both empty
// is plaintext (nil). certFlag and keyFlag name the flags in errors.
func serverTLS(cert, key, certFlag, keyFlag string) (grpc.ServerOption, error) {
	tc, err := tlsfiles.Server(cert, key)
	switch {
	case errors.Is(err, tlsfiles.ErrHalfPair):
		return nil, usageError{certFlag + " and " + keyFlag + " go together"}
	case err != nil:
		return nil, fmt.Errorf("%s: %w", certFlag, err)
	case tc == nil:
		return nil, nil
	}
	return grpc.Creds(credentials.NewTLS(tc)), nil
}

// stop stops accepting streams and lets open ones finish (their acks
// drain) until ctx ends, then cuts them.
func (e *besEdge) stop(ctx context.Context) { stopGRPC(ctx, e.grpc) }

func (e *besEdge) serveDone() <-chan error { return e.done }

// stopGRPC stops g gracefully (no new calls, those in progress finish)
// until ctx ends, then cuts what is left.
func stopGRPC(ctx context.Context, g *grpc.Server) {
	done := make(chan struct{})
	go func() { g.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-ctx.Done():
		g.Stop()
		<-done
	}
}

// httpServer serves /metrics, /healthz, /readyz and the console.
type httpServer struct {
	srv  *http.Server
	addr net.Addr
	lis  *netlimit.Listener
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
	lis, err := net.Listen("tcp", o.listen)
	if err != nil {
		return nil, fmt.Errorf("HTTP listen: %w", err)
	}
	// No read or write timeout for whole requests: a reservation waits up
	// to a minute for its placement and a document body may be large. A
	// client still must send its headers promptly, may keep an idle
	// connection only so long, and may hold only so many.
	s := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, IdleTimeout: o.idleTimeout, MaxHeaderBytes: 64 << 10}
	capped, err := netlimit.Wrap(lis, netlimit.Config{Max: o.maxConns})
	if err != nil {
		lis.Close()
		return nil, err
	}
	go func() {
		if err := s.Serve(capped); err != nil && !errors.Is(err, http.ErrServerClosed) {
			log.Error("HTTP server stopped", "err", err)
		}
	}()
	log.Info("HTTP serving", "addr", lis.Addr().String())
	return &httpServer{srv: s, addr: lis.Addr(), lis: capped}, nil
}

func (h *httpServer) stop(ctx context.Context) { h.srv.Shutdown(ctx) }

// readiness reports whether the backbone and (if given) the database answer.
func readiness(bb *streams.Backbone, pool func() *pgxpool.Pool) func(context.Context) error {
	return func(ctx context.Context) error {
		if !bb.Conn.IsConnected() {
			return errors.New("backbone disconnected")
		}
		if pool != nil {
			p := pool()
			if p == nil {
				return errors.New("database not connected yet")
			}
			if err := p.Ping(ctx); err != nil {
				return fmt.Errorf("database: %w", err)
			}
		}
		return nil
	}
}
