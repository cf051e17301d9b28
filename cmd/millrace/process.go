package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/netlimit"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
)

// procOptions are the flags of every command that runs until a signal.
type procOptions struct {
	log      logOptions
	nats     natsOptions
	http     httpOptions
	shutdown time.Duration
}

func (o *procOptions) register(fs *flag.FlagSet, httpListen, httpHelp, shutdownHelp string) {
	o.log.register(fs)
	o.nats.register(fs)
	o.http.register(fs, httpListen, httpHelp)
	envflag.Duration(fs, &o.shutdown, "shutdown-timeout", "MILLRACE_SHUTDOWN_TIMEOUT", supervise.DefaultShutdownTimeout, shutdownHelp)
}

// timeout is the shutdown's deadline (zero: the default).
func (o *procOptions) timeout() time.Duration {
	if o.shutdown == 0 {
		return supervise.DefaultShutdownTimeout
	}
	return o.shutdown
}

// process is what the components of one command share: the logger and the
// metrics, and what earlier components opened (the backbone, the pool, the
// bucket) for later ones.
type process struct {
	log   *slog.Logger
	t     *telemetry
	mux   *http.ServeMux
	begin time.Time
	bb    *streams.Backbone
	bk    *bucket.Bucket
	// pool is the database once connected; poolReady is closed then. db
	// says the process has a database (readiness waits for it).
	pool      atomic.Pointer[pgxpool.Pool]
	poolReady chan struct{}
	db        bool
	up        atomic.Bool // every component started, none stopping yet
}

// run makes the body of a long-running command named cmd: its backbone
// (as client), then the components that components makes, then its HTTP
// server and the edges, each started in order and stopped in reverse under
// one deadline (internal/supervise). components runs before anything
// starts, so that a bad configuration fails first; it returns the
// components that go before the HTTP server and those after it (the edges,
// which stop first).
func (o *procOptions) run(cmd, client string, components func(p *process) (before, after []supervise.Component, err error)) func(context.Context, []string) error {
	return func(ctx context.Context, args []string) error {
		if len(args) > 0 {
			return envflag.Usage(cmd + " takes no arguments")
		}
		log, err := o.log.logger()
		if err != nil {
			return err
		}
		p := &process{log: log, t: newTelemetry(), mux: http.NewServeMux(), begin: time.Now(), poolReady: make(chan struct{})}
		before, after, err := components(p)
		if err != nil {
			return err
		}
		all := append([]supervise.Component{p.backbone(o.nats, client)}, before...)
		all = append(append(append(all, p.web(o.http)), after...), p.ready())
		return supervise.Run(ctx, supervise.Config{ShutdownTimeout: o.shutdown, Logger: log}, all...)
	}
}

// backbone opens the backbone as client (starting the embedded server when
// no URL is set); its stop flushes what was published and closes it.
func (p *process) backbone(o natsOptions, client string) supervise.Component {
	return supervise.Component{
		Name: "backbone",
		Start: func(ctx context.Context) (err error) {
			if p.bb, _, err = o.open(ctx, client, p.t.sm); err != nil {
				return err
			}
			if p.bb.ReaderSeedFile != "" {
				p.log.Info("embedded NATS admits only its identities: read with nats --server "+p.bb.URL+" --nkey "+p.bb.ReaderSeedFile+" (millrace's own processes: --nkey "+p.bb.ServiceSeedFile+")",
					"file", p.bb.ReaderSeedFile)
			}
			return nil
		},
		Stop: func(context.Context) error { p.bb.Close(); return nil },
	}
}

// database connects to PostgreSQL (applying migrations) in the background,
// retrying while it is away, so that nothing waits for it but what needs
// it (awaitPool); the pool closes when the component stops, after every
// component started after it.
func (p *process) database(o dbOptions) supervise.Component {
	p.db = true
	return supervise.Component{
		Name: "database",
		Run: func(ctx context.Context) error {
			pool := database.Connect(ctx, o.config(true, p.log))
			if pool == nil {
				return nil // stopped first
			}
			p.pool.Store(pool)
			close(p.poolReady)
			<-ctx.Done()
			pool.Close()
			return nil
		},
	}
}

// awaitPool waits for the database; nil when ctx ends first.
func (p *process) awaitPool(ctx context.Context) *pgxpool.Pool {
	select {
	case <-p.poolReady:
		return p.pool.Load()
	case <-ctx.Done():
		return nil
	}
}

// openBucket opens the bucket the commit log is folded into.
func (p *process) openBucket(o bucketOptions) supervise.Component {
	return supervise.Component{
		Name:  "bucket",
		Start: func(ctx context.Context) (err error) { p.bk, err = o.open(ctx); return err },
		Stop:  func(context.Context) error { return p.bk.Close() },
	}
}

// consumer runs the consumer that run makes once the database is there,
// until the component stops.
func (p *process) consumer(name string, run func(ctx context.Context, pool *pgxpool.Pool) error) supervise.Component {
	return supervise.Component{Name: name, Run: func(ctx context.Context) error {
		pool := p.awaitPool(ctx)
		if pool == nil {
			return nil
		}
		return run(ctx, pool)
	}}
}

// projector runs a projector's consumer (streams.Runner) on rc.
func (p *process) projector(proj projection.Projector, rc streams.RunnerConfig) supervise.Component {
	return p.consumer(proj.Name(), func(ctx context.Context, pool *pgxpool.Pool) error {
		r, err := streams.NewRunner(p.bb.JS, pool, proj, rc, p.t.sm)
		if err != nil {
			return err
		}
		return r.Run(ctx)
	})
}

// ready is the last component: /readyz answers ready from its start, when
// every component before it serves, until the stop begins.
func (p *process) ready() supervise.Component {
	return supervise.Component{
		Name:  "ready",
		Start: func(context.Context) error { p.up.Store(true); return nil },
		Stop:  func(context.Context) error { p.up.Store(false); return nil },
	}
}

// readiness reports whether the process serves: every component started,
// the backbone connected and (when it has one) the database answering.
func (p *process) readiness(ctx context.Context) error {
	switch pool := p.pool.Load(); {
	case !p.up.Load():
		return errors.New("starting or stopping")
	case !p.bb.Conn.IsConnected():
		return errors.New("backbone disconnected")
	case p.db && pool == nil:
		return errors.New("database not connected yet")
	case p.db:
		if err := pool.Ping(ctx); err != nil {
			return fmt.Errorf("database: %w", err)
		}
	}
	return nil
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
	return g, g.CheckExposure(o.listen, o.insecureOpen)
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
