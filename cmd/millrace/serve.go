package main

import (
	"context"
	"flag"
	"log/slog"
	"net/http"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
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
				lo       logOptions
				no       natsOptions
				bo       besOptions
				ho       httpOptions
				shutdown time.Duration
			)
			lo.register(fs)
			no.register(fs)
			bo.register(fs)
			ho.register(fs, "127.0.0.1:8080", "HTTP address: /metrics, /healthz, /readyz")
			envflag.Duration(fs, &shutdown, "shutdown-timeout", "MILLRACE_SHUTDOWN_TIMEOUT", 20*time.Second, "how long shutdown waits for open streams")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"serve bes takes no arguments"}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				return runEdgeProcess(ctx, "millrace-bes", no, ho, shutdown, log,
					func(ctx context.Context, bb *streams.Backbone, t *telemetry, _ *http.ServeMux) (servedEdge, error) {
						return startBES(ctx, bo, bb, t, log)
					})
			}
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
				lo logOptions
				no natsOptions
				do dbOptions
				po projectorOptions
				ho httpOptions
			)
			lo.register(fs)
			no.register(fs)
			do.register(fs)
			po.register(fs)
			ho.register(fs, "127.0.0.1:8081", "HTTP address: /metrics, /healthz, /readyz")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"project builds takes no arguments"}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				return runProjectorProcess(ctx, "millrace-project-builds", no, do, ho, log,
					func(ctx context.Context, bb *streams.Backbone, pool *pgxpool.Pool, t *telemetry) error {
						proj, err := builds.New(builds.Config{AbandonAfter: po.abandonAfter})
						if err != nil {
							return err
						}
						return streams.NewRunner(bb.JS, pool, proj, withLogger(po.runnerConfig(), log), t.sm).Run(ctx)
					})
			}
		},
	}
}

// servedEdge is an edge a serve command runs.
type servedEdge interface {
	// stop ends it, gracefully until ctx ends.
	stop(ctx context.Context)
	// serveDone yields the gRPC server's error if it stops by itself.
	serveDone() <-chan error
}

// runEdgeProcess is the body of a `serve` command: it opens the backbone as
// client name, starts the edge (which may add its HTTP API to mux), serves
// mux with /metrics, /healthz and /readyz on ho, and runs until ctx
// ends or the edge's server stops; shutdown bounds the graceful stop.
func runEdgeProcess(ctx context.Context, name string, no natsOptions, ho httpOptions, shutdown time.Duration, log *slog.Logger,
	start func(context.Context, *streams.Backbone, *telemetry, *http.ServeMux) (servedEdge, error)) error {
	t := newTelemetry()
	bb, _, err := no.open(ctx, name, t.sm)
	if err != nil {
		return err
	}
	defer bb.Close()
	mux := http.NewServeMux()
	edge, err := start(ctx, bb, t, mux)
	if err != nil {
		return err
	}
	web, err := startHTTP(ctx, ho, t, readiness(bb, nil), mux, log)
	if err != nil {
		edge.stop(ctx)
		return err
	}
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-edge.serveDone():
	}
	sctx, cancel := context.WithTimeout(context.Background(), shutdown)
	defer cancel()
	edge.stop(sctx)
	bb.Close()
	web.stop(sctx)
	return serveErr
}

// runProjectorProcess is the body of a `project` command: it opens the
// backbone as client name, connects to PostgreSQL (waiting while it is
// away), serves /metrics, /healthz and /readyz on ho, and runs run
// until ctx ends.
func runProjectorProcess(ctx context.Context, name string, no natsOptions, do dbOptions, ho httpOptions, log *slog.Logger,
	run func(context.Context, *streams.Backbone, *pgxpool.Pool, *telemetry) error) error {
	t := newTelemetry()
	bb, _, err := no.open(ctx, name, t.sm)
	if err != nil {
		return err
	}
	defer bb.Close()
	pool := connectWithRetry(ctx, do, log)
	if pool == nil {
		return ctx.Err()
	}
	defer pool.Close()
	web, err := startHTTP(ctx, ho, t, readiness(bb, func() *pgxpool.Pool { return pool }), nil, log)
	if err != nil {
		return err
	}
	defer web.stop(context.Background())
	return run(ctx, bb, pool, t)
}
