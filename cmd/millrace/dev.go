package main

import (
	"context"
	"flag"
	"path/filepath"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/services/bes"
	"github.com/millrace/millrace/services/commits"
	"github.com/millrace/millrace/services/fleet"
	"github.com/millrace/millrace/services/reservations"
)

func devCommand() command {
	return command{
		Name:    "dev",
		Summary: "run the whole system in one process on embedded defaults",
		Long: `Starts an embedded JetStream server (or uses $MILLRACE_NATS_URL), finds or starts
PostgreSQL (or uses $DATABASE_URL), applies migrations, and runs the BES edge,
the builds projector, the fleet gateway (mTLS, :1986), the reservations API
(:1988 and /v1/reservations), the liveness projector, the placer, the commits
API (:1987 and /v1/worlds/), the compactor (folding the commit log into
--bucket-url), the archiver (finished builds' raw events into the same bucket),
the Kafka export when --kafka-brokers is set (see
millrace export kafka) and the HTTP console (/metrics, /healthz, /readyz).
Point Bazel at it with: bazel build --bes_backend=grpc://127.0.0.1:1985 //...
Without configured secrets, dev makes a CA in --fleet-ca-dir (var/fleet/ca)
and, beside it, a join token for pool "default" (var/fleet/join-tokens) and a
reservation API key for owner "dev" (var/fleet/api-keys) and a commits API key
for every world (var/fleet/commits-api-keys). The embedded NATS server admits
only two nkey identities it makes in --nats-dir/auth: service.nk (millrace's
processes; pass it as --nats-nkey to a process on dev's backbone) and
reader.nk (read-only: nats --nkey var/nats/auth/reader.nk stream ls).`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var o devOptions
			o.register(fs)
			return o.proc.run("dev", "millrace-dev", o.components)
		},
	}
}

type devOptions struct {
	proc      procOptions
	db        database.Options
	bes       bes.Options
	projector projectorOptions
	fleet     fleet.Options
	resv      reservations.Options
	fleetProj fleetProjectorOptions
	placer    placerOptions
	commits   commits.Options
	bucket    bucket.Options
	compactor compactorOptions
	archive   archive.Config
	kafka     kafka.Options
	console   console.Sources
}

func (o *devOptions) register(fs *flag.FlagSet) {
	o.proc.register(fs, "127.0.0.1:8080", "HTTP address: console, /metrics, /healthz, /readyz",
		"how long shutdown waits for streams to finish and batches to commit")
	o.db.RegisterFlags(fs)
	o.bes.RegisterFlags(fs)
	o.projector.register(fs)
	o.fleet.RegisterFlags(fs)
	o.resv.RegisterFlags(fs)
	o.fleetProj.register(fs)
	o.placer.register(fs)
	o.commits.RegisterFlags(fs)
	o.bucket.RegisterFlags(fs)
	o.compactor.register(fs)
	o.archive.RegisterFlags(fs)
	o.kafka.RegisterFlags(fs)
	o.console.RegisterFlags(fs)
}

// components is the whole system in one process. What needs only the
// backbone starts at once; what needs PostgreSQL waits for it in the
// background, so that the edges serve within a second of a restart
// whatever the database is doing (Bazel's retries span about 9 s). The
// edges come last, so that they stop first: open streams drain their acks
// and nodes re-home while everything behind them still runs.
func (o *devOptions) components(p *process) (before, after []supervise.Component, err error) {
	// Passes in flight get half the shutdown timeout: the rest is for what
	// stops after the compactor.
	compactor, err := p.compactor(o.compactor, o.proc.timeout()/2, o.kafka)
	if err != nil {
		return nil, nil, err
	}
	fleetProj, err := o.fleetProj.projector(p.t.reg, p.log)
	if err != nil {
		return nil, nil, err
	}
	placerCfg, err := o.placer.config(p.log)
	if err != nil {
		return nil, nil, err
	}
	buildsProj, err := o.projector.projector()
	if err != nil {
		return nil, nil, err
	}
	retention, err := o.projector.retention(p, o.proc.nats.RetentionDays, true)
	if err != nil {
		return nil, nil, err
	}
	// The development join token and API keys that dev makes on first
	// start when none is configured live beside the CA (var/fleet).
	devSecrets := filepath.Dir(filepath.Clean(o.fleet.CADir))
	o.fleet.DevSecrets, o.resv.DevSecrets, o.commits.DevSecrets = devSecrets, devSecrets, devSecrets
	resvAPI, resvGRPC := p.reservations(o.resv)
	p.console(o.console, o.bes, o.compactor.fold.Durable(), &o.proc.http)
	before = []supervise.Component{p.database(o.db), p.openBucket(o.bucket), resvAPI,
		p.projector(fleetProj, o.fleetProj.runnerConfig(p.log)), p.placer(placerCfg, o.placer), p.buildsProjector(buildsProj, &o.projector), compactor, p.archiver(o.archive), retention}
	// The Kafka export, when brokers are named: it needs the backbone only.
	if o.kafka.Brokers != "" {
		k, err := p.kafka(o.kafka)
		if err != nil {
			return nil, nil, err
		}
		before = append(before, k)
	}
	after = []supervise.Component{p.commits(o.commits), resvGRPC, p.gateway(o.fleet), p.bes(o.bes)}
	return before, after, nil
}
