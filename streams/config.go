package streams

import (
	"errors"
	"fmt"
	"path/filepath"
	"time"

	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/subjects"
)

// Config says where the backbone is and how its streams are kept.
// The zero value runs an embedded server under ./var/nats on 127.0.0.1:4223;
// a zero field takes its default, a negative one is refused (Validate).
type Config struct {
	// URL of an external NATS cluster. Empty: run an embedded server.
	URL string
	// Auth is how to authenticate to URL (credentials, nkey, TLS). Unused
	// for the embedded server, which admits only its own identities.
	Auth ClientAuth
	// AuthDir holds the embedded server's identities (auth.go): the
	// service's and the reader's nkey seeds, made on first start. Default
	// DataDir/auth.
	AuthDir string
	// ServiceConsumers names the durable consumers millrace's services
	// use; the embedded server's reader may make and read consumers of its
	// own but none of these (auth.go).
	ServiceConsumers []string
	// Anonymous lets the embedded server admit anyone, with every
	// permission, and makes no identities: for benchmark harnesses that
	// run the server as a process of its own (loadtest/cmd/natsd) on
	// loopback, never for a server that holds data anyone relies on.
	Anonymous bool
	// DataDir holds the embedded server's file store. Default ./var/nats.
	DataDir string
	// Listen is the embedded server's client address. Default 127.0.0.1:4223
	// (not 4222: a system NATS may hold it). Port 0 picks a free port.
	Listen string
	// SyncInterval is how often the embedded server fsyncs its file store.
	// Default 1s: a power loss may lose up to that much acknowledged data on
	// one node (a killed process loses nothing). JetStream's own default is 2m.
	SyncInterval time.Duration
	// SyncAlways fsyncs every write (about 3k msgs/s here instead of ~100k).
	SyncAlways bool
	// MaxPayload is the largest message the embedded server accepts.
	// Default 8 MiB; edges must keep their event limit below it.
	MaxPayload int32
	// Replicas of each stream: 1 on one node, 3 on a production cluster.
	Replicas int
	// BESMaxAge is how long raw build events are kept (RETENTION_RAW_DAYS).
	// Default 30 days.
	BESMaxAge time.Duration
	// BESMaxBytes caps the BES stream's size (each partition's stream's,
	// when partitioned); 0 = unlimited.
	BESMaxBytes int64
	// BESPartitions spreads build events over that many streams, BES_0 to
	// BES_<n-1>, each read by its own durable consumer, so that several
	// builds projectors share the work (subjects.BESLayout). 0 or 1: the one
	// stream BES. Every process of a backbone must have the same; it is
	// chosen when the backbone is made (CheckLayout refuses another).
	BESPartitions int
	// DuplicateWindow is how long a Nats-Msg-Id makes a resend a no-op.
	// Default 2m; Bazel's retries span about 9 s.
	DuplicateWindow time.Duration
	// DeadMaxAge is how long dead letters are kept. Default 90 days.
	DeadMaxAge time.Duration
	// FleetNodesMaxAge is how long node transitions and liveness batches
	// are kept. Default 7 days; gateways republish every live session's
	// inventory more often than that (services/fleet), so a replay always
	// finds every live node.
	FleetNodesMaxAge time.Duration
	// FleetResvMaxAge and FleetPlaceMaxAge keep reservation requests and
	// placement decisions. Default 0 = kept until deleted by an operator: a
	// replay rebuilds bookings from the decisions, so every decision of a
	// live reservation must still be there (a few hundred bytes each).
	FleetResvMaxAge  time.Duration
	FleetPlaceMaxAge time.Duration
	// LeaseTTL is how long a key-value lease (the export's, the fold's:
	// streams/lease.go) outlives its holder's last renewal: the lease
	// bucket's MaxAge. A standby takes over at most this long after a
	// holder crashed; a holder that cannot renew for 9/10 of it stops
	// leading. Default 15s.
	LeaseTTL time.Duration
	// PublishTimeout bounds the wait for a stream's acknowledgement of an
	// asynchronous publish (the edges' events): past it the edge answers
	// UNAVAILABLE, which Bazel and the agents retry. A stream leader that
	// lost its quorum takes every message and acknowledges none, so this
	// is how long a client waits on a cluster that lost a majority. The
	// election after a node's loss takes a few seconds, well inside it.
	// Default 10s.
	PublishTimeout time.Duration
}

// Defaults.
const (
	DefaultListen           = "127.0.0.1:4223"
	DefaultDataDir          = "var/nats"
	DefaultSyncInterval     = time.Second
	DefaultMaxPayload       = 8 << 20
	DefaultBESMaxAge        = 30 * 24 * time.Hour
	DefaultDuplicateWindow  = 2 * time.Minute
	DefaultDeadMaxAge       = 90 * 24 * time.Hour
	DefaultFleetNodesMaxAge = 7 * 24 * time.Hour
	DefaultPublishTimeout   = 10 * time.Second
)

// MaxBESPartitions bounds BESPartitions: each partition is a stream, a
// durable consumer and a lease, and far fewer serve the load one builds
// projector cannot (docs/capacity.md).
const MaxBESPartitions = 64

// BESLayout is how build events lie on this backbone.
func (c Config) BESLayout() subjects.BESLayout {
	return subjects.BESLayout{Partitions: c.BESPartitions}
}

// MinLeaseTTL is the shortest LeaseTTL: renewals go every TTL/3, and a
// holder stops leading a tenth of a TTL before the entry could lapse.
const MinLeaseTTL = time.Second

// WithDefaults returns c with zero fields set to their defaults.
func (c Config) WithDefaults() Config {
	if c.DataDir == "" {
		c.DataDir = DefaultDataDir
	}
	if c.AuthDir == "" {
		c.AuthDir = filepath.Join(c.DataDir, "auth")
	}
	if c.Listen == "" {
		c.Listen = DefaultListen
	}
	if c.SyncInterval == 0 {
		c.SyncInterval = DefaultSyncInterval
	}
	if c.MaxPayload == 0 {
		c.MaxPayload = DefaultMaxPayload
	}
	if c.Replicas == 0 {
		c.Replicas = 1
	}
	if c.BESMaxAge == 0 {
		c.BESMaxAge = DefaultBESMaxAge
	}
	if c.DuplicateWindow == 0 {
		c.DuplicateWindow = DefaultDuplicateWindow
	}
	if c.DeadMaxAge == 0 {
		c.DeadMaxAge = DefaultDeadMaxAge
	}
	if c.FleetNodesMaxAge == 0 {
		c.FleetNodesMaxAge = DefaultFleetNodesMaxAge
	}
	if c.LeaseTTL == 0 {
		c.LeaseTTL = DefaultLeaseTTL
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	return c
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	if err := c.notNegative(); err != nil {
		return err
	}
	c = c.WithDefaults()
	var errs []error
	if c.Replicas != 1 && c.Replicas != 3 && c.Replicas != 5 {
		errs = append(errs, fmt.Errorf("replicas must be 1, 3 or 5, not %d", c.Replicas))
	}
	if c.URL == "" && c.Replicas != 1 {
		errs = append(errs, errors.New("the embedded server is one node: replicas must be 1"))
	}
	if c.MaxPayload < 64<<10 {
		errs = append(errs, fmt.Errorf("max payload %d is below 64 KiB", c.MaxPayload))
	}
	if c.DuplicateWindow < 10*time.Second {
		errs = append(errs, fmt.Errorf("duplicate window %s is shorter than a client's retries", c.DuplicateWindow))
	}
	if c.URL != "" {
		if err := c.Auth.Validate(); err != nil {
			errs = append(errs, err)
		}
	} else if c.Auth != (ClientAuth{}) {
		errs = append(errs, errors.New("nats credentials and TLS options are for an external cluster (--nats-url); the embedded server uses its own identities"))
	}
	if c.BESPartitions > MaxBESPartitions {
		errs = append(errs, fmt.Errorf("BES partitions %d: at most %d", c.BESPartitions, MaxBESPartitions))
	}
	if c.LeaseTTL < MinLeaseTTL {
		errs = append(errs, fmt.Errorf("lease TTL %s is below %s", c.LeaseTTL, MinLeaseTTL))
	}
	return errors.Join(errs...)
}

// notNegative refuses a negative field: a mistake, which taking the
// default would hide.
func (c Config) notNegative() error {
	const kept = "kept until deleted"
	return errors.Join(
		knob.NotNegative("streams", "SyncInterval", c.SyncInterval, DefaultSyncInterval),
		knob.NotNegative("streams", "MaxPayload", c.MaxPayload, DefaultMaxPayload),
		knob.NotNegative("streams", "Replicas", c.Replicas, 1),
		knob.NotNegative("streams", "BESMaxAge", c.BESMaxAge, DefaultBESMaxAge),
		knob.NotNegative("streams", "BESMaxBytes", c.BESMaxBytes, "unlimited"),
		knob.NotNegative("streams", "BESPartitions", c.BESPartitions, 1),
		knob.NotNegative("streams", "DuplicateWindow", c.DuplicateWindow, DefaultDuplicateWindow),
		knob.NotNegative("streams", "DeadMaxAge", c.DeadMaxAge, DefaultDeadMaxAge),
		knob.NotNegative("streams", "FleetNodesMaxAge", c.FleetNodesMaxAge, DefaultFleetNodesMaxAge),
		knob.NotNegative("streams", "FleetResvMaxAge", c.FleetResvMaxAge, kept),
		knob.NotNegative("streams", "FleetPlaceMaxAge", c.FleetPlaceMaxAge, kept),
		knob.NotNegative("streams", "LeaseTTL", c.LeaseTTL, DefaultLeaseTTL),
		knob.NotNegative("streams", "PublishTimeout", c.PublishTimeout, DefaultPublishTimeout),
	)
}
