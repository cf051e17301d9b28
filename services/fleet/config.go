package fleet

import (
	"crypto/tls"
	"errors"
	"fmt"
	"os"
	"time"

	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/knob"
)

// Config of a fleet gateway. A zero field takes its default; a negative
// number or duration is refused by New. CA and TLS are required.
type Config struct {
	// GatewayID names this instance in Welcome, node events and liveness
	// batches. Every gateway instance needs its own. Default: the host name.
	GatewayID string
	// CA signs node certificates (Join), and node certificates must chain
	// to it. Required.
	CA *CA
	// TLS is the listener's configuration with the gateway's server
	// certificate (CA.ServerTLS makes one for development). Required.
	// ServerOptions makes it request client certificates; Session verifies
	// them against CA itself, so that Join works without one and a bad
	// certificate gets a Refusal a person can read.
	TLS *tls.Config
	// JoinTokens lets a node exchange a pool's token for a certificate.
	// Empty: Join refuses every call.
	JoinTokens JoinTokens
	// NodeCertValidity is how long a certificate from Join is valid.
	// Default 30 days; a node joins again before it runs out.
	NodeCertValidity time.Duration

	// MaxSessions is the most sessions open (or being opened) at once; more
	// are refused "sessions_full". Default 20,000.
	MaxSessions int
	// HandshakeRate and HandshakeBurst bound new sessions per
	// second (token bucket); more are refused "handshake_rate".
	// Default 1000/s, burst 1000.
	HandshakeRate  float64
	HandshakeBurst int
	// JoinRatePerClient and JoinBurstPerClient bound the Joins of one
	// client address (an IPv6 client's /64) per second; more are refused
	// RESOURCE_EXHAUSTED "join_rate". Joins have buckets of their own
	// (joinlimit.go): a Join flood never refuses session handshakes.
	// Default 1/s, burst 10.
	JoinRatePerClient  float64
	JoinBurstPerClient int
	// JoinRate and JoinBurst bound all Joins together. Default 100/s,
	// burst 200.
	JoinRate  float64
	JoinBurst int
	// TLSHandshakeTimeout bounds a connection's TLS handshake, from the
	// moment it gets a handshake slot: a client that opens TCP and says
	// nothing (or stalls in its handshake) is dropped then, rather than
	// holding a slot. Default 5s (or HelloTimeout, if shorter).
	TLSHandshakeTimeout time.Duration
	// DenyListFile names a deny list of revoked certificate serials and
	// node identities (see ParseDenyList), reloaded when it changes.
	// Empty: nothing is revoked.
	DenyListFile string
	// DenyListCheck is how often DenyListFile is checked for a change.
	// Default 1s.
	DenyListCheck time.Duration
	// MaxHellosInFlight bounds Hellos being checked and published at once;
	// more are refused "hellos_in_flight". Default 256.
	MaxHellosInFlight int
	// HelloTimeout is how long a new session may take to send its Hello.
	// Default 10s.
	HelloTimeout time.Duration

	// HeartbeatInterval is what Welcome tells a node. Default 10s.
	HeartbeatInterval time.Duration
	// HeartbeatTimeout closes a session that sent nothing for this long.
	// Default 3 x HeartbeatInterval.
	HeartbeatTimeout time.Duration
	// FlushInterval is how often the heartbeats heard are published, one
	// LivenessBatch per pool. Default 5s.
	FlushInterval time.Duration
	// ResyncEvery republishes each session's Connected event (jittered per
	// session) so that FLEET_NODES, kept 7 days, always holds every live
	// node's inventory. Default 24h.
	ResyncEvery time.Duration
	// BindWindow is how long a placement decision's binds are kept for
	// nodes that are not (yet) connected here, and how far back a starting
	// gateway reads decisions. Default 2m.
	BindWindow time.Duration

	// MaxMessageBytes is the largest message a node may send; gRPC refuses
	// larger ones (RESOURCE_EXHAUSTED). Default 64 KiB.
	MaxMessageBytes int
	// PublishTimeout bounds how long a Hello waits for its Connected event
	// to be stored before the session is refused "unavailable". Default 10s.
	PublishTimeout time.Duration
	// PublishQueue is how many node events may wait for the backbone;
	// beyond it (after a short wait) an event is dropped and counted.
	// Default 8192.
	PublishQueue int
	// MaxRetryAfter caps the retry_after of a refusal. Default 5m.
	MaxRetryAfter time.Duration

	// Per-session bounds: what one node can make the gateway hold or
	// publish, so that a noisy or hostile node costs the others nothing.
	//
	// ReportRate and ReportBurst bound the status and allocation reports
	// of one session (token bucket; heartbeats are not counted: they are
	// acked, never published one by one). A session over it is closed
	// with Refusal "report_rate" (RESOURCE_EXHAUSTED, with retry_after).
	// Default 20/s, burst 256: a node answers each Command with one report
	// and reports its status when it changes, and a reconnect that
	// delivers every pending bind at once fits in the burst.
	ReportRate  float64
	ReportBurst int
	// MaxHeldAllocations bounds the allocations one session holds: those
	// its Hello lists and those it reports BOUND. A Hello that lists more
	// is refused "invalid"; a BOUND beyond it closes the session with
	// "allocations_full". It also bounds the size of the session's
	// Connected and resync events (at most MaxHeldAllocations x 253 bytes
	// of allocation ids besides the inventory). Default 256 (a node has at
	// most 64 GPUs); at most MaxAllocs (1024).
	MaxHeldAllocations int
	// SessionQueueShare is how many of one session's events may wait in
	// the shared publish queue (PublishQueue) at once. A session at its
	// share waits (up to a second) for its own events to be stored; then
	// a status report is dropped (the next one retries it) and an
	// allocation report closes the session "unavailable", so that the node
	// reports again on a new session. Connected and disconnected events do
	// not count. Default 64; at most PublishQueue.
	SessionQueueShare int
	// DisableResumption turns TLS session tickets off: every session then
	// costs a full handshake. By default a gateway issues tickets with
	// keys derived from the CA key, so that a node re-homing to any
	// gateway of the fleet resumes (tickets.go).
	DisableResumption bool
}

// Defaults.
const (
	DefaultMaxSessions         = 20000
	DefaultHandshakeRate       = 1000
	DefaultHandshakeBurst      = 1000
	DefaultMaxHellosInFlight   = 256
	DefaultJoinRatePerClient   = 1
	DefaultJoinBurstPerClient  = 10
	DefaultJoinRate            = 100
	DefaultJoinBurst           = 200
	DefaultTLSHandshakeTimeout = 5 * time.Second
	DefaultHelloTimeout        = 10 * time.Second
	DefaultHeartbeatInterval   = 10 * time.Second
	DefaultFlushInterval       = 5 * time.Second
	DefaultResyncEvery         = 24 * time.Hour
	DefaultBindWindow          = 2 * time.Minute
	DefaultMaxMessageBytes     = 64 << 10
	DefaultPublishTimeout      = 10 * time.Second
	DefaultPublishQueue        = 8192
	DefaultMaxRetryAfter       = 5 * time.Minute
	DefaultReportRate          = 20
	DefaultReportBurst         = 256
	DefaultMaxHeld             = 256
	DefaultSessionQueueShare   = 64
)

func (c Config) withDefaults() Config {
	if c.GatewayID == "" {
		c.GatewayID, _ = os.Hostname()
		if c.GatewayID == "" {
			c.GatewayID = "gateway"
		}
	}
	if c.NodeCertValidity == 0 {
		c.NodeCertValidity = DefaultNodeCertValidity
	}
	if c.MaxSessions == 0 {
		c.MaxSessions = DefaultMaxSessions
	}
	if c.HandshakeRate == 0 {
		c.HandshakeRate = DefaultHandshakeRate
	}
	if c.HandshakeBurst == 0 {
		c.HandshakeBurst = DefaultHandshakeBurst
	}
	if c.JoinRatePerClient == 0 {
		c.JoinRatePerClient = DefaultJoinRatePerClient
	}
	if c.JoinBurstPerClient == 0 {
		c.JoinBurstPerClient = DefaultJoinBurstPerClient
	}
	if c.JoinRate == 0 {
		c.JoinRate = DefaultJoinRate
	}
	if c.JoinBurst == 0 {
		c.JoinBurst = DefaultJoinBurst
	}
	if c.DenyListCheck == 0 {
		c.DenyListCheck = DefaultDenyListCheck
	}
	if c.MaxHellosInFlight == 0 {
		c.MaxHellosInFlight = DefaultMaxHellosInFlight
	}
	if c.HelloTimeout == 0 {
		c.HelloTimeout = DefaultHelloTimeout
	}
	if c.TLSHandshakeTimeout == 0 {
		c.TLSHandshakeTimeout = min(DefaultTLSHandshakeTimeout, c.HelloTimeout)
	}
	if c.HeartbeatInterval == 0 {
		c.HeartbeatInterval = DefaultHeartbeatInterval
	}
	if c.HeartbeatTimeout == 0 {
		c.HeartbeatTimeout = 3 * c.HeartbeatInterval
	}
	if c.FlushInterval == 0 {
		c.FlushInterval = DefaultFlushInterval
	}
	if c.ResyncEvery == 0 {
		c.ResyncEvery = DefaultResyncEvery
	}
	if c.BindWindow == 0 {
		c.BindWindow = DefaultBindWindow
	}
	if c.MaxMessageBytes == 0 {
		c.MaxMessageBytes = DefaultMaxMessageBytes
	}
	if c.PublishTimeout == 0 {
		c.PublishTimeout = DefaultPublishTimeout
	}
	if c.PublishQueue == 0 {
		c.PublishQueue = DefaultPublishQueue
	}
	if c.MaxRetryAfter == 0 {
		c.MaxRetryAfter = DefaultMaxRetryAfter
	}
	if c.ReportRate == 0 {
		c.ReportRate = DefaultReportRate
	}
	if c.ReportBurst == 0 {
		c.ReportBurst = DefaultReportBurst
	}
	if c.MaxHeldAllocations == 0 {
		c.MaxHeldAllocations = DefaultMaxHeld
	}
	if c.SessionQueueShare == 0 {
		c.SessionQueueShare = min(DefaultSessionQueueShare, c.PublishQueue)
	}
	return c
}

// Validate reports a configuration that cannot work.
func (c Config) Validate() error {
	// Negatives first, on the fields as given: a default derived from a
	// negative field (TLSHandshakeTimeout from HelloTimeout) would be
	// reported as a second mistake.
	errs := []error{c.negatives()}
	c = c.withDefaults()
	if c.CA == nil {
		errs = append(errs, errors.New("fleet: a CA is required (LoadCA, or LoadOrCreateCA in development)"))
	}
	if c.TLS == nil || (len(c.TLS.Certificates) == 0 && c.TLS.GetCertificate == nil && c.TLS.GetConfigForClient == nil) {
		errs = append(errs, errors.New("fleet: a TLS configuration with the gateway's certificate is required (CA.ServerTLS in development)"))
	}
	if err := CheckID("fleet: gateway id", c.GatewayID); err != nil {
		errs = append(errs, err)
	}
	if errs[0] != nil {
		// The checks below compare fields with each other; a negative one
		// would only add confusing errors to the one that matters.
		return errors.Join(errs...)
	}
	if c.NodeCertValidity > 0 && c.NodeCertValidity < time.Hour {
		errs = append(errs, fmt.Errorf("fleet: node certificates valid %s would expire before nodes renew them; use an hour or more", c.NodeCertValidity))
	}
	if c.TLSHandshakeTimeout > c.HelloTimeout {
		errs = append(errs, fmt.Errorf("fleet: TLS handshake timeout %s must not exceed the Hello timeout %s (which bounds the whole connection set-up)", c.TLSHandshakeTimeout, c.HelloTimeout))
	}
	if c.HeartbeatTimeout <= c.HeartbeatInterval {
		errs = append(errs, fmt.Errorf("fleet: heartbeat timeout %s must exceed the heartbeat interval %s", c.HeartbeatTimeout, c.HeartbeatInterval))
	}
	if c.FlushInterval >= c.HeartbeatTimeout {
		errs = append(errs, fmt.Errorf("fleet: liveness flush interval %s must be shorter than the heartbeat timeout %s", c.FlushInterval, c.HeartbeatTimeout))
	}
	if c.MaxMessageBytes > 0 && (c.MaxMessageBytes < 4<<10 || c.MaxMessageBytes > 4<<20) {
		errs = append(errs, fmt.Errorf("fleet: max message size %d must be between 4 KiB and 4 MiB", c.MaxMessageBytes))
	}
	if c.MaxHeldAllocations > MaxAllocs {
		errs = append(errs, fmt.Errorf("fleet: max held allocations %d is over the protocol's limit of %d", c.MaxHeldAllocations, MaxAllocs))
	}
	if c.SessionQueueShare > c.PublishQueue {
		errs = append(errs, fmt.Errorf("fleet: a session's share %d of the publish queue exceeds the queue (%d): one node could fill it", c.SessionQueueShare, c.PublishQueue))
	}
	if c.ResyncEvery > 0 && c.ResyncEvery > 5*24*time.Hour {
		errs = append(errs, fmt.Errorf("fleet: resync every %s would let FLEET_NODES (7 days) lose live nodes' inventory; use at most 5 days", c.ResyncEvery))
	}
	return errors.Join(errs...)
}

// negatives reports every field that is negative (none has a meaning for
// a negative value).
func (c Config) negatives() error {
	return errors.Join(
		knob.NotNegative("fleet", "NodeCertValidity", c.NodeCertValidity, DefaultNodeCertValidity),
		knob.NotNegative("fleet", "MaxSessions", c.MaxSessions, DefaultMaxSessions),
		knob.NotNegative("fleet", "HandshakeRate", c.HandshakeRate, DefaultHandshakeRate),
		knob.NotNegative("fleet", "HandshakeBurst", c.HandshakeBurst, DefaultHandshakeBurst),
		knob.NotNegative("fleet", "JoinRatePerClient", c.JoinRatePerClient, DefaultJoinRatePerClient),
		knob.NotNegative("fleet", "JoinBurstPerClient", c.JoinBurstPerClient, DefaultJoinBurstPerClient),
		knob.NotNegative("fleet", "JoinRate", c.JoinRate, DefaultJoinRate),
		knob.NotNegative("fleet", "JoinBurst", c.JoinBurst, DefaultJoinBurst),
		knob.NotNegative("fleet", "TLSHandshakeTimeout", c.TLSHandshakeTimeout, "5s, or HelloTimeout if shorter"),
		knob.NotNegative("fleet", "DenyListCheck", c.DenyListCheck, DefaultDenyListCheck),
		knob.NotNegative("fleet", "MaxHellosInFlight", c.MaxHellosInFlight, DefaultMaxHellosInFlight),
		knob.NotNegative("fleet", "HelloTimeout", c.HelloTimeout, DefaultHelloTimeout),
		knob.NotNegative("fleet", "HeartbeatInterval", c.HeartbeatInterval, DefaultHeartbeatInterval),
		knob.NotNegative("fleet", "HeartbeatTimeout", c.HeartbeatTimeout, "3 x HeartbeatInterval"),
		knob.NotNegative("fleet", "FlushInterval", c.FlushInterval, DefaultFlushInterval),
		knob.NotNegative("fleet", "ResyncEvery", c.ResyncEvery, DefaultResyncEvery),
		knob.NotNegative("fleet", "BindWindow", c.BindWindow, DefaultBindWindow),
		knob.NotNegative("fleet", "MaxMessageBytes", c.MaxMessageBytes, DefaultMaxMessageBytes),
		knob.NotNegative("fleet", "PublishTimeout", c.PublishTimeout, DefaultPublishTimeout),
		knob.NotNegative("fleet", "PublishQueue", c.PublishQueue, DefaultPublishQueue),
		knob.NotNegative("fleet", "MaxRetryAfter", c.MaxRetryAfter, DefaultMaxRetryAfter),
		knob.NotNegative("fleet", "ReportRate", c.ReportRate, DefaultReportRate),
		knob.NotNegative("fleet", "ReportBurst", c.ReportBurst, DefaultReportBurst),
		knob.NotNegative("fleet", "MaxHeldAllocations", c.MaxHeldAllocations, DefaultMaxHeld),
		knob.NotNegative("fleet", "SessionQueueShare", c.SessionQueueShare, "64, or PublishQueue if smaller"),
	)
}

// JoinTokens maps join tokens to pools: an apikey.Table, kept as digests
// and compared in constant time, shared by the copies of a Config (a
// reload replaces its tokens for all). The zero value has no tokens.
type JoinTokens struct{ *apikey.Table[string] }

var tokenSyntax = apikey.Syntax[string]{
	Package: "fleet", What: "join token", Name: "pool", Form: "pool=token",
	Principal: func(pool string) (string, error) { return pool, CheckID("the pool", pool) },
}

// ParseJoinTokens reads "pool=token,pool=token" (or one pair per line;
// lines starting with # are comments; the syntax is apikey's). A pool may
// have several tokens, each at least 16 characters.
func ParseJoinTokens(s string) (JoinTokens, error) {
	t, err := apikey.Parse(s, tokenSyntax)
	return JoinTokens{t}, err
}

// Pool returns the pool a token admits to.
func (k JoinTokens) Pool(token string) (string, bool) { return k.Lookup(token) }
