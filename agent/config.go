package agent

import (
	"context"
	"crypto/tls"
	"errors"
	"log/slog"
	"net"
	"time"

	"google.golang.org/grpc"

	"github.com/millrace/millrace/internal/knob"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Defaults for zero Settings fields.
const (
	DefaultHeartbeat     = 10 * time.Second
	DefaultHelloTimeout  = 15 * time.Second
	DefaultBackoffMin    = 100 * time.Millisecond
	DefaultBackoffMax    = 5 * time.Second
	DefaultGaugeInterval = time.Minute
	// DefaultSilenceBeats is how many heartbeat intervals a session may
	// hear nothing from its gateway before the agent gives up on it: one
	// more than the gateway's own heartbeat timeout (3), so that a gateway
	// that is merely slow (acks late under load) is not deserted by all
	// its nodes at once, which would pile a reconnect storm on the load.
	DefaultSilenceBeats = 4
)

// Settings are what every agent of a process may share: where the gateways
// are, how to trust them, timings. Agents read them and never modify them,
// so one Settings value serves any number of agents. A zero duration takes
// its default; a negative one is refused by New, unless its comment gives
// negative a meaning.
type Settings struct {
	// Gateways are the gateway addresses (host:port). Each agent dials them
	// in an order of its own (shuffled) and moves to the next whenever a
	// session ends or cannot start.
	Gateways []string
	// TLS is the client TLS configuration: RootCAs (the fleet CA) and,
	// where the gateways' names differ from their addresses, ServerName.
	// The node certificate comes from Config.Certificate or, when that is
	// nil, from TLS itself (Certificates or GetClientCertificate).
	TLS *tls.Config
	// AgentVersion goes into every Hello.
	AgentVersion string
	// DefaultHeartbeat is the heartbeat interval when a Welcome names
	// none. Zero: DefaultHeartbeat.
	DefaultHeartbeat time.Duration
	// HelloTimeout bounds a dial plus Hello until the Welcome (or
	// Refusal). Zero: DefaultHelloTimeout.
	HelloTimeout time.Duration
	// SilenceTimeout is how long a session may hear nothing at all (no
	// Ack, no Command) while its heartbeats go out before the agent drops
	// it and re-homes: the way to notice a gateway that hangs without
	// closing its connections. Zero: DefaultSilenceBeats heartbeat
	// intervals; negative: never.
	SilenceTimeout time.Duration
	// BackoffMin and BackoffMax bound the redial delay. The first redial
	// after a session that lived waits a random time below BackoffMin;
	// each further failure doubles the bound, up to BackoffMax (half of
	// it fixed, half random). A Refusal's retry_after raises the delay.
	// Zero: DefaultBackoffMin, DefaultBackoffMax; a BackoffMax below
	// BackoffMin is taken as BackoffMin.
	BackoffMin, BackoffMax time.Duration
	// GaugeInterval is how often a status report goes out even though the
	// status did not change, to carry fresh gauges. Zero:
	// DefaultGaugeInterval; negative: never.
	GaugeInterval time.Duration
	// Dialer opens the TCP connection to a gateway (for example from a
	// chosen local address). Nil: the default dialer. Config.Dialer, when
	// set, wins.
	Dialer func(ctx context.Context, addr string) (net.Conn, error)
	// DialOptions are added after the agent's own gRPC options.
	DialOptions []grpc.DialOption
	// Logger receives debug logs of session changes. Nil: none.
	Logger *slog.Logger
}

// validate reports a negative duration that has no meaning.
func (s *Settings) validate() error {
	return errors.Join(
		knob.NotNegative("agent", "DefaultHeartbeat", s.DefaultHeartbeat, DefaultHeartbeat),
		knob.NotNegative("agent", "HelloTimeout", s.HelloTimeout, DefaultHelloTimeout),
		knob.NotNegative("agent", "BackoffMin", s.BackoffMin, DefaultBackoffMin),
		knob.NotNegative("agent", "BackoffMax", s.BackoffMax, DefaultBackoffMax),
	)
}

func (s *Settings) heartbeat(fromWelcome time.Duration) time.Duration {
	if fromWelcome > 0 {
		return fromWelcome
	}
	if s.DefaultHeartbeat > 0 {
		return s.DefaultHeartbeat
	}
	return DefaultHeartbeat
}

func (s *Settings) helloTimeout() time.Duration {
	if s.HelloTimeout > 0 {
		return s.HelloTimeout
	}
	return DefaultHelloTimeout
}

func (s *Settings) silence(interval time.Duration) time.Duration {
	switch {
	case s.SilenceTimeout < 0:
		return 0
	case s.SilenceTimeout > 0:
		return s.SilenceTimeout
	}
	return DefaultSilenceBeats * interval
}

func (s *Settings) backoff() (lo, hi time.Duration) {
	lo, hi = s.BackoffMin, s.BackoffMax
	if lo <= 0 {
		lo = DefaultBackoffMin
	}
	if hi <= 0 {
		hi = DefaultBackoffMax
	}
	return lo, max(lo, hi)
}

func (s *Settings) gaugeInterval() time.Duration {
	switch {
	case s.GaugeInterval < 0:
		return 0
	case s.GaugeInterval > 0:
		return s.GaugeInterval
	}
	return DefaultGaugeInterval
}

// Allocation is an allocation the node holds bound.
type Allocation struct {
	ID            string
	ReservationID string
	GPUIndices    []uint32
	WholeNode     bool
}

// Config is one node's agent.
type Config struct {
	// Settings are shared with other agents; required.
	Settings *Settings
	// NodeID and Pool must match the node certificate (CommonName and
	// OrganizationalUnit).
	NodeID string
	Pool   string
	Labels map[string]string
	// GPUs is the node's inventory, sent in every Hello.
	GPUs []*fleetpb.Gpu
	// Certificate is the node certificate (see Join). Nil: Settings.TLS
	// provides it.
	Certificate *tls.Certificate
	// Allocations are those the node holds bound when the agent starts
	// (a daemon that restarted while its workloads ran).
	Allocations []Allocation
	// Status returns the node's status now; nil means the node sends no
	// status reports. It is called after every Welcome, at every
	// heartbeat and on NotifyStatus; a report goes out only when the GPU
	// states or conditions differ from the last one sent on the session
	// (its seq is set by the agent), or when gauges are due. It must be
	// quick and safe to call from any goroutine.
	Status func() *fleetpb.StatusReport
	// Bind does the node's side of a Bind command; an error makes the
	// agent report FAILED with the error's text. Nil: accept. It is not
	// called for an allocation the node already holds (the agent reports
	// BOUND again). It runs on the session's receive loop, so a slow Bind
	// delays later commands (not heartbeats).
	Bind func(ctx context.Context, cmd *fleetpb.Command) error
	// Unbind releases an allocation; an error makes the agent report
	// FAILED and keep holding it. Nil: accept. Called only for
	// allocations the node holds; an Unbind of one it does not hold is
	// answered UNBOUND at once.
	Unbind func(ctx context.Context, cmd *fleetpb.Command) error
	// Observer receives the agent's events. Nil: none.
	Observer Observer
	// Dialer, when set, replaces Settings.Dialer for this node.
	Dialer func(ctx context.Context, addr string) (net.Conn, error)
}

// Validate reports what is missing.
func (c *Config) Validate() error {
	switch {
	case c.Settings == nil:
		return errors.New("agent: no Settings")
	case len(c.Settings.Gateways) == 0:
		return errors.New("agent: no gateway addresses")
	case c.Settings.TLS == nil:
		return errors.New("agent: no TLS configuration (the gateway speaks mTLS only)")
	case c.NodeID == "":
		return errors.New("agent: no node id")
	case c.Pool == "":
		return errors.New("agent: no pool")
	case len(c.Settings.Gateways) > 1<<16:
		return errors.New("agent: too many gateway addresses")
	}
	for _, g := range c.Settings.Gateways {
		if _, _, err := net.SplitHostPort(g); err != nil {
			return errors.New("agent: gateway address " + g + ": want host:port")
		}
	}
	return c.Settings.validate()
}
