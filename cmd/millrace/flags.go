package main

import (
	"context"
	"flag"
	"log/slog"
	"os"
	"time"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	buildsproj "github.com/millrace/millrace/projectors/builds"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/projectors/placer"
	"github.com/millrace/millrace/streams"
)

// logOptions configure the process's logger.
type logOptions struct {
	level, format string
}

func (o *logOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.level, "log-level", "MILLRACE_LOG_LEVEL", "info", "log level: debug, info, warn, error")
	envflag.String(fs, &o.format, "log-format", "MILLRACE_LOG_FORMAT", "text", "log format: text or json")
}

func (o *logOptions) logger() (*slog.Logger, error) {
	var level slog.Level
	if err := level.UnmarshalText([]byte(o.level)); err != nil {
		return nil, envflag.Usagef("log level %q: want debug, info, warn or error", o.level)
	}
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	switch o.format {
	case "text":
		h = slog.NewTextHandler(os.Stderr, opts)
	case "json":
		h = slog.NewJSONHandler(os.Stderr, opts)
	default:
		return nil, envflag.Usagef("log format %q: want text or json", o.format)
	}
	l := slog.New(h)
	slog.SetDefault(l)
	return l, nil
}

// natsOptions say where the backbone is.
type natsOptions struct {
	url, dir, listen, sync string
	creds, nkey            string
	tlsCA, tlsCert, tlsKey string
	replicas               int
	retentionDays          int
	dupWindow, leaseTTL    time.Duration
	maxPayload             int
}

func (o *natsOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.url, "nats-url", "MILLRACE_NATS_URL", "", "NATS cluster to use; empty runs an embedded JetStream server")
	envflag.String(fs, &o.dir, "nats-dir", "MILLRACE_NATS_DIR", streams.DefaultDataDir, "embedded server: file store directory")
	envflag.String(fs, &o.listen, "nats-listen", "MILLRACE_NATS_LISTEN", streams.DefaultListen, "embedded server: client address")
	envflag.String(fs, &o.sync, "nats-sync", "MILLRACE_NATS_SYNC", "1s", "embedded server: fsync interval, or \"always\" to fsync every write")
	envflag.Int(fs, &o.replicas, "nats-replicas", "MILLRACE_NATS_REPLICAS", 1, "replicas per stream (3 on a production cluster)")
	envflag.Int(fs, &o.retentionDays, "retention-raw-days", "RETENTION_RAW_DAYS", 30, "days the BES stream keeps raw build events")
	envflag.Duration(fs, &o.dupWindow, "nats-duplicate-window", "MILLRACE_NATS_DUPLICATE_WINDOW", streams.DefaultDuplicateWindow, "how long a resent event is recognised as a duplicate")
	envflag.Size(fs, &o.maxPayload, "nats-max-payload", "MILLRACE_NATS_MAX_PAYLOAD", streams.DefaultMaxPayload, "embedded server: largest message in bytes")
	envflag.Duration(fs, &o.leaseTTL, "nats-lease-ttl", "MILLRACE_NATS_LEASE_TTL", streams.DefaultLeaseTTL, "how long the lease of a consumer led through JetStream (the Kafka export, the compactor) outlives its holder: a standby takes over at most this long after a crash (the millrace_leases bucket's max age)")
	envflag.String(fs, &o.creds, "nats-creds", "MILLRACE_NATS_CREDS", "", "--nats-url: NATS credentials file (user JWT and seed, as nsc makes them)")
	envflag.String(fs, &o.nkey, "nats-nkey", "MILLRACE_NATS_NKEY", "", "--nats-url: file holding a user nkey seed (SU...); for dev's embedded server from another process: <nats-dir>/auth/service.nk")
	envflag.String(fs, &o.tlsCA, "nats-tls-ca", "MILLRACE_NATS_TLS_CA", "", "--nats-url: PEM CA bundle the servers' certificates must chain to (turns TLS on)")
	envflag.String(fs, &o.tlsCert, "nats-tls-cert", "MILLRACE_NATS_TLS_CERT", "", "--nats-url: PEM client certificate for mutual TLS (with --nats-tls-key)")
	envflag.String(fs, &o.tlsKey, "nats-tls-key", "MILLRACE_NATS_TLS_KEY", "", "--nats-url: PEM private key of --nats-tls-cert")
}

// with opens the backbone for a tool, runs f and closes it.
func (o *natsOptions) with(ctx context.Context, f func(*streams.Backbone, streams.Config) error) error {
	bb, c, err := o.open(ctx, "millrace-streams", nil)
	if err != nil {
		return err
	}
	defer bb.Close()
	return f(bb, c)
}

// open checks the options and opens the backbone (starting the embedded
// server when no URL is set), as client name.
func (o *natsOptions) open(ctx context.Context, name string, m *streams.Metrics) (*streams.Backbone, streams.Config, error) {
	c, err := o.config()
	if err != nil {
		return nil, c, err
	}
	bb, err := streams.Open(ctx, c, name, m)
	return bb, c, err
}

func (o *natsOptions) config() (streams.Config, error) {
	c := streams.Config{
		URL:             o.url,
		DataDir:         o.dir,
		Listen:          o.listen,
		Replicas:        o.replicas,
		BESMaxAge:       time.Duration(o.retentionDays) * 24 * time.Hour,
		DuplicateWindow: o.dupWindow,
		MaxPayload:      int32(o.maxPayload),
		LeaseTTL:        o.leaseTTL,
		Auth: streams.ClientAuth{CredsFile: o.creds, NKeySeedFile: o.nkey,
			TLSCA: o.tlsCA, TLSCert: o.tlsCert, TLSKey: o.tlsKey},
		ServiceConsumers: serviceConsumers(),
	}
	if o.sync == "always" {
		c.SyncAlways = true
	} else {
		d, err := time.ParseDuration(o.sync)
		if err != nil || d <= 0 {
			return c, envflag.Usagef("--nats-sync ($MILLRACE_NATS_SYNC) %q: want a duration like 1s or \"always\"", o.sync)
		}
		c.SyncInterval = d
	}
	if o.retentionDays <= 0 {
		return c, envflag.Usage("retention-raw-days must be at least 1")
	}
	return c, c.Validate()
}

// dbOptions say where PostgreSQL is.
type dbOptions struct {
	url, dir string
}

func (o *dbOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.url, "database-url", "DATABASE_URL", "", "PostgreSQL URL; empty uses 127.0.0.1:5432 if it answers, else a private cluster in --pg-dir")
	envflag.String(fs, &o.dir, "pg-dir", "MILLRACE_PG_DIR", "var/pg", "data directory of the private development cluster")
}

// config is the database's configuration; migrate brings the schema up
// to date before the pool opens.
func (o *dbOptions) config(migrate bool, log *slog.Logger) database.Config {
	return database.Config{URL: o.url, DevDir: o.dir, Migrate: migrate, Logger: log}
}

// bucketOptions name the object storage the commit log is folded into.
type bucketOptions struct {
	url string
}

func (o *bucketOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.url, "bucket-url", "MILLRACE_BUCKET_URL", "var/bucket",
		"object storage of the commit log's checkpoints: a directory, file:///dir, s3://name?region=R[&endpoint=URL&use_path_style=true] or gs://name")
}

func (o *bucketOptions) open(ctx context.Context) (*bucket.Bucket, error) {
	u, err := bucket.URLFor(o.url)
	if err != nil {
		return nil, envflag.Usage("--bucket-url: " + err.Error())
	}
	return bucket.Open(ctx, u)
}

// serviceConsumers are the durable consumers millrace's processes use; the
// embedded server's reader identity may not touch them (streams/auth.go).
func serviceConsumers() []string {
	names := []string{buildsproj.ConsumerName, fleetproj.ConsumerName,
		placer.ConsumerName, placer.RequestsConsumer, placer.DecisionsConsumer, "compactor"}
	if d := os.Getenv("MILLRACE_COMPACTOR_DURABLE"); d != "" && d != "compactor" {
		names = append(names, d)
	}
	for _, s := range streams.StreamSpecs(streams.Config{}) {
		names = append(names, kafka.Durable(s.Name))
	}
	return names
}
