package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"os"
	"runtime/debug"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/envflag"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	"github.com/millrace/millrace/projectors/placer"
	"github.com/millrace/millrace/services/reservations"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

func serveFleetCommand() command {
	return command{
		name:    "serve fleet",
		summary: "run a fleet gateway (GPU node sessions over mTLS)",
		long: `Holds GPU nodes' sessions (gRPC, mTLS with node certificates from the fleet CA
or from Join), publishes their transitions and batched heartbeat ages to
FLEET_NODES, and delivers placement decisions to the nodes as bind commands.
Run several instances, each with its own --fleet-gateway-id and the same CA:
a node whose gateway goes away re-homes through any other.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo       logOptions
				no       natsOptions
				fo       fleetOptions
				ho       httpOptions
				memLimit string
				shutdown time.Duration
			)
			lo.register(fs)
			no.register(fs)
			fo.register(fs)
			ho.register(fs, "127.0.0.1:8082", "HTTP address: /metrics, /healthz, /readyz")
			envflag.String(fs, &memLimit, "memory-limit", "MILLRACE_FLEET_MEMORY_LIMIT", "960MiB", "soft limit of the gateway's memory (Go's GOMEMLIMIT, which wins when set): about 50 KiB per session plus 30 MiB; off: none")
			envflag.Duration(fs, &shutdown, "shutdown-timeout", "MILLRACE_SHUTDOWN_TIMEOUT", 20*time.Second, "how long shutdown waits for sessions to move away")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"serve fleet takes no arguments"}
				}
				// A gateway's memory is its sessions' live data; main's GOGC=400
				// (set for the event edges' CPU) would let the heap grow to five
				// times it. GOGC in the environment still wins.
				if os.Getenv("GOGC") == "" {
					debug.SetGCPercent(100)
				}
				// At GOGC=100 alone a gateway holds about 63 KiB per session,
				// mostly garbage not yet collected: 19,000 sessions took
				// 1.2 GiB. A soft limit makes the collector run as the limit
				// nears (at 10 s heartbeats the garbage is little): 960 MiB
				// held 19,000 sessions in 959 MiB for a tenth more CPU.
				if os.Getenv("GOMEMLIMIT") == "" {
					n, err := envflag.ParseMemoryLimit(memLimit)
					if err != nil {
						return usageError{"--memory-limit ($MILLRACE_FLEET_MEMORY_LIMIT): " + err.Error()}
					}
					if n > 0 {
						debug.SetMemoryLimit(n)
					}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				return runEdgeProcess(ctx, "millrace-fleet", no, ho, shutdown, log,
					func(ctx context.Context, bb *streams.Backbone, t *telemetry, _ *http.ServeMux) (servedEdge, error) {
						return startFleet(ctx, fo, "", bb, t, log)
					})
			}
		},
	}
}

func serveReservationsCommand() command {
	return command{
		name:    "serve reservations",
		summary: "run the GPU reservations API (gRPC and JSON over HTTP)",
		long: `Creates, reads, lists and cancels GPU reservations. Requests and cancellations
are published to FLEET_RESV (fleet.resv.<pool>); reads come from PostgreSQL.
gRPC on --reservations-listen, JSON under /v1/reservations on --http-listen.
Every call needs an API key (authorization: Bearer KEY).`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo       logOptions
				no       natsOptions
				do       dbOptions
				ro       reservationsOptions
				ho       httpOptions
				shutdown time.Duration
			)
			lo.register(fs)
			no.register(fs)
			do.register(fs)
			ro.register(fs)
			ho.register(fs, "127.0.0.1:8083", "HTTP address: /v1/reservations, /metrics, /healthz, /readyz")
			envflag.Duration(fs, &shutdown, "shutdown-timeout", "MILLRACE_SHUTDOWN_TIMEOUT", 20*time.Second, "how long shutdown waits for calls to finish")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"serve reservations takes no arguments"}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				t := newTelemetry()
				cfg, err := ro.config(ctx, t, "", log)
				if err != nil {
					return err
				}
				bb, _, err := no.open(ctx, "millrace-reservations", t.sm)
				if err != nil {
					return err
				}
				defer bb.Close()
				pool := connectWithRetry(ctx, do, log)
				if pool == nil {
					return ctx.Err()
				}
				defer pool.Close()
				var api reservations.Late
				if err := startReservations(&api, cfg, pool, bb, t, log); err != nil {
					return err
				}
				defer api.Close()
				rg, err := startReservationsGRPC(ro, &api, log)
				if err != nil {
					return err
				}
				mux := http.NewServeMux()
				api.Register(nil, mux)
				web, err := startHTTP(ctx, ho, t, readiness(bb, func() *pgxpool.Pool { return pool }), mux, log)
				if err != nil {
					rg.stop(ctx)
					return err
				}
				var serveErr error
				select {
				case <-ctx.Done():
				case serveErr = <-rg.done:
				}
				sctx, cancel := context.WithTimeout(context.Background(), shutdown)
				defer cancel()
				api.Close() // waiting calls answer now
				rg.stop(sctx)
				web.stop(sctx)
				return serveErr
			}
		},
	}
}

func projectFleetCommand() command {
	return command{
		name:    "project fleet",
		summary: "run the node liveness projector (FLEET_NODES -> PostgreSQL)",
		long: `Consumes FLEET_NODES into PostgreSQL: nodes, their GPUs, allocation reports and
liveness (healthy -> suspect -> unreachable as a node goes unheard). Several
instances may run: one applies, the others stand by.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo logOptions
				no natsOptions
				do dbOptions
				po fleetProjectorOptions
				ho httpOptions
			)
			lo.register(fs)
			no.register(fs)
			do.register(fs)
			po.register(fs)
			ho.register(fs, "127.0.0.1:8084", "HTTP address: /metrics, /healthz, /readyz")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"project fleet takes no arguments"}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				if _, err := po.projector(log, nil); err != nil {
					return err // a bad configuration fails before anything starts
				}
				return runProjectorProcess(ctx, "millrace-project-fleet", no, do, ho, log,
					func(ctx context.Context, bb *streams.Backbone, pool *pgxpool.Pool, t *telemetry) error {
						proj, err := po.projector(log, t.reg)
						if err != nil {
							return err
						}
						return streams.NewRunner(bb.JS, pool, proj, po.runnerConfig(log), t.sm).Run(ctx)
					})
			}
		},
	}
}

func projectPlacerCommand() command {
	return command{
		name:    "project placer",
		summary: "run the GPU placer (FLEET_RESV -> bookings -> FLEET_PLACE)",
		long: `Consumes reservation requests (FLEET_RESV), plans them in batches against an
in-memory index of each pool, books GPUs in PostgreSQL with guarded statements
(a constraint makes a double booking impossible) and publishes each decision
to FLEET_PLACE through a transactional outbox. Releases reservations on
unreachable nodes and unconfirmed binds and places them again. Several
instances may run: one places, the others stand by.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo logOptions
				no natsOptions
				do dbOptions
				po placerOptions
				ho httpOptions
			)
			lo.register(fs)
			no.register(fs)
			do.register(fs)
			po.register(fs)
			ho.register(fs, "127.0.0.1:8085", "HTTP address: /metrics, /healthz, /readyz")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"project placer takes no arguments"}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				cfg, err := po.config(log)
				if err != nil {
					return err
				}
				return runProjectorProcess(ctx, "millrace-placer", no, do, ho, log,
					func(ctx context.Context, bb *streams.Backbone, pool *pgxpool.Pool, t *telemetry) error {
						return runPlacer(ctx, cfg, po, bb, pool, t, log)
					})
			}
		},
	}
}

func replayFleetCommand() command {
	return command{
		name:    "replay fleet",
		summary: "rebuild nodes, reservations and bookings from the fleet streams",
		long: `Empties the fleet projections and applies the streams again: nodes, GPUs and
liveness from FLEET_NODES, reservations from FLEET_RESV, and allocations and
bookings from the placement decisions in FLEET_PLACE. The result equals what
the live run built. Stop the liveness projector and the placer first (replay
refuses while either holds its lock); replay publishes whatever the placer
left in its outbox before it starts.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo logOptions
				no natsOptions
				do dbOptions
				fo fleetProjectorOptions
			)
			lo.register(fs)
			no.register(fs)
			do.register(fs)
			fo.register(fs)
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"replay fleet takes no arguments"}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				proj, err := fo.projector(log, nil)
				if err != nil {
					return err
				}
				bb, _, err := no.open(ctx, "millrace-replay-fleet", nil)
				if err != nil {
					return err
				}
				defer bb.Close()
				pool, err := openPool(ctx, do, true, log)
				if err != nil {
					return err
				}
				defer pool.Close()
				return replayFleet(ctx, bb, pool, proj, fo.runnerConfig(log), log)
			}
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

	relay := streams.NewOutbox(pool, bb.Publisher(), streams.OutboxConfig{Logger: log})
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
		st, err := bb.JS.Stream(ctx, s.stream)
		if err != nil {
			return fmt.Errorf("stream %s: %w", s.stream, err)
		}
		total := st.CachedInfo().State.LastSeq
		start := time.Now()
		c := rc
		c.Stream, c.Filter = s.stream, s.filter
		c.Progress = replayProgress("replay fleet "+s.what, "messages", total)
		err = streams.NewRunner(bb.JS, pool, s.p, c, nil).Replay(ctx)
		if errors.Is(err, streams.ErrLocked) {
			return fmt.Errorf("the %s projector is running (it holds its lock): stop it, replay, then start it again", s.p.Name())
		}
		if err != nil {
			return fmt.Errorf("replay %s: %w", s.what, err)
		}
		fmt.Fprintf(os.Stderr, "\rreplay fleet %s: %d messages in %s\n", s.what, total, time.Since(start).Round(time.Millisecond))
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
