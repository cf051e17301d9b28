package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"runtime/debug"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/gcpace"
	"github.com/millrace/millrace/internal/logs"
	"github.com/millrace/millrace/internal/resources"
	"github.com/millrace/millrace/internal/supervise"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	"github.com/millrace/millrace/projectors/placer"
	"github.com/millrace/millrace/services/fleet"
	"github.com/millrace/millrace/services/reservations"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

func serveFleetCommand() command {
	return command{
		Name:    "serve fleet",
		Summary: "run a fleet gateway (GPU node sessions over mTLS)",
		Long: `Holds GPU nodes' sessions (gRPC, mTLS with node certificates from the fleet CA
or from Join), publishes their transitions and batched heartbeat ages to
FLEET_NODES, and delivers placement decisions to the nodes as bind commands.
Run several instances, each with its own --fleet-gateway-id and the same CA:
a node whose gateway goes away re-homes through any other.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po       procOptions
				fo       fleet.Options
				memLimit string
			)
			po.register(fs, "127.0.0.1:8082", "HTTP address: /metrics, /healthz, /readyz", "how long shutdown waits for sessions to move away")
			fo.RegisterFlags(fs)
			envflag.String(fs, &memLimit, "memory-limit", "MILLRACE_FLEET_MEMORY_LIMIT", "960MiB", "soft limit of the gateway's memory (Go's GOMEMLIMIT, which wins when set): about 50 KiB per session plus 30 MiB; off: none")
			return po.run("serve fleet", "millrace-fleet", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				if err := gatewayMemory(memLimit); err != nil {
					return nil, nil, err
				}
				return nil, []supervise.Component{p.gateway(fo)}, nil
			})
		},
	}
}

// gatewayMemory sets the garbage collector for a gateway, whose memory is
// its sessions' live data.
func gatewayMemory(limit string) error {
	// main's pacing (set for the event edges' CPU) would let a small heap
	// grow to nine times the live data. GOGC in the environment still wins.
	if os.Getenv("GOGC") == "" {
		gcpace.Stop()
		debug.SetGCPercent(100)
	}
	// At GOGC=100 alone a gateway holds about 63 KiB per session, mostly
	// garbage not yet collected: 19,000 sessions took 1.2 GiB. A soft limit
	// makes the collector run as the limit nears (at 10 s heartbeats the
	// garbage is little): 960 MiB held 19,000 sessions in 959 MiB for a
	// tenth more CPU.
	if os.Getenv("GOMEMLIMIT") == "" {
		n, err := envflag.ParseMemoryLimit(limit)
		if err != nil {
			return envflag.Usage("--memory-limit ($MILLRACE_FLEET_MEMORY_LIMIT): " + err.Error())
		}
		if n > 0 {
			debug.SetMemoryLimit(n)
		}
	}
	return nil
}

func serveReservationsCommand() command {
	return command{
		Name:    "serve reservations",
		Summary: "run the GPU reservations API (gRPC and JSON over HTTP)",
		Long: `Creates, reads, lists and cancels GPU reservations. Requests and cancellations
are published to FLEET_RESV (fleet.resv.<pool>); reads come from PostgreSQL.
gRPC on --reservations-listen, JSON under /v1/reservations on --http-listen.
Every call needs an API key (authorization: Bearer KEY).`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				do database.Options
				ro reservations.Options
			)
			po.register(fs, "127.0.0.1:8083", "HTTP address: /v1/reservations, /metrics, /healthz, /readyz", "how long shutdown waits for calls to finish")
			do.RegisterFlags(fs)
			ro.RegisterFlags(fs)
			return po.run("serve reservations", "millrace-reservations", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				api, grpc := p.reservations(ro)
				return []supervise.Component{p.database(do), api}, []supervise.Component{grpc}, nil
			})
		},
	}
}

func projectFleetCommand() command {
	return command{
		Name:    "project fleet",
		Summary: "run the node liveness projector (FLEET_NODES -> PostgreSQL)",
		Long: `Consumes FLEET_NODES into PostgreSQL: nodes, their GPUs, allocation reports and
liveness (healthy -> suspect -> unreachable as a node goes unheard). Several
instances may run: one applies, the others stand by.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				do database.Options
				fo fleetProjectorOptions
			)
			po.register(fs, "127.0.0.1:8084", "HTTP address: /metrics, /healthz, /readyz", "how long shutdown waits for the batch in progress to commit or roll back")
			do.RegisterFlags(fs)
			fo.register(fs)
			return po.run("project fleet", "millrace-project-fleet", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				proj, err := fo.projector(p.t.reg, p.log)
				if err != nil {
					return nil, nil, err
				}
				return []supervise.Component{p.database(do), p.projector(proj, fo.runnerConfig(p.log))}, nil, nil
			})
		},
	}
}

func projectPlacerCommand() command {
	return command{
		Name:    "project placer",
		Summary: "run the GPU placer (FLEET_RESV -> bookings -> FLEET_PLACE)",
		Long: `Consumes reservation requests (FLEET_RESV), plans them in batches against an
in-memory index of each pool, books GPUs in PostgreSQL with guarded statements
(a constraint makes a double booking impossible) and publishes each decision
to FLEET_PLACE through a transactional outbox. Releases reservations on
unreachable nodes and unconfirmed binds and places them again. Several
instances may run: one places, the others stand by.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				do database.Options
				lo placerOptions
			)
			po.register(fs, "127.0.0.1:8085", "HTTP address: /metrics, /healthz, /readyz", "how long shutdown waits for the batch in progress to commit or roll back")
			do.RegisterFlags(fs)
			lo.register(fs)
			return po.run("project placer", "millrace-placer", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				cfg, err := lo.config(p.log)
				if err != nil {
					return nil, nil, err
				}
				return []supervise.Component{p.database(do), p.placer(cfg, lo)}, nil, nil
			})
		},
	}
}

func replayFleetCommand() command {
	return command{
		Name:    "replay fleet",
		Summary: "rebuild nodes, reservations and bookings from the fleet streams",
		Long: `Empties the fleet projections and applies the streams again: nodes, GPUs and
liveness from FLEET_NODES, reservations from FLEET_RESV, and allocations and
bookings from the placement decisions in FLEET_PLACE. The result equals what
the live run built. Stop the liveness projector and the placer first (replay
refuses while either holds its lock); replay publishes whatever the placer
left in its outbox before it starts.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo logs.Options
				ro resources.Options
				fo fleetProjectorOptions
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Backbone|resources.Migrated)
			fo.register(fs)
			return once("replay fleet", &lo, func(ctx context.Context, log *slog.Logger) error {
				proj, err := fo.projector(nil, log)
				if err != nil {
					return err
				}
				return ro.Run(ctx, "millrace-replay-fleet", serviceConsumers(), log, func(r *resources.Opened) error {
					return replayFleet(ctx, r.BB, r.Pool, proj, fo.runnerConfig(log), log)
				})
			})
		},
	}
}

// replayFleet holds the live placer's lock for the whole replay (so that
// nothing places while the bookings are rebuilt), flushes the outbox into
// FLEET_PLACE, and replays the three streams one after the other. Each
// table is written from one stream only, so their order does not matter.
func replayFleet(ctx context.Context, bb *streams.Backbone, pool *pgxpool.Pool, proj *fleetproj.Projector, rc streams.RunnerConfig, log *slog.Logger) error {
	held, err := streams.ConsumerLease(pool, placer.ConsumerName).Acquire(ctx)
	if errors.Is(err, streams.ErrLocked) {
		return errors.New("the placer is running (it holds its lock): stop it, replay, then start it again")
	}
	if err != nil {
		return err
	}
	defer func() {
		rctx, cancel := context.WithTimeout(context.Background(), streams.ReleaseTimeout)
		defer cancel()
		held.Release(rctx)
	}()

	relay, _ := streams.NewOutbox(pool, bb.Publisher(), streams.OutboxConfig{Logger: log}) // no field to refuse
	if err := relay.Flush(ctx); err != nil {
		return fmt.Errorf("publish the placer's outbox: %w", err)
	}
	steps := []struct {
		what   string
		stream string
		filter string
		p      projection.Projector
	}{
		{"nodes", subjects.StreamFleetNodes, subjects.FleetNodeFilter, proj},
		{"reservations", subjects.StreamFleetResv, subjects.FleetResvFilter, placer.NewRequests()},
		{"decisions", subjects.StreamFleetPlace, subjects.FleetPlaceFilter, placer.NewDecisions()},
	}
	for _, s := range steps {
		c := rc
		c.Stream, c.Filter = s.stream, s.filter
		if err := replayStream(ctx, bb, pool, s.p, c, streams.StaticPlan(projection.ReplayPlan{}), "replay fleet "+s.what, "messages"); err != nil {
			return fmt.Errorf("replay %s: %w", s.what, err)
		}
		if s.p.Name() != proj.Name() {
			// The replay consumers of FLEET_RESV and FLEET_PLACE have no live
			// use; leave nothing behind that would pin those streams.
			if err := bb.JS.DeleteConsumer(ctx, s.stream, s.p.Name()); err != nil && !errors.Is(err, jetstream.ErrConsumerNotFound) {
				log.Warn("replay consumer not deleted", "consumer", s.p.Name(), "err", err)
			}
		}
	}
	return nil
}
