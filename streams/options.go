package streams

import (
	"context"
	"flag"
	"time"

	"github.com/millrace/millrace/internal/envflag"
)

// Options are the flags that say where the backbone is and how its streams
// are kept, as every command that opens the backbone registers them; they
// live beside Config so that a new knob of the backbone gets its flag in
// the same change. A few are kept in the operator's units (days, a sync
// word) and turned into Config by Config.
type Options struct {
	// URL of an external NATS cluster; empty runs an embedded server.
	URL string
	// DataDir and Listen are the embedded server's store and address.
	DataDir, Listen string
	// Sync is the embedded server's fsync interval as a duration, or
	// "always" to fsync every write.
	Sync string
	// CredsFile, NKeySeedFile, TLSCA, TLSCert and TLSKey authenticate to
	// URL (ClientAuth).
	CredsFile, NKeySeedFile string
	TLSCA, TLSCert, TLSKey  string
	// Replicas of each stream.
	Replicas int
	// RetentionDays is how many days the BES stream keeps raw events
	// (Config.BESMaxAge); at least 1.
	RetentionDays int
	// DuplicateWindow and LeaseTTL are Config's.
	DuplicateWindow, LeaseTTL, PublishTimeout time.Duration
	// MaxPayload is the embedded server's largest message in bytes.
	MaxPayload int
	// BESPartitions is Config's.
	BESPartitions int
}

// RegisterFlags registers the backbone's flags on fs, each with its
// environment variable (internal/envflag).
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	envflag.String(fs, &o.URL, "nats-url", "MILLRACE_NATS_URL", "", "NATS cluster to use; empty runs an embedded JetStream server")
	envflag.String(fs, &o.DataDir, "nats-dir", "MILLRACE_NATS_DIR", DefaultDataDir, "embedded server: file store directory")
	envflag.String(fs, &o.Listen, "nats-listen", "MILLRACE_NATS_LISTEN", DefaultListen, "embedded server: client address")
	envflag.String(fs, &o.Sync, "nats-sync", "MILLRACE_NATS_SYNC", "1s", "embedded server: fsync interval, or \"always\" to fsync every write")
	envflag.Int(fs, &o.Replicas, "nats-replicas", "MILLRACE_NATS_REPLICAS", 1, "replicas per stream (3 on a production cluster)")
	RegisterRetentionRawDays(fs, &o.RetentionDays)
	envflag.Duration(fs, &o.DuplicateWindow, "nats-duplicate-window", "MILLRACE_NATS_DUPLICATE_WINDOW", DefaultDuplicateWindow, "how long a resent event is recognised as a duplicate")
	envflag.Size(fs, &o.MaxPayload, "nats-max-payload", "MILLRACE_NATS_MAX_PAYLOAD", DefaultMaxPayload, "embedded server: largest message in bytes")
	envflag.Int(fs, &o.BESPartitions, "bes-partitions", "MILLRACE_BES_PARTITIONS", 1, "build events are spread over this many streams (BES_0...), each projected by its own consumer, so that several builds projectors share the work; the same in every process, chosen when the backbone is made")
	envflag.Duration(fs, &o.LeaseTTL, "nats-lease-ttl", "MILLRACE_NATS_LEASE_TTL", DefaultLeaseTTL, "how long the lease of a consumer led through JetStream (the Kafka export, the compactor) outlives its holder: a standby takes over at most this long after a crash (the millrace_leases bucket's max age)")
	envflag.Duration(fs, &o.PublishTimeout, "nats-publish-timeout", "MILLRACE_NATS_PUBLISH_TIMEOUT", DefaultPublishTimeout, "how long an edge waits for the backbone to acknowledge an event before answering UNAVAILABLE (which clients retry): a cluster that lost its quorum answers nothing")
	envflag.String(fs, &o.CredsFile, "nats-creds", "MILLRACE_NATS_CREDS", "", "--nats-url: NATS credentials file (user JWT and seed, as nsc makes them)")
	envflag.String(fs, &o.NKeySeedFile, "nats-nkey", "MILLRACE_NATS_NKEY", "", "--nats-url: file holding a user nkey seed (SU...); for dev's embedded server from another process: <nats-dir>/auth/service.nk")
	envflag.String(fs, &o.TLSCA, "nats-tls-ca", "MILLRACE_NATS_TLS_CA", "", "--nats-url: PEM CA bundle the servers' certificates must chain to (turns TLS on)")
	envflag.String(fs, &o.TLSCert, "nats-tls-cert", "MILLRACE_NATS_TLS_CERT", "", "--nats-url: PEM client certificate for mutual TLS (with --nats-tls-key)")
	envflag.String(fs, &o.TLSKey, "nats-tls-key", "MILLRACE_NATS_TLS_KEY", "", "--nats-url: PEM private key of --nats-tls-cert")
}

// DefaultRetentionRawDays is --retention-raw-days' default.
const DefaultRetentionRawDays = 30

// RegisterRetentionRawDays registers --retention-raw-days on fs: the BES
// stream's age limit, and the raw retention of every project without its
// own (projectors/builds, "Retention"). Commands that read it without
// opening the backbone (projects retention) register it alone.
func RegisterRetentionRawDays(fs *flag.FlagSet, p *int) {
	envflag.Int(fs, p, "retention-raw-days", "RETENTION_RAW_DAYS", DefaultRetentionRawDays, "days raw build events are kept: the BES stream's age limit, and the default of a project's raw retention (stream and archive)")
}

// Config is the backbone's configuration, checked (Validate). A sync word
// or a retention that no Config can hold is the command line's mistake, an
// envflag.UsageError. serviceConsumers are the durable consumers the
// program's processes use (Config.ServiceConsumers): the caller names
// them, since they belong to the packages that consume, not to streams.
func (o Options) Config(serviceConsumers []string) (Config, error) {
	c := Config{
		URL:             o.URL,
		DataDir:         o.DataDir,
		Listen:          o.Listen,
		Replicas:        o.Replicas,
		BESMaxAge:       time.Duration(o.RetentionDays) * 24 * time.Hour,
		DuplicateWindow: o.DuplicateWindow,
		MaxPayload:      int32(o.MaxPayload),
		LeaseTTL:        o.LeaseTTL,
		PublishTimeout:  o.PublishTimeout,
		BESPartitions:   o.BESPartitions,
		Auth: ClientAuth{CredsFile: o.CredsFile, NKeySeedFile: o.NKeySeedFile,
			TLSCA: o.TLSCA, TLSCert: o.TLSCert, TLSKey: o.TLSKey},
		ServiceConsumers: serviceConsumers,
	}
	if o.Sync == "always" {
		c.SyncAlways = true
	} else {
		d, err := time.ParseDuration(o.Sync)
		if err != nil || d <= 0 {
			return c, envflag.Usagef("--nats-sync ($MILLRACE_NATS_SYNC) %q: want a duration like 1s or \"always\"", o.Sync)
		}
		c.SyncInterval = d
	}
	if o.RetentionDays <= 0 {
		return c, envflag.Usage("--retention-raw-days ($RETENTION_RAW_DAYS) must be at least 1")
	}
	return c, c.Validate()
}

// Open checks the options and opens the backbone as client name (starting
// the embedded server when no URL is set), returning the Config it opened
// with so that a caller can name the streams it applied.
func (o Options) Open(ctx context.Context, name string, serviceConsumers []string, m *Metrics) (*Backbone, Config, error) {
	c, err := o.Config(serviceConsumers)
	if err != nil {
		return nil, c, err
	}
	bb, err := Open(ctx, c, name, m)
	return bb, c, err
}
