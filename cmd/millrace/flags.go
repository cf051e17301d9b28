package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/keyfile"
	buildsproj "github.com/millrace/millrace/projectors/builds"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/projectors/placer"
	"github.com/millrace/millrace/services/bes"
	"github.com/millrace/millrace/services/bes/redact"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
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
		return nil, usageError{fmt.Sprintf("log level %q: want debug, info, warn or error", o.level)}
	}
	opts := &slog.HandlerOptions{Level: level}
	var h slog.Handler
	switch o.format {
	case "text":
		h = slog.NewTextHandler(os.Stderr, opts)
	case "json":
		h = slog.NewJSONHandler(os.Stderr, opts)
	default:
		return nil, usageError{fmt.Sprintf("log format %q: want text or json", o.format)}
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
			return c, usageError{fmt.Sprintf("--nats-sync ($MILLRACE_NATS_SYNC) %q: want a duration like 1s or \"always\"", o.sync)}
		}
		c.SyncInterval = d
	}
	if o.retentionDays <= 0 {
		return c, usageError{"retention-raw-days must be at least 1"}
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

// besOptions configure the BES edge.
type besOptions struct {
	listen, keys, keysFile                          string
	tlsCert, tlsKey                                 string
	insecureOpen                                    bool
	maxEventBytes, maxStreams, perProject, inFlight int
	redact                                          redactOptions
	perConn, connsPerAddr, pendingPerAddr           int
	firstMessage, idle                              time.Duration
}

func (o *besOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.listen, "bes-listen", "MILLRACE_BES_LISTEN", "127.0.0.1:1985", "BES gRPC address (bazel --bes_backend=grpc://ADDR)")
	envflag.String(fs, &o.keys, "bes-api-keys", "MILLRACE_BES_API_KEYS", "", "API keys as project=key,project=key; empty accepts any client")
	envflag.String(fs, &o.keysFile, "bes-api-keys-file", "MILLRACE_BES_API_KEYS_FILE", "", "file of project=key lines (added to --bes-api-keys)")
	envflag.Size(fs, &o.maxEventBytes, "bes-max-event-bytes", "MILLRACE_BES_MAX_EVENT_BYTES", bes.DefaultMaxEventBytes, "largest build event accepted")
	envflag.Int(fs, &o.maxStreams, "bes-max-streams", "MILLRACE_BES_MAX_STREAMS", bes.DefaultMaxStreams, "most build event streams open at once")
	envflag.Int(fs, &o.perProject, "bes-max-streams-per-project", "MILLRACE_BES_MAX_STREAMS_PER_PROJECT", 0, "most streams one project may hold open (0: half of --bes-max-streams)")
	envflag.Int(fs, &o.inFlight, "bes-max-in-flight", "MILLRACE_BES_MAX_IN_FLIGHT", bes.DefaultMaxInFlight, "events of one stream awaiting storage before the edge stops reading it")
	o.redact.register(fs)
	envflag.Bool(fs, &o.redact.on, "bes-redact", "MILLRACE_BES_REDACT", true, "redact secrets from build events before they are stored; false only to measure what redaction costs")
	envflag.String(fs, &o.tlsCert, "bes-tls-cert", "MILLRACE_BES_TLS_CERT", "", "PEM server certificate (chain) for the BES edge, with --bes-tls-key: Bazel then connects with --bes_backend=grpcs://HOST:PORT; empty serves plaintext")
	envflag.String(fs, &o.tlsKey, "bes-tls-key", "MILLRACE_BES_TLS_KEY", "", "PEM private key of --bes-tls-cert")
	envflag.Bool(fs, &o.insecureOpen, "bes-insecure-open", "MILLRACE_BES_INSECURE_OPEN", false, "serve without API keys on an address other hosts can reach (refused otherwise): anyone who reaches the edge can publish as any project")
	envflag.Int(fs, &o.perConn, "bes-max-streams-per-conn", "MILLRACE_BES_MAX_STREAMS_PER_CONN", bes.DefaultMaxStreamsPerConn, "streams one client connection may hold open at once (a Bazel client holds one or two)")
	envflag.Int(fs, &o.connsPerAddr, "bes-max-conns-per-addr", "MILLRACE_BES_MAX_CONNS_PER_ADDR", 256, "connections one client IP may hold open (loopback clients, such as a local proxy, are exempt; 0: no cap)")
	envflag.Int(fs, &o.pendingPerAddr, "bes-max-pending-per-addr", "MILLRACE_BES_MAX_PENDING_PER_ADDR", bes.DefaultMaxPendingPerAddr, "streams one client IP may hold before their first request (streams with a valid key in their headers do not count)")
	envflag.Duration(fs, &o.firstMessage, "bes-first-message-timeout", "MILLRACE_BES_FIRST_MESSAGE_TIMEOUT", bes.DefaultFirstMessageTimeout, "how long a new stream may wait before its first event (which authenticates it)")
	envflag.Duration(fs, &o.idle, "bes-idle-timeout", "MILLRACE_BES_IDLE_TIMEOUT", bes.DefaultIdleTimeout, "a stream whose client sends nothing for this long is closed (Bazel resumes it)")
}

func (o *besOptions) config(ctx context.Context, t *telemetry, log *slog.Logger) (bes.Config, error) {
	keys := &bes.Keys{}
	src := keyfile.Source{Inline: o.keys, File: o.keysFile, What: "BES API keys"}
	if err := keyfile.Load(ctx, src, bes.ParseKeys, keys, t.kf, log); err != nil {
		return bes.Config{}, err
	}
	r, err := o.redact.redactor()
	if err != nil {
		return bes.Config{}, err
	}
	return bes.Config{
		MaxEventBytes:        o.maxEventBytes,
		MaxStreams:           o.maxStreams,
		MaxStreamsPerProject: o.perProject,
		MaxInFlight:          o.inFlight,
		Keys:                 keys,
		Redactor:             r,
		NoRedaction:          !o.redact.on,
		FirstMessageTimeout:  o.firstMessage,
		IdleTimeout:          o.idle,
		MaxStreamsPerConn:    o.perConn,
		MaxPendingPerAddr:    o.pendingPerAddr,
	}, nil
}

// redactOptions configure the redaction of secrets in build events (the
// BES edge) and in projected rows (builds scrub): the same rules for both.
type redactOptions struct {
	on           bool
	patterns     patternList
	patternsFile string
	allow        string
}

// patternList is a repeatable flag: each occurrence adds one regular
// expression; its environment variable holds one per line (a regular
// expression may hold commas and spaces).
type patternList []string

func (p *patternList) String() string { return strings.Join(*p, "\n") }
func (p *patternList) Set(v string) error {
	*p = append(*p, v)
	return nil
}

func (o *redactOptions) register(fs *flag.FlagSet) {
	if v, ok := os.LookupEnv("MILLRACE_BES_REDACT_PATTERNS"); ok {
		o.patterns = splitLines(v)
	}
	fs.Var(&o.patterns, "bes-redact-pattern", "an extra regular expression (RE2) whose matches in build events are redacted; repeat the flag for more [$MILLRACE_BES_REDACT_PATTERNS, one per line]")
	envflag.String(fs, &o.patternsFile, "bes-redact-patterns-file", "MILLRACE_BES_REDACT_PATTERNS_FILE", "", "file of extra regular expressions to redact, one per line (# comments)")
	envflag.String(fs, &o.allow, "bes-redact-allow", "MILLRACE_BES_REDACT_ALLOW", strings.Join(redact.DefaultAllow, ","),
		"variable names (of --action_env, --client_env, ..., --build_metadata keys) whose values are kept, comma-separated; NAME* matches a prefix; empty keeps none")
}

func (o *redactOptions) redactor() (*redact.Redactor, error) {
	patterns := append([]string(nil), o.patterns...)
	if o.patternsFile != "" {
		b, err := os.ReadFile(o.patternsFile)
		if err != nil {
			return nil, fmt.Errorf("redact patterns file: %w", err)
		}
		for _, l := range splitLines(string(b)) {
			if !strings.HasPrefix(l, "#") {
				patterns = append(patterns, l)
			}
		}
	}
	r, err := redact.New(redact.Config{Patterns: patterns, Allow: envflag.SplitList(o.allow)})
	if err != nil {
		return nil, usageError{err.Error()}
	}
	return r, nil
}

func splitLines(s string) []string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return out
}

// projectorOptions tune the builds projector's consumer.
type projectorOptions struct {
	batch        int
	maxWait      time.Duration
	ackWait      time.Duration
	abandonAfter time.Duration
}

func (o *projectorOptions) register(fs *flag.FlagSet) {
	envflag.Int(fs, &o.batch, "builds-batch", "MILLRACE_BUILDS_BATCH", 1000, "most events applied in one transaction")
	envflag.Duration(fs, &o.maxWait, "builds-max-wait", "MILLRACE_BUILDS_MAX_WAIT", 250*time.Millisecond, "how long a fetch waits to fill a batch")
	envflag.Duration(fs, &o.ackWait, "builds-ack-wait", "MILLRACE_BUILDS_ACK_WAIT", 60*time.Second, "JetStream's redelivery timeout for unacknowledged events")
	envflag.Duration(fs, &o.abandonAfter, "builds-abandon-after", "MILLRACE_BUILDS_ABANDON_AFTER", 30*time.Minute, "a running build with no event for this long is marked abandoned")
}

func (o *projectorOptions) runnerConfig() streams.RunnerConfig {
	return streams.RunnerConfig{
		Stream:  subjects.StreamBES,
		Filter:  subjects.BESFilter,
		Batch:   o.batch,
		MaxWait: o.maxWait,
		AckWait: o.ackWait,
	}
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
