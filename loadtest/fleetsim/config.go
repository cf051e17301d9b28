package fleetsim

import (
	"errors"
	"flag"
	"fmt"
	"net"
	"strconv"
	"strings"
	"time"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/knob"
)

// Model is a GPU model of the simulated inventory.
type Model struct {
	Name      string
	MemoryMiB uint64
}

// Config is one simulator run. The zero value of a field takes the default
// named in its flag (RegisterFlags); Validate checks the rest.
type Config struct {
	// Gateways are the fleet gateway addresses (host:port).
	Gateways []string
	// ServerName overrides the name checked in the gateways' certificates
	// (default: the host of the address dialed).
	ServerName string

	// Nodes is how many nodes this process simulates; their ids are
	// NodePrefix + a zero-padded number from FirstNode (so that several
	// processes can simulate one fleet without overlapping).
	Nodes      int
	FirstNode  int
	NodePrefix string
	Pool       string
	// GPUsPerNode and Models make the inventory: node i has GPUsPerNode
	// GPUs of model Models[i % len(Models)].
	GPUsPerNode int
	Models      []Model

	// Node certificates: either issued here from CACert and CAKey (PEM
	// files; the CA the gateways trust, e.g. the dev CA), or from the
	// gateways with Join, using JoinToken for every node or one token per
	// node (line) from JoinTokensFile. GatewayCA is the PEM bundle to
	// trust the gateways with (default CACert; required for Join).
	CACert, CAKey   string
	GatewayCA       string
	JoinToken       string
	JoinTokensFile  string
	JoinConcurrency int

	// Duration is how long the load runs, from the first dial; Ramp
	// spreads the nodes' first dials over its start (0: one second per
	// DefaultRampRate nodes; negative: all at once); Settle is how long
	// to wait after the load for placed allocations to be bound, crashed
	// nodes to come back and storm re-homes to finish.
	Duration, Ramp, Settle time.Duration

	// SilenceTimeout is how long an agent waits for anything from its
	// gateway before it leaves it (agent.Settings.SilenceTimeout; 0: four
	// heartbeat intervals, negative: never).
	SilenceTimeout time.Duration

	// StatusRate is status changes per second over the fleet (a GPU's
	// health flips); GaugeInterval is each node's gauge-only reports
	// (negative: none).
	StatusRate    float64
	GaugeInterval time.Duration
	// CrashRate is crashes per minute over the fleet: a connected node
	// goes silent (suspended: no heartbeats, no answers, connection left
	// open) for CrashFor, or for good when CrashFor is negative.
	CrashRate float64
	CrashFor  time.Duration
	// StormAt, when positive, drops every session at once that long after
	// the start (a reconnect storm); every node redials.
	StormAt time.Duration

	// Reservations: ReservationRate creates per second through the
	// Reservations gRPC API at ReservationsAddr (plaintext unless
	// ReservationsCA is set), with APIKey as "authorization: Bearer".
	// Each is cancelled after ReservationHold (negative: never).
	ReservationsAddr string
	ReservationsCA   string
	APIKey           string
	ReservationRate  float64
	ReservationHold  time.Duration

	// NATSURL, when set, is where placement decisions are read
	// (fleet.place.<pool>); DatabaseURL, when set, gives liveness lag,
	// unreachable marks and double bookings (and placements, without NATS).
	NATSURL string
	// NATSNKey is a user nkey seed file for NATSURL (dev's embedded server
	// admits only its identities: var/nats/auth/reader.nk reads).
	NATSNKey    string
	DatabaseURL string
	// GatewayPIDs are gateway processes on this machine whose resident
	// memory is measured (/proc/<pid>/status VmRSS).
	GatewayPIDs []int
	// UnreachableAfter is the liveness grace: a node down for less than
	// this must never be marked unreachable.
	UnreachableAfter time.Duration
	// LivenessSamples is how many heartbeats per second are followed until
	// fleet_nodes.last_seen covers them.
	LivenessSamples float64

	// ProgressEvery is the progress line's period (negative: none).
	ProgressEvery time.Duration
	// LocalAddrs are the source addresses to spread the nodes' connections
	// over: "auto" (several 127.0.0.x when the gateways are on loopback
	// and there are many nodes), a count n (127.0.0.1..n), or a
	// comma-separated list of IPs.
	LocalAddrs string
	// Out is where the caller writes the JSON report ("-": stdout); Run
	// itself does not write it (WriteReport does).
	Out string
	// Seed makes the random choices repeatable; 0 picks one.
	Seed uint64
	// GCPercent is the Go garbage collector's target (GOGC) while the
	// simulator runs: its heap is large (thousands of agents with their
	// TLS and gRPC state) and, at the default 100, collecting it took a
	// fifth of the machine during a re-home, CPU the gateway under test
	// then lacked. 0: DefaultGCPercent; negative: leave it as it is.
	GCPercent int

	// flags is the flag set RegisterFlags registered on: Validate reports
	// its environment variables that did not parse and its negative values.
	flags *flag.FlagSet
}

// Defaults.
const (
	DefaultGateway          = "127.0.0.1:1986"
	DefaultNodes            = 1000
	DefaultNodePrefix       = "sim-"
	DefaultPool             = "sim"
	DefaultGPUsPerNode      = 8
	DefaultModels           = "H100:81559,A100:81920,L40S:46068"
	DefaultJoinConcurrency  = 16
	DefaultDuration         = 60 * time.Second
	DefaultRampRate         = 500 // nodes per second
	DefaultSettle           = 10 * time.Second
	DefaultGaugeInterval    = time.Minute
	DefaultCrashFor         = 20 * time.Second
	DefaultReservationHold  = 30 * time.Second
	DefaultUnreachableAfter = 40 * time.Second
	DefaultLivenessSamples  = 2
	DefaultProgressEvery    = 5 * time.Second
	DefaultGCPercent        = 400
)

func (c Config) withDefaults() Config {
	if c.GCPercent == 0 {
		c.GCPercent = DefaultGCPercent
	}
	if len(c.Gateways) == 0 {
		c.Gateways = []string{DefaultGateway}
	}
	if c.Nodes == 0 {
		c.Nodes = DefaultNodes
	}
	if c.NodePrefix == "" {
		c.NodePrefix = DefaultNodePrefix
	}
	if c.Pool == "" {
		c.Pool = DefaultPool
	}
	if c.GPUsPerNode == 0 {
		c.GPUsPerNode = DefaultGPUsPerNode
	}
	if len(c.Models) == 0 {
		c.Models, _ = ParseModels(DefaultModels)
	}
	if c.GatewayCA == "" {
		c.GatewayCA = c.CACert
	}
	if c.JoinConcurrency == 0 {
		c.JoinConcurrency = DefaultJoinConcurrency
	}
	if c.Duration == 0 {
		c.Duration = DefaultDuration
	}
	if c.Ramp == 0 {
		c.Ramp = max(time.Second, time.Duration(c.Nodes)*time.Second/DefaultRampRate)
	}
	if c.Settle == 0 {
		c.Settle = DefaultSettle
	}
	if c.GaugeInterval == 0 {
		c.GaugeInterval = DefaultGaugeInterval
	}
	if c.CrashFor == 0 {
		c.CrashFor = DefaultCrashFor
	}
	if c.ReservationHold == 0 {
		c.ReservationHold = DefaultReservationHold
	}
	if c.UnreachableAfter == 0 {
		c.UnreachableAfter = DefaultUnreachableAfter
	}
	if c.LivenessSamples == 0 {
		c.LivenessSamples = DefaultLivenessSamples
	}
	if c.ProgressEvery == 0 {
		c.ProgressEvery = DefaultProgressEvery
	}
	if c.LocalAddrs == "" {
		c.LocalAddrs = "auto"
	}
	return c
}

// Validate checks the configuration (with defaults applied).
func (c Config) Validate() error {
	c = c.withDefaults()
	var errs []error
	if c.flags != nil {
		errs = append(errs, envflag.Errors(c.flags))
	}
	for _, g := range c.Gateways {
		if _, _, err := net.SplitHostPort(g); err != nil {
			errs = append(errs, fmt.Errorf("gateway address %q: want host:port", g))
		}
	}
	errs = append(errs,
		knob.NotNegative("", "-nodes", c.Nodes, DefaultNodes),
		knob.NotNegative("", "-first-node", c.FirstNode, "0"),
		knob.NotNegative("", "-join-concurrency", c.JoinConcurrency, DefaultJoinConcurrency),
		knob.NotNegative("", "-duration", c.Duration, DefaultDuration),
		knob.NotNegative("", "-settle", c.Settle, DefaultSettle),
		knob.NotNegative("", "-storm-at", c.StormAt, "no storm"),
		knob.NotNegative("", "-unreachable-after", c.UnreachableAfter, DefaultUnreachableAfter),
		knob.NotNegative("", "-status-rate", c.StatusRate, "none"),
		knob.NotNegative("", "-crash-rate", c.CrashRate, "none"),
		knob.NotNegative("", "-reservation-rate", c.ReservationRate, "none"),
		knob.NotNegative("", "-liveness-samples", c.LivenessSamples, DefaultLivenessSamples),
	)
	if c.GPUsPerNode < 0 || c.GPUsPerNode > 64 {
		errs = append(errs, fmt.Errorf("gpus per node %d: want 1..64", c.GPUsPerNode))
	}
	ca := c.CACert != "" || c.CAKey != ""
	join := c.JoinToken != "" || c.JoinTokensFile != ""
	switch {
	case ca && join:
		errs = append(errs, errors.New("node certificates: give either a CA (ca-cert, ca-key) or a join token, not both"))
	case ca && (c.CACert == "" || c.CAKey == ""):
		errs = append(errs, errors.New("node certificates from a CA need both ca-cert and ca-key"))
	case !ca && !join:
		errs = append(errs, errors.New("node certificates: give a CA (ca-cert and ca-key: fastest) or a join token (join-token or join-tokens)"))
	case join && c.GatewayCA == "":
		errs = append(errs, errors.New("join: gateway-ca (the CA bundle that signs the gateways' certificates) is required"))
	}
	if c.ReservationRate > 0 && c.ReservationsAddr == "" {
		errs = append(errs, errors.New("reservation rate set without a reservations address"))
	}
	if _, err := c.localIPs(); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// ParseModels reads "NAME:MEMORY_MIB,...".
func ParseModels(s string) ([]Model, error) {
	var ms []Model
	for _, part := range strings.Split(s, ",") {
		part = strings.TrimSpace(part)
		if part == "" {
			continue
		}
		name, mem, ok := strings.Cut(part, ":")
		n, err := strconv.ParseUint(mem, 10, 64)
		if !ok || name == "" || err != nil {
			return nil, fmt.Errorf("model %q: want NAME:MEMORY_MIB", part)
		}
		ms = append(ms, Model{Name: name, MemoryMiB: n})
	}
	if len(ms) == 0 {
		return nil, errors.New("no GPU models")
	}
	return ms, nil
}

// Description is the help of `millrace loadtest fleet`, beside the flags it
// describes (RegisterFlags).
const Description = `Runs N simulated GPU nodes in this process, each with a real session over TLS to
the given gateways: heartbeats, status changes, crashes and a reconnect storm;
creates reservations at a rate through the reservations API. Prints progress
to stderr and writes a JSON report (-out; - for stdout): sessions held, gateway
RSS per session, placements/s, place-to-active p50/p99, re-home times,
liveness lag, false unreachable marks and double bookings (must be 0).
See loadtest/fleetsim/README.md.`

// RegisterFlags registers a flag for every field on fs, each defaulting to
// its environment variable when set (the command line wins over the
// environment, the environment over the default): MILLRACE_FLEETSIM_*,
// plus MILLRACE_NATS_URL and DATABASE_URL.
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	c.flags = fs
	e := envflag.Set{FS: fs, Prefix: "MILLRACE_FLEETSIM_"}
	e.List(&c.Gateways, "gateways", "GATEWAYS", DefaultGateway, "fleet gateway addresses, comma-separated")
	e.String(&c.ServerName, "server-name", "SERVER_NAME", "", "name to check in the gateways' certificates (default: the address' host)")
	e.Int(&c.Nodes, "nodes", "NODES", DefaultNodes, "simulated nodes in this process (one connection each: see the open-files limit)")
	e.Int(&c.FirstNode, "first-node", "FIRST_NODE", 0, "number of the first node, to split one fleet across processes")
	e.String(&c.NodePrefix, "node-prefix", "NODE_PREFIX", DefaultNodePrefix, "node id prefix")
	e.String(&c.Pool, "pool", "POOL", DefaultPool, "the nodes' pool")
	e.Int(&c.GPUsPerNode, "gpus-per-node", "GPUS_PER_NODE", DefaultGPUsPerNode, "GPUs per node")
	e.Func("models", "MODELS", fmt.Sprintf("GPU models NAME:MEMORY_MIB, comma-separated; node i has the (i mod n)th (default %q)", DefaultModels), func(s string) error {
		m, err := ParseModels(s)
		c.Models = m
		return err
	})
	e.String(&c.CACert, "ca-cert", "CA_CERT", "", "PEM CA certificate to issue node certificates from (with ca-key; faster than join for many nodes)")
	e.String(&c.CAKey, "ca-key", "CA_KEY", "", "PEM private key of ca-cert")
	e.String(&c.GatewayCA, "gateway-ca", "GATEWAY_CA", "", "PEM bundle to trust the gateways with (default: ca-cert)")
	e.String(&c.JoinToken, "join-token", "JOIN_TOKEN", "", "join token used for every node (Gateway.Join)")
	e.String(&c.JoinTokensFile, "join-tokens", "JOIN_TOKENS", "", "file of join tokens, one per line, one per node")
	e.Int(&c.JoinConcurrency, "join-concurrency", "JOIN_CONCURRENCY", DefaultJoinConcurrency, "concurrent Join calls")
	e.Duration(&c.Duration, "duration", "DURATION", DefaultDuration, "how long the load runs, from the first dial")
	e.SignedDuration(&c.Ramp, "ramp", "RAMP", 0, fmt.Sprintf("spread the nodes' first dials over this (0: a second per %d nodes; negative: all at once)", DefaultRampRate))
	e.Duration(&c.Settle, "settle", "SETTLE", DefaultSettle, "after the load, wait up to this for placed allocations to be bound, crashes to end and the storm to pass")
	e.SignedDuration(&c.SilenceTimeout, "silence-timeout", "SILENCE_TIMEOUT", 0, "agents leave a gateway they heard nothing from for this long (0: four heartbeat intervals; negative: never)")
	e.Float(&c.StatusRate, "status-rate", "STATUS_RATE", 0, "status changes per second over the fleet")
	e.SignedDuration(&c.GaugeInterval, "gauge-interval", "GAUGE_INTERVAL", DefaultGaugeInterval, "each node's gauge-only status reports (negative: none)")
	e.Float(&c.CrashRate, "crash-rate", "CRASH_RATE", 0, "node crashes per minute over the fleet (a node goes silent, connection left open)")
	e.SignedDuration(&c.CrashFor, "crash-for", "CRASH_FOR", DefaultCrashFor, "how long a crashed node stays silent (negative: for good)")
	e.Duration(&c.StormAt, "storm-at", "STORM_AT", 0, "drop every session at once this long after the start (0: no storm)")
	e.String(&c.ReservationsAddr, "reservations", "RESERVATIONS", "", "Reservations gRPC address")
	e.String(&c.ReservationsCA, "reservations-ca", "RESERVATIONS_CA", "", "PEM CA to reach the Reservations API over TLS (default: plaintext)")
	e.String(&c.APIKey, "api-key", "API_KEY", "", "API key for the Reservations API")
	e.Float(&c.ReservationRate, "reservation-rate", "RESERVATION_RATE", 0, "reservations created per second")
	e.SignedDuration(&c.ReservationHold, "reservation-hold", "RESERVATION_HOLD", DefaultReservationHold, "cancel each reservation this long after creating it (negative: never)")
	envflag.String(fs, &c.NATSURL, "nats-url", "MILLRACE_NATS_URL", "", "NATS to read placement decisions from (fleet.place.<pool>)")
	envflag.String(fs, &c.NATSNKey, "nats-nkey", "MILLRACE_NATS_NKEY", "", "nkey seed file for --nats-url (against millrace dev: var/nats/auth/reader.nk)")
	envflag.String(fs, &c.DatabaseURL, "database-url", "DATABASE_URL", "", "PostgreSQL of the fleet projections: liveness lag, unreachable marks, double bookings")
	e.Func("gateway-pids", "GATEWAY_PIDS", "gateway process ids whose memory to measure, comma-separated", func(s string) error {
		p, err := parsePIDs(s)
		c.GatewayPIDs = p
		return err
	})
	e.Duration(&c.UnreachableAfter, "unreachable-after", "UNREACHABLE_AFTER", DefaultUnreachableAfter, "liveness grace: a node down for less must never be marked unreachable")
	e.Float(&c.LivenessSamples, "liveness-samples", "LIVENESS_SAMPLES", DefaultLivenessSamples, "heartbeats per second followed into fleet_nodes.last_seen")
	e.SignedDuration(&c.ProgressEvery, "progress", "PROGRESS", DefaultProgressEvery, "progress line period (negative: none)")
	e.String(&c.LocalAddrs, "local-addrs", "LOCAL_ADDRS", "auto", `source addresses: "auto", a count n (127.0.0.1..n) or IPs, comma-separated`)
	e.String(&c.Out, "out", "OUT", "", `write the JSON report here ("-": stdout)`)
	e.SignedInt(&c.GCPercent, "gogc", "GOGC", DefaultGCPercent, "the simulator's garbage collector target while it runs (negative: leave GOGC as it is)")
	e.Var(seedValue{c}, "seed", "SEED", "random seed (0: random)")
}

// seedValue writes -seed straight into Config.Seed.
type seedValue struct{ c *Config }

func (v seedValue) String() string {
	if v.c == nil {
		return "0"
	}
	return strconv.FormatUint(v.c.Seed, 10)
}

func (v seedValue) Set(s string) error {
	n, err := strconv.ParseUint(s, 10, 64)
	v.c.Seed = n
	return err
}

func parsePIDs(s string) ([]int, error) {
	var out []int
	for _, p := range strings.Split(s, ",") {
		if p = strings.TrimSpace(p); p == "" {
			continue
		}
		n, err := strconv.Atoi(p)
		if err != nil || n <= 0 {
			return nil, fmt.Errorf("pid %q: want a positive number", p)
		}
		out = append(out, n)
	}
	return out, nil
}
