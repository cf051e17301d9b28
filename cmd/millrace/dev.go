package main

import (
	"context"
	"flag"
	"log/slog"
	"net/http"
	"path/filepath"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/services/reservations"
	"github.com/millrace/millrace/streams"
)

func devCommand() command {
	return command{
		name:    "dev",
		summary: "run the whole system in one process on embedded defaults",
		long: `Starts an embedded JetStream server (or uses $MILLRACE_NATS_URL), finds or starts
PostgreSQL (or uses $DATABASE_URL), applies migrations, and runs the BES edge,
the builds projector, the fleet gateway (mTLS, :1986), the reservations API
(:1988 and /v1/reservations), the liveness projector, the placer, the commits
API (:1987 and /v1/worlds/), the compactor (folding the commit log into
--bucket-url), the Kafka export when --kafka-brokers is set (see
millrace export kafka) and the HTTP console (/metrics, /healthz, /readyz).
Point Bazel at it with: bazel build --bes_backend=grpc://127.0.0.1:1985 //...
Without configured secrets, dev makes a CA in --fleet-ca-dir (var/fleet/ca)
and, beside it, a join token for pool "default" (var/fleet/join-tokens) and a
reservation API key for owner "dev" (var/fleet/api-keys) and a commits API key
for every world (var/fleet/commits-api-keys). The embedded NATS server admits
only two nkey identities it makes in --nats-dir/auth: service.nk (millrace's
processes; pass it as --nats-nkey to a process on dev's backbone) and
reader.nk (read-only: nats --nkey var/nats/auth/reader.nk stream ls).`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var o devOptions
			o.register(fs)
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"dev takes no arguments"}
				}
				return runDev(ctx, o)
			}
		},
	}
}

type devOptions struct {
	log       logOptions
	nats      natsOptions
	db        dbOptions
	bes       besOptions
	projector projectorOptions
	fleet     fleetOptions
	resv      reservationsOptions
	fleetProj fleetProjectorOptions
	placer    placerOptions
	commits   commitsOptions
	bucket    bucketOptions
	compactor compactorOptions
	kafka     kafkaOptions
	http      httpOptions
	shutdown  time.Duration
}

func (o *devOptions) register(fs *flag.FlagSet) {
	o.log.register(fs)
	o.nats.register(fs)
	o.db.register(fs)
	o.bes.register(fs)
	o.projector.register(fs)
	o.fleet.register(fs)
	o.resv.register(fs)
	o.fleetProj.register(fs)
	o.placer.register(fs)
	o.commits.register(fs)
	o.bucket.register(fs)
	o.compactor.register(fs)
	o.kafka.register(fs)
	o.http.register(fs, "127.0.0.1:8080", "HTTP address: console, /metrics, /healthz, /readyz")
	envflag.Duration(fs, &o.shutdown, "shutdown-timeout", "MILLRACE_SHUTDOWN_TIMEOUT", 20*time.Second, "how long shutdown waits for streams to finish and batches to commit")
}

func runDev(ctx context.Context, o devOptions) error {
	log, err := o.log.logger()
	if err != nil {
		return err
	}
	// Checked before anything starts. Passes in flight get half the
	// shutdown timeout: the rest is for what stops after the compactor.
	compactorRC, compactorCC, err := o.compactor.config(o.shutdown/2, o.kafka, log)
	if err != nil {
		return err
	}
	t := newTelemetry()
	start := time.Now()

	// The edge comes first: Bazel's retries span about 9 s, so a restarted
	// edge must serve again within seconds, whatever the database is doing.
	bb, _, err := o.nats.open(ctx, "millrace-dev", t.sm)
	if err != nil {
		return err
	}
	defer bb.Close()
	if bb.ReaderSeedFile != "" {
		log.Info("embedded NATS admits only its identities: read with nats --server "+bb.URL+" --nkey "+bb.ReaderSeedFile,
			"reader", bb.ReaderSeedFile, "service", bb.ServiceSeedFile)
	}
	edge, err := startBES(ctx, o.bes, bb, t, log)
	if err != nil {
		return err
	}
	log.Info("accepting build events", "after", time.Since(start).Round(time.Millisecond))

	// The fleet edges too start before the database: node sessions and
	// liveness need only the backbone.
	// The development join token and API key that dev makes on first start
	// when none is configured live beside the CA (var/fleet by default).
	devSecretsDir := filepath.Dir(filepath.Clean(o.fleet.caDir))
	gw, err := startFleet(ctx, o.fleet, devSecretsDir, bb, t, log)
	if err != nil {
		edge.stop(ctx)
		return err
	}
	resvCfg, err := o.resv.config(ctx, t, devSecretsDir, log)
	if err != nil {
		edge.stop(ctx)
		gw.stop(ctx)
		return err
	}
	var api reservations.Late
	rg, err := startReservationsGRPC(o.resv, &api, log)
	if err != nil {
		edge.stop(ctx)
		gw.stop(ctx)
		return err
	}
	bk, err := o.bucket.open(ctx)
	if err != nil {
		edge.stop(ctx)
		gw.stop(ctx)
		rg.stop(ctx)
		return err
	}
	defer bk.Close()
	ce, err := startCommits(ctx, o.commits, devSecretsDir, bb, bk, t, log)
	if err != nil {
		edge.stop(ctx)
		gw.stop(ctx)
		rg.stop(ctx)
		return err
	}
	fleetProj, err := o.fleetProj.projector(log, t.reg)
	if err != nil {
		return err
	}
	placerCfg, err := o.placer.config(log)
	if err != nil {
		return err
	}
	buildsProj, err := builds.New(builds.Config{AbandonAfter: o.projector.abandonAfter})
	if err != nil {
		return err
	}

	var pool atomic.Pointer[pgxpool.Pool]
	mux := http.NewServeMux()
	console.Register(mux, pool.Load)
	api.Register(nil, mux)
	ce.mount(mux)
	web, err := startHTTP(ctx, o.http, t, readiness(bb, pool.Load), mux, log)
	if err != nil {
		edge.stop(ctx)
		gw.stop(ctx)
		rg.stop(ctx)
		ce.stop(ctx)
		return err
	}

	// The compactor needs the backbone and the bucket, not the database.
	comp := startCompactor(newCompactor(compactorRC, compactorCC, bb.JS, bk, t))

	// The Kafka export, when brokers are named: it needs the backbone only.
	exportCtx, stopExport := context.WithCancel(context.WithoutCancel(ctx))
	exportDone := make(chan struct{})
	if o.kafka.brokers == "" {
		close(exportDone)
	} else {
		k, err := newKafkaExport(o.kafka, bb.JS, t, log)
		if err != nil {
			stopExport()
			comp.stop()
			edge.stop(ctx)
			gw.stop(ctx)
			rg.stop(ctx)
			ce.stop(ctx)
			return err
		}
		go func() {
			defer close(exportDone)
			k.run(exportCtx)
		}()
	}

	projCtx, stopProjector := context.WithCancel(context.WithoutCancel(ctx))
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		p := connectWithRetry(projCtx, o.db, log)
		if p == nil {
			return
		}
		pool.Store(p)
		if err := startReservations(&api, resvCfg, p, bb, t, log); err != nil {
			log.Error("reservations API not started", "err", err)
		}
		run := func(name string, f func()) {
			wg.Add(1)
			go func() {
				defer wg.Done()
				f()
				log.Debug("stopped", "component", name)
			}()
		}
		run("fleet projector", func() {
			streams.NewRunner(bb.JS, p, fleetProj, o.fleetProj.runnerConfig(log), t.sm).Run(projCtx)
		})
		run("placer", func() { runPlacer(projCtx, placerCfg, o.placer, bb, p, t, log) })
		runner := streams.NewRunner(bb.JS, p, buildsProj,
			withLogger(o.projector.runnerConfig(), log), t.sm)
		runner.Run(projCtx)
	}()

	select {
	case <-ctx.Done():
	case err := <-edge.done:
		log.Error("BES edge stopped", "err", err)
	case err := <-gw.done:
		log.Error("fleet gateway stopped", "err", err)
	case err := <-rg.done:
		log.Error("reservations API stopped", "err", err)
	case err := <-ce.done:
		log.Error("commits API stopped", "err", err)
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), o.shutdown)
	defer cancel()
	api.Close()     // waiting reservation calls answer now
	edge.stop(sctx) // stop accepting; open streams drain their acks
	gw.stop(sctx)   // nodes re-home to another gateway
	rg.stop(sctx)
	ce.stop(sctx)
	comp.stop()  // passes in flight finish, or are abandoned and redone at the next start
	stopExport() // what Kafka has not acknowledged is sent again at the next start
	<-exportDone
	stopProjector() // the runners finish or roll back their batches
	wg.Wait()
	bb.Close() // flush publishes, stop the embedded server
	if p := pool.Load(); p != nil {
		p.Close()
	}
	web.stop(sctx)
	return nil
}

func withLogger(c streams.RunnerConfig, log *slog.Logger) streams.RunnerConfig {
	c.Logger = log.With("component", "projector")
	return c
}

// connectWithRetry opens the pool (applying migrations), retrying while the
// database is away; it returns nil when ctx ends first.
func connectWithRetry(ctx context.Context, o dbOptions, log *slog.Logger) *pgxpool.Pool {
	for {
		p, err := openPool(ctx, o, true, log)
		if err == nil {
			return p
		}
		if ctx.Err() != nil {
			return nil
		}
		log.Warn("database not available; retrying", "err", err)
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(2 * time.Second):
		}
	}
}
