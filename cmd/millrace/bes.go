package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"time"

	"github.com/millrace/millrace/internal/netlimit"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/services/bes"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

func serveBESCommand() command {
	return command{
		name:    "serve bes",
		summary: "run the Build Event Service edge (Bazel --bes_backend)",
		long: `Serves google.devtools.build.v1.PublishBuildEvent and publishes every event to
JetStream (bes.<project>.<invocation>); an event is acknowledged to Bazel only
once stored. Several instances may run behind a balancer.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				bo besOptions
			)
			po.register(fs, "127.0.0.1:8080", "HTTP address: /metrics, /healthz, /readyz", "how long shutdown waits for open streams")
			bo.register(fs)
			return po.run("serve bes", "millrace-bes", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				return nil, []supervise.Component{p.bes(bo)}, nil
			})
		},
	}
}

func projectBuildsCommand() command {
	return command{
		name:    "project builds",
		summary: "run the builds projector (BES stream -> PostgreSQL)",
		long: `Consumes the BES stream into PostgreSQL: invocations, targets, tests, metrics,
build output and hourly rollups. Several instances may run: one applies, the
others stand by (a PostgreSQL advisory lock decides).`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				do dbOptions
				bo projectorOptions
			)
			po.register(fs, "127.0.0.1:8081", "HTTP address: /metrics, /healthz, /readyz", "how long shutdown waits for the batch in progress to commit or roll back")
			do.register(fs)
			bo.register(fs)
			return po.run("project builds", "millrace-project-builds", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				proj, err := p.buildsProjector(bo)
				return []supervise.Component{p.database(do), proj}, nil, err
			})
		},
	}
}

// buildsProjector runs the builds projector's consumer.
func (p *process) buildsProjector(o projectorOptions) (supervise.Component, error) {
	proj, err := builds.New(builds.Config{AbandonAfter: o.abandonAfter})
	if err != nil {
		return supervise.Component{}, usageError{err.Error()}
	}
	return p.projector(proj, withLogger(o.runnerConfig(), p.log)), nil
}

// bes serves the BES edge on the backbone.
func (p *process) bes(o besOptions) supervise.Component {
	return supervise.Serve("BES edge", func(ctx context.Context) (*supervise.GRPCServer, error) {
		s, err := startBES(ctx, o, p.bb, p.t, p.log)
		if err == nil {
			p.log.Info("accepting build events", "after", time.Since(p.begin).Round(time.Millisecond))
		}
		return s, err
	})
}

// startBES listens on o.listen for the BES edge on bb.
func startBES(ctx context.Context, o besOptions, bb *streams.Backbone, t *telemetry, log *slog.Logger) (*supervise.GRPCServer, error) {
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
	tc, err := serverTLS(o.tlsCert, o.tlsKey, "--bes-tls-cert", "--bes-tls-key")
	if err != nil {
		return nil, err
	}
	m := bes.NewMetrics(t.reg)
	srv, err := bes.New(cfg, bb.Publisher(), stream, m, log.With("service", "bes"))
	if err != nil {
		return nil, err
	}
	g, err := supervise.NewGRPC(supervise.GRPCConfig{Addr: o.listen, TLS: tc, Options: srv.ServerOptions(),
		Listener: func(l net.Listener) (net.Listener, error) {
			return netlimit.Wrap(l, netlimit.Config{PerAddr: o.connsPerAddr, ExemptLoopback: true, OnRefuse: m.RefusedConnection})
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
