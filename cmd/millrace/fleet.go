package main

import (
	"context"
	"errors"
	"flag"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/supervise"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	"github.com/millrace/millrace/projectors/placer"
	"github.com/millrace/millrace/services/fleet"
	"github.com/millrace/millrace/services/reservations"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// reservations serves the reservations API: over gRPC on its own listener
// and under /v1/reservations on the process's mux, UNAVAILABLE until the
// database is there. api loads the keys and listens, before the HTTP
// server so that the mux answers from its first request, and hands the
// edge the pool once there; grpc serves the calls, among the edges so
// that they stop first.
func (p *process) reservations(o reservations.Options) (api, grpc supervise.Component) {
	var e *reservations.Edge
	api = p.consumer("reservations API", func(ctx context.Context, pool *pgxpool.Pool) error {
		return e.Run(ctx, pool, p.bb.JS, p.bb.Conn)
	})
	api.Start = func(ctx context.Context) (err error) {
		if e, err = reservations.Start(ctx, o, p.t.reg, p.t.kf, p.log); err == nil {
			e.Mount(p.mux)
		}
		return err
	}
	grpc = supervise.Serve("reservations gRPC", func(context.Context) (*reservations.Edge, error) { return e, nil })
	return api, grpc
}

// gateway serves the fleet gateway.
func (p *process) gateway(o fleet.Options) supervise.Component {
	return supervise.Serve("fleet gateway", func(ctx context.Context) (*fleet.Gateway, error) {
		return fleet.Start(ctx, o, p.bb, p.t.reg, p.t.kf, p.log)
	})
}

// fleetProjectorOptions tune the liveness projector.
type fleetProjectorOptions struct {
	c  fleetproj.Config
	rc streams.RunnerConfig
}

func (o *fleetProjectorOptions) register(fs *flag.FlagSet) {
	envflag.Int(fs, &o.rc.Batch, "fleet-projector-batch", "MILLRACE_FLEET_PROJECTOR_BATCH", 1000, "most node messages applied in one transaction")
	envflag.Duration(fs, &o.rc.MaxWait, "fleet-projector-max-wait", "MILLRACE_FLEET_PROJECTOR_MAX_WAIT", 250*time.Millisecond, "how long a fetch waits to fill a batch of node messages")
	o.c.RegisterFlags(fs)
}

// projector makes the liveness projector; reg (nil: none) gets its
// counter of foreign allocation reports.
func (o *fleetProjectorOptions) projector(reg prometheus.Registerer, log *slog.Logger) (*fleetproj.Projector, error) {
	cfg := o.c
	cfg.Logger, cfg.ForeignReports = log, fleetproj.NewForeignReportsCounter(reg)
	if err := cfg.Validate(); err != nil {
		return nil, envflag.Usage(err.Error())
	}
	return fleetproj.New(cfg)
}

func (o *fleetProjectorOptions) runnerConfig(log *slog.Logger) streams.RunnerConfig {
	c := o.rc
	c.Stream, c.Filter = subjects.StreamFleetNodes, subjects.FleetNodeFilter
	// The projector ages nodes on the stream's clock as batches arrive;
	// the idle sweep covers a quiet stream.
	c.SweepEvery = 5 * time.Second
	c.Logger = log.With("component", "projector")
	return c
}

// placerOptions tune the placer.
type placerOptions struct {
	c  placer.Config
	rc streams.RunnerConfig
}

func (o *placerOptions) register(fs *flag.FlagSet) {
	envflag.Int(fs, &o.rc.Batch, "placer-batch", "MILLRACE_PLACER_BATCH", 500, "most reservation requests planned and committed in one transaction")
	envflag.Duration(fs, &o.rc.MaxWait, "placer-max-wait", "MILLRACE_PLACER_MAX_WAIT", 20*time.Millisecond, "how long requests may gather before the placer plans them (adds to the time to place)")
	o.c.RegisterFlags(fs)
	envflag.Duration(fs, &o.rc.SweepEvery, "placer-sweep-every", "MILLRACE_PLACER_SWEEP_EVERY", time.Second, "how often an idle placer retries pending reservations and applies its release policies (every 30s while nothing is pending, booked or fenced)")
}

func (o *placerOptions) config(log *slog.Logger) (placer.Config, error) {
	cfg := o.c
	cfg.Subject, cfg.Logger = subjects.FleetPlace, log.With("component", "placer")
	if err := cfg.Validate(); err != nil {
		return cfg, envflag.Usage(err.Error())
	}
	return cfg, nil
}

func (o *placerOptions) runnerConfig(log *slog.Logger) streams.RunnerConfig {
	c := o.rc
	c.Stream, c.Filter = subjects.StreamFleetResv, subjects.FleetResvFilter
	c.Logger = log.With("component", "projector")
	return c
}

// placer runs the placer's consumer and the outbox relay that publishes
// its decisions.
func (p *process) placer(cfg placer.Config, o placerOptions) supervise.Component {
	return p.consumer(placer.ConsumerName, func(ctx context.Context, pool *pgxpool.Pool) error {
		pl, err := placer.New(cfg)
		if err != nil {
			return err
		}
		relay, err := streams.NewOutbox(pool, p.bb.Publisher(), streams.OutboxConfig{Registerer: p.t.reg, Metrics: p.t.sm, Logger: p.log})
		if err != nil {
			return err
		}
		r, err := streams.NewRunner(p.bb.JS, pool, pl, o.runnerConfig(p.log), p.t.sm)
		if err != nil {
			return err
		}
		done := make(chan error, 1)
		go func() { done <- relay.Run(ctx) }()
		err = r.Run(ctx)
		if rerr := <-done; err == nil && !errors.Is(rerr, context.Canceled) {
			err = rerr
		}
		return err
	})
}
