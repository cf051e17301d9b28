package main

import (
	"context"
	"errors"
	"flag"
	"log/slog"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/cli"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/logs"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/internal/web"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// procOptions are the flags of every command that runs until a signal.
type procOptions struct {
	log      logs.Options
	nats     streams.Options
	http     web.Options
	shutdown time.Duration
}

func (o *procOptions) register(fs *flag.FlagSet, httpListen, httpHelp, shutdownHelp string) {
	o.log.RegisterFlags(fs)
	o.nats.RegisterFlags(fs)
	o.http.RegisterFlags(fs, httpListen, httpHelp)
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
	// layout is how the backbone keeps build events, as the flags say
	// (bb.Layout once it is open, which refuses another).
	layout subjects.BESLayout
	bk     *bucket.Bucket
	// db is the database, connected in the background; hasDB says the
	// process has one (readiness waits for it).
	db    database.Late
	hasDB bool
	// durables are the durable consumers of the components that the flags
	// name (the fold's): the backbone keeps them off its reader identity
	// with serviceConsumers.
	durables []string
	up       atomic.Bool // every component started, none stopping yet
	// stopping closes as the stop begins (the console's live pages end).
	stopping chan struct{}
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
		if err := cli.NoArgs(cmd, args); err != nil {
			return err
		}
		log, err := o.log.Logger()
		if err != nil {
			return err
		}
		p := &process{log: log, t: newTelemetry(), mux: http.NewServeMux(), begin: time.Now(), stopping: make(chan struct{}),
			layout: subjects.BESLayout{Partitions: o.nats.BESPartitions}}
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
// no URL is set), its reader kept off millrace's durables and the
// components'; its stop flushes what was published and closes it.
func (p *process) backbone(o streams.Options, client string) supervise.Component {
	return supervise.Component{
		Name: "backbone",
		Start: func(ctx context.Context) (err error) {
			if p.bb, _, err = o.Open(ctx, client, append(serviceConsumers(), p.durables...), p.t.sm); err != nil {
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
// it (database.Late); the pool closes when the component stops, after
// every component started after it.
func (p *process) database(o database.Options) supervise.Component {
	p.hasDB = true
	return supervise.Component{Name: "database", Run: func(ctx context.Context) error { return p.db.Run(ctx, o.Config(true, p.log)) }}
}

// openBucket opens the bucket the commit log is folded into.
func (p *process) openBucket(o bucket.Options) supervise.Component {
	return supervise.Component{
		Name:  "bucket",
		Start: func(ctx context.Context) (err error) { p.bk, err = o.Open(ctx); return err },
		Stop:  func(context.Context) error { return p.bk.Close() },
	}
}

// consumer runs the consumer that run makes once the database is there,
// until the component stops.
func (p *process) consumer(name string, run func(ctx context.Context, pool *pgxpool.Pool) error) supervise.Component {
	return supervise.Component{Name: name, Run: func(ctx context.Context) error {
		pool := p.db.Await(ctx)
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
// every component before it serves, until the stop begins, which it
// announces (stopping).
func (p *process) ready() supervise.Component {
	return supervise.Component{
		Name:  "ready",
		Start: func(context.Context) error { p.up.Store(true); return nil },
		Stop:  func(context.Context) error { p.up.Store(false); close(p.stopping); return nil },
	}
}

// readiness reports whether the process serves: every component started,
// the backbone connected and (when it has one) the database answering.
func (p *process) readiness(ctx context.Context) error {
	switch {
	case !p.up.Load():
		return errors.New("starting or stopping")
	case !p.bb.Conn.IsConnected():
		return errors.New("backbone disconnected")
	case p.hasDB:
		return p.db.Ping(ctx)
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

// web is the process's HTTP server on its mux.
func (p *process) web(o web.Options) supervise.Component {
	return supervise.Serve("HTTP", func(ctx context.Context) (*web.Server, error) {
		return web.Start(ctx, o, p.mux, p.readiness, p.t.reg, p.t.kf, p.log)
	})
}
