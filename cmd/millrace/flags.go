package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	buildsproj "github.com/millrace/millrace/projectors/builds"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	"github.com/millrace/millrace/projectors/placer"
	"github.com/millrace/millrace/services/bes"
	"github.com/millrace/millrace/services/bes/redact"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// Flags whose default comes from an environment variable: the command line
// wins over the environment, the environment over the built-in default.

func envString(fs *flag.FlagSet, p *string, name, env, def, help string) {
	if v, ok := os.LookupEnv(env); ok {
		def = v
	}
	fs.StringVar(p, name, def, fmt.Sprintf("%s [$%s]", help, env))
}

// A value from the environment that does not parse is a mistake to stop
// at, not one to run past with the default: MILLRACE_BUILDS_BATCH=1k once
// ran with 1000. Each helper below parses the variable as its flag would
// and records a failure against the flag set; run refuses to start while
// envErrors reports one, naming the variable.
var envFailures = struct {
	sync.Mutex
	m map[*flag.FlagSet][]error
}{m: map[*flag.FlagSet][]error{}}

func envFail(fs *flag.FlagSet, env, v, want string) {
	envFailures.Lock()
	defer envFailures.Unlock()
	envFailures.m[fs] = append(envFailures.m[fs], fmt.Errorf("$%s=%q is not %s", env, v, want))
}

// envErrors is every environment variable of fs's flags that did not parse.
func envErrors(fs *flag.FlagSet) error {
	envFailures.Lock()
	defer envFailures.Unlock()
	err := errors.Join(envFailures.m[fs]...)
	delete(envFailures.m, fs)
	return err
}

func envInt(fs *flag.FlagSet, p *int, name, env string, def int, help string) {
	if v, ok := os.LookupEnv(env); ok {
		if n, err := strconv.Atoi(strings.TrimSpace(v)); err == nil {
			def = n
		} else {
			envFail(fs, env, v, "a whole number")
		}
	}
	fs.IntVar(p, name, def, fmt.Sprintf("%s [$%s]", help, env))
}

func envDuration(fs *flag.FlagSet, p *time.Duration, name, env string, def time.Duration, help string) {
	if v, ok := os.LookupEnv(env); ok {
		if d, err := time.ParseDuration(strings.TrimSpace(v)); err == nil {
			def = d
		} else {
			envFail(fs, env, v, "a duration (a number with a unit: 300ms, 30s, 5m)")
		}
	}
	fs.DurationVar(p, name, def, fmt.Sprintf("%s [$%s]", help, env))
}

func envBool(fs *flag.FlagSet, p *bool, name, env string, def bool, help string) {
	if v, ok := os.LookupEnv(env); ok {
		if b, err := strconv.ParseBool(strings.TrimSpace(v)); err == nil {
			def = b
		} else {
			envFail(fs, env, v, "true or false")
		}
	}
	fs.BoolVar(p, name, def, fmt.Sprintf("%s [$%s]", help, env))
}

// sizeValue is a flag of a byte count, written as a number with an
// optional B, KiB, MiB, GiB or TiB suffix.
type sizeValue struct{ p *int }

func (v sizeValue) String() string {
	if v.p == nil {
		return "0"
	}
	return strconv.Itoa(*v.p)
}

func (v sizeValue) Set(s string) error {
	n, err := parseSize(s)
	if err != nil {
		return err
	}
	*v.p = n
	return nil
}

// parseSize reads a byte count like parseMemoryLimit, without "off".
func parseSize(s string) (int, error) {
	if strings.TrimSpace(s) == "off" {
		return 0, fmt.Errorf("%q is not a size (a number with B, KiB, MiB, GiB or TiB)", s)
	}
	n, err := parseMemoryLimit(s)
	if err != nil {
		return 0, fmt.Errorf("%q is not a size (a number with B, KiB, MiB, GiB or TiB)", strings.TrimSpace(s))
	}
	return int(n), nil
}

// envSize is envInt for byte counts: 4MiB as well as 4194304.
func envSize(fs *flag.FlagSet, p *int, name, env string, def int, help string) {
	*p = def
	if v, ok := os.LookupEnv(env); ok {
		if n, err := parseSize(v); err == nil {
			*p = n
		} else {
			envFail(fs, env, v, "a size (a number of bytes with an optional B, KiB, MiB, GiB or TiB)")
		}
	}
	fs.Var(sizeValue{p}, name, fmt.Sprintf("%s (bytes; KiB, MiB, GiB suffixes allowed) [$%s]", help, env))
}

// parseMemoryLimit reads a size as GOMEMLIMIT does: a number of bytes with
// an optional B, KiB, MiB, GiB or TiB suffix; "off" or "0" is no limit
// (returned as 0).
func parseMemoryLimit(s string) (int64, error) {
	s = strings.TrimSpace(s)
	if s == "off" || s == "0" {
		return 0, nil
	}
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"B", 1}} {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > math.MaxInt64/mult {
		return 0, fmt.Errorf("%q is not a size (a number with B, KiB, MiB, GiB or TiB, or off)", s)
	}
	return n * mult, nil
}

// logOptions configure the process's logger.
type logOptions struct {
	level, format string
}

func (o *logOptions) register(fs *flag.FlagSet) {
	envString(fs, &o.level, "log-level", "MILLRACE_LOG_LEVEL", "info", "log level: debug, info, warn, error")
	envString(fs, &o.format, "log-format", "MILLRACE_LOG_FORMAT", "text", "log format: text or json")
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
	envString(fs, &o.url, "nats-url", "MILLRACE_NATS_URL", "", "NATS cluster to use; empty runs an embedded JetStream server")
	envString(fs, &o.dir, "nats-dir", "MILLRACE_NATS_DIR", streams.DefaultDataDir, "embedded server: file store directory")
	envString(fs, &o.listen, "nats-listen", "MILLRACE_NATS_LISTEN", streams.DefaultListen, "embedded server: client address")
	envString(fs, &o.sync, "nats-sync", "MILLRACE_NATS_SYNC", "1s", "embedded server: fsync interval, or \"always\" to fsync every write")
	envInt(fs, &o.replicas, "nats-replicas", "MILLRACE_NATS_REPLICAS", 1, "replicas per stream (3 on a production cluster)")
	envInt(fs, &o.retentionDays, "retention-raw-days", "RETENTION_RAW_DAYS", 30, "days the BES stream keeps raw build events")
	envDuration(fs, &o.dupWindow, "nats-duplicate-window", "MILLRACE_NATS_DUPLICATE_WINDOW", streams.DefaultDuplicateWindow, "how long a resent event is recognised as a duplicate")
	envSize(fs, &o.maxPayload, "nats-max-payload", "MILLRACE_NATS_MAX_PAYLOAD", streams.DefaultMaxPayload, "embedded server: largest message in bytes")
	envDuration(fs, &o.leaseTTL, "nats-lease-ttl", "MILLRACE_NATS_LEASE_TTL", streams.DefaultLeaseTTL, "how long the lease of a consumer led through JetStream (the Kafka export, the compactor) outlives its holder: a standby takes over at most this long after a crash (the millrace_leases bucket's max age)")
	envString(fs, &o.creds, "nats-creds", "MILLRACE_NATS_CREDS", "", "--nats-url: NATS credentials file (user JWT and seed, as nsc makes them)")
	envString(fs, &o.nkey, "nats-nkey", "MILLRACE_NATS_NKEY", "", "--nats-url: file holding a user nkey seed (SU...); for dev's embedded server from another process: <nats-dir>/auth/service.nk")
	envString(fs, &o.tlsCA, "nats-tls-ca", "MILLRACE_NATS_TLS_CA", "", "--nats-url: PEM CA bundle the servers' certificates must chain to (turns TLS on)")
	envString(fs, &o.tlsCert, "nats-tls-cert", "MILLRACE_NATS_TLS_CERT", "", "--nats-url: PEM client certificate for mutual TLS (with --nats-tls-key)")
	envString(fs, &o.tlsKey, "nats-tls-key", "MILLRACE_NATS_TLS_KEY", "", "--nats-url: PEM private key of --nats-tls-cert")
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
	envString(fs, &o.url, "database-url", "DATABASE_URL", "", "PostgreSQL URL; empty uses 127.0.0.1:5432 if it answers, else a private cluster in --pg-dir")
	envString(fs, &o.dir, "pg-dir", "MILLRACE_PG_DIR", "var/pg", "data directory of the private development cluster")
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
	envString(fs, &o.listen, "bes-listen", "MILLRACE_BES_LISTEN", "127.0.0.1:1985", "BES gRPC address (bazel --bes_backend=grpc://ADDR)")
	envString(fs, &o.keys, "bes-api-keys", "MILLRACE_BES_API_KEYS", "", "API keys as project=key,project=key; empty accepts any client")
	envString(fs, &o.keysFile, "bes-api-keys-file", "MILLRACE_BES_API_KEYS_FILE", "", "file of project=key lines (added to --bes-api-keys)")
	envSize(fs, &o.maxEventBytes, "bes-max-event-bytes", "MILLRACE_BES_MAX_EVENT_BYTES", bes.DefaultMaxEventBytes, "largest build event accepted")
	envInt(fs, &o.maxStreams, "bes-max-streams", "MILLRACE_BES_MAX_STREAMS", bes.DefaultMaxStreams, "most build event streams open at once")
	envInt(fs, &o.perProject, "bes-max-streams-per-project", "MILLRACE_BES_MAX_STREAMS_PER_PROJECT", 0, "most streams one project may hold open (0: half of --bes-max-streams)")
	envInt(fs, &o.inFlight, "bes-max-in-flight", "MILLRACE_BES_MAX_IN_FLIGHT", bes.DefaultMaxInFlight, "events of one stream awaiting storage before the edge stops reading it")
	o.redact.register(fs)
	envBool(fs, &o.redact.on, "bes-redact", "MILLRACE_BES_REDACT", true, "redact secrets from build events before they are stored; false only to measure what redaction costs")
	envString(fs, &o.tlsCert, "bes-tls-cert", "MILLRACE_BES_TLS_CERT", "", "PEM server certificate (chain) for the BES edge, with --bes-tls-key: Bazel then connects with --bes_backend=grpcs://HOST:PORT; empty serves plaintext")
	envString(fs, &o.tlsKey, "bes-tls-key", "MILLRACE_BES_TLS_KEY", "", "PEM private key of --bes-tls-cert")
	envBool(fs, &o.insecureOpen, "bes-insecure-open", "MILLRACE_BES_INSECURE_OPEN", false, "serve without API keys on an address other hosts can reach (refused otherwise): anyone who reaches the edge can publish as any project")
	envInt(fs, &o.perConn, "bes-max-streams-per-conn", "MILLRACE_BES_MAX_STREAMS_PER_CONN", bes.DefaultMaxStreamsPerConn, "streams one client connection may hold open at once (a Bazel client holds one or two)")
	envInt(fs, &o.connsPerAddr, "bes-max-conns-per-addr", "MILLRACE_BES_MAX_CONNS_PER_ADDR", 256, "connections one client IP may hold open (loopback clients, such as a local proxy, are exempt; 0: no cap)")
	envInt(fs, &o.pendingPerAddr, "bes-max-pending-per-addr", "MILLRACE_BES_MAX_PENDING_PER_ADDR", bes.DefaultMaxPendingPerAddr, "streams one client IP may hold before their first request (streams with a valid key in their headers do not count)")
	envDuration(fs, &o.firstMessage, "bes-first-message-timeout", "MILLRACE_BES_FIRST_MESSAGE_TIMEOUT", bes.DefaultFirstMessageTimeout, "how long a new stream may wait before its first event (which authenticates it)")
	envDuration(fs, &o.idle, "bes-idle-timeout", "MILLRACE_BES_IDLE_TIMEOUT", bes.DefaultIdleTimeout, "a stream whose client sends nothing for this long is closed (Bazel resumes it)")
}

func (o *besOptions) config(ctx context.Context, t *telemetry, log *slog.Logger) (bes.Config, error) {
	keys := &bes.Keys{}
	src := keySource{inline: o.keys, file: o.keysFile, what: "BES API keys"}
	if err := loadKeys(ctx, t, src, bes.ParseKeys, keys, log); err != nil {
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
	envString(fs, &o.patternsFile, "bes-redact-patterns-file", "MILLRACE_BES_REDACT_PATTERNS_FILE", "", "file of extra regular expressions to redact, one per line (# comments)")
	envString(fs, &o.allow, "bes-redact-allow", "MILLRACE_BES_REDACT_ALLOW", strings.Join(redact.DefaultAllow, ","),
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
	r, err := redact.New(redact.Config{Patterns: patterns, Allow: splitNonEmpty(o.allow)})
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
	envInt(fs, &o.batch, "builds-batch", "MILLRACE_BUILDS_BATCH", 1000, "most events applied in one transaction")
	envDuration(fs, &o.maxWait, "builds-max-wait", "MILLRACE_BUILDS_MAX_WAIT", 250*time.Millisecond, "how long a fetch waits to fill a batch")
	envDuration(fs, &o.ackWait, "builds-ack-wait", "MILLRACE_BUILDS_ACK_WAIT", 60*time.Second, "JetStream's redelivery timeout for unacknowledged events")
	envDuration(fs, &o.abandonAfter, "builds-abandon-after", "MILLRACE_BUILDS_ABANDON_AFTER", 30*time.Minute, "a running build with no event for this long is marked abandoned")
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

func splitNonEmpty(s string) []string {
	var out []string
	for _, f := range strings.Split(s, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
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
		names = append(names, "export-kafka-"+strings.ToLower(s.Name))
	}
	return names
}
