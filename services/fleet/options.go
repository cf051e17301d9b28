package fleet

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/internal/tlsfiles"
	"github.com/millrace/millrace/streams"
)

// Options are a gateway's knobs as an operator sets them: the Config
// fields a flag sets as they are, and what Load turns into the rest (the
// listener, files of the CA, the certificate and the join tokens, rates
// that set a rate and a burst at once). A process that runs a gateway
// registers them (RegisterFlags) and Starts it.
type Options struct {
	// Config holds the fields set straight from a flag; Load fills in the
	// others.
	Config Config
	// Listen is the gRPC address; its port also names the gateway when
	// Config.GatewayID is empty.
	Listen string
	// CADir, CACert and CAKey say where the CA is (Credentials).
	CADir, CACert, CAKey string
	// TLSCert and TLSKey are the gateway's own certificate; TLSHosts are
	// comma-separated names added to the one the CA issues without them.
	TLSCert, TLSKey, TLSHosts string
	// JoinTokens (inline, pool=token,...) and JoinTokensFile (reloaded when
	// it changes) are the join tokens together.
	JoinTokens, JoinTokensFile string
	// Rates per second; each sets its Config rate and the burst that goes
	// with it (HandshakeBurst = HandshakeRate, JoinBurst = 2 x JoinRate).
	HandshakeRate, JoinRate, JoinRatePerClient, ReportRate int
	// Resumption issues TLS session tickets (Config.DisableResumption is
	// its opposite: a flag that defaults to on reads better).
	Resumption bool
	// DevSecrets, when not empty, is the directory where a development
	// secret is made and kept if none is configured (keyfile.Source). It
	// is no flag: a development process sets it.
	DevSecrets string
}

// RegisterFlags registers the gateway's flags (--fleet-*), each with its
// MILLRACE_FLEET_* variable, on fs.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	c := &o.Config
	envflag.String(fs, &o.Listen, "fleet-listen", "MILLRACE_FLEET_LISTEN", "127.0.0.1:1986", "fleet gateway gRPC address (mTLS): node sessions and Join")
	envflag.String(fs, &c.GatewayID, "fleet-gateway-id", "MILLRACE_FLEET_GATEWAY_ID", "", "this gateway instance's id (default: host name and listen port); every instance needs its own")
	envflag.String(fs, &o.CADir, "fleet-ca-dir", "MILLRACE_FLEET_CA_DIR", "var/fleet/ca", "directory of the fleet CA (ca.crt, ca.key), created on first start when --fleet-ca-cert is not given")
	envflag.String(fs, &o.CACert, "fleet-ca-cert", "MILLRACE_FLEET_CA_CERT", "", "PEM file of the CA that signs node certificates (with --fleet-ca-key); overrides --fleet-ca-dir")
	envflag.String(fs, &o.CAKey, "fleet-ca-key", "MILLRACE_FLEET_CA_KEY", "", "PEM file of the CA's private key")
	envflag.String(fs, &o.TLSCert, "fleet-tls-cert", "MILLRACE_FLEET_TLS_CERT", "", "PEM server certificate of the gateway (with --fleet-tls-key); default: one issued by the fleet CA")
	envflag.String(fs, &o.TLSKey, "fleet-tls-key", "MILLRACE_FLEET_TLS_KEY", "", "PEM private key of --fleet-tls-cert")
	envflag.String(fs, &o.TLSHosts, "fleet-tls-hosts", "MILLRACE_FLEET_TLS_HOSTS", "", "extra host names and IPs, comma-separated, for the CA-issued server certificate (localhost and the listen host are always in)")
	envflag.String(fs, &o.JoinTokens, "fleet-join-tokens", "MILLRACE_FLEET_JOIN_TOKENS", "", "join tokens as pool=token,pool=token (a node exchanges one for a certificate)")
	envflag.String(fs, &o.JoinTokensFile, "fleet-join-tokens-file", "MILLRACE_FLEET_JOIN_TOKENS_FILE", "", "file of pool=token lines (added to --fleet-join-tokens)")
	envflag.Int(fs, &c.MaxSessions, "fleet-max-sessions", "MILLRACE_FLEET_MAX_SESSIONS", DefaultMaxSessions, "most node sessions this gateway holds; more are refused with a retry-after")
	envflag.Int(fs, &o.HandshakeRate, "fleet-handshake-rate", "MILLRACE_FLEET_HANDSHAKE_RATE", DefaultHandshakeRate, "new sessions accepted per second (token bucket, burst the same); Joins have their own limits")
	envflag.Int(fs, &c.MaxHellosInFlight, "fleet-max-hellos-in-flight", "MILLRACE_FLEET_MAX_HELLOS_IN_FLIGHT", DefaultMaxHellosInFlight, "Hellos being checked and stored at once")
	envflag.Duration(fs, &c.HeartbeatInterval, "fleet-heartbeat-interval", "MILLRACE_FLEET_HEARTBEAT_INTERVAL", DefaultHeartbeatInterval, "how often nodes send a heartbeat (told in Welcome)")
	envflag.Duration(fs, &c.FlushInterval, "fleet-flush-interval", "MILLRACE_FLEET_FLUSH_INTERVAL", DefaultFlushInterval, "how often heartbeat ages are published, one batch per pool")
	envflag.Duration(fs, &c.BindWindow, "fleet-bind-window", "MILLRACE_FLEET_BIND_WINDOW", DefaultBindWindow, "how long a gateway keeps binds for nodes not connected to it")
	envflag.Bool(fs, &o.Resumption, "fleet-tls-resumption", "MILLRACE_FLEET_TLS_RESUMPTION", true, "TLS session tickets (keys derived from the CA key, shared by every gateway of the fleet) so that re-homing nodes resume rather than redo a full handshake")
	envflag.Duration(fs, &c.NodeCertValidity, "fleet-node-cert-validity", "MILLRACE_FLEET_NODE_CERT_VALIDITY", DefaultNodeCertValidity, "validity of node certificates issued by Join")
	envflag.Int(fs, &o.ReportRate, "fleet-report-rate", "MILLRACE_FLEET_REPORT_RATE", DefaultReportRate, "status and allocation reports per second one node session may send (token bucket); a node over it is refused report_rate")
	envflag.Int(fs, &c.ReportBurst, "fleet-report-burst", "MILLRACE_FLEET_REPORT_BURST", DefaultReportBurst, "burst of --fleet-report-rate (a reconnect answering every pending bind at once must fit)")
	envflag.Int(fs, &c.MaxHeldAllocations, "fleet-max-held-allocations", "MILLRACE_FLEET_MAX_HELD_ALLOCATIONS", DefaultMaxHeld, "allocations one node session may hold (Hello list and BOUND reports); bounds its Connected and resync events")
	envflag.Int(fs, &c.SessionQueueShare, "fleet-session-queue-share", "MILLRACE_FLEET_SESSION_QUEUE_SHARE", DefaultSessionQueueShare, "events of one node session that may wait in the gateway's shared publish queue at once")
	envflag.Int(fs, &o.JoinRatePerClient, "fleet-join-rate-per-client", "MILLRACE_FLEET_JOIN_RATE_PER_CLIENT", DefaultJoinRatePerClient, "Joins per second from one client address (an IPv6 client's /64); apart from session handshakes, so a Join flood never refuses reconnecting nodes")
	envflag.Int(fs, &c.JoinBurstPerClient, "fleet-join-burst-per-client", "MILLRACE_FLEET_JOIN_BURST_PER_CLIENT", DefaultJoinBurstPerClient, "Joins one client address may make at once (token bucket burst)")
	envflag.Int(fs, &o.JoinRate, "fleet-join-rate", "MILLRACE_FLEET_JOIN_RATE", DefaultJoinRate, "Joins per second from all clients together (burst twice this)")
	envflag.Duration(fs, &c.TLSHandshakeTimeout, "fleet-tls-handshake-timeout", "MILLRACE_FLEET_TLS_HANDSHAKE_TIMEOUT", DefaultTLSHandshakeTimeout, "a connection's TLS handshake must finish this soon after it starts (a client that opens TCP and says nothing is dropped then)")
	envflag.String(fs, &c.DenyListFile, "fleet-deny-list", "MILLRACE_FLEET_DENY_LIST", "", "file of revoked node certificate serials (hex) and node identities (pool/node), one per line, # comments; reloaded when it changes (checked every second): revoked sessions are closed and refused")
}

// Load makes the gateway's Config: it loads the CA and the TLS material
// and the join tokens, which stay current with their file until ctx ends
// (keyfile.Load; kf counts the reloads). A half pair of CA or TLS files
// is an envflag.UsageError naming the pair's flags.
func (o Options) Load(ctx context.Context, kf *keyfile.Metrics, log *slog.Logger) (Config, error) {
	hosts := envflag.SplitList(o.TLSHosts)
	if h, _, err := net.SplitHostPort(o.Listen); err == nil && h != "" {
		hosts = append(hosts, h)
	}
	ca, tc, err := Credentials{CACert: o.CACert, CAKey: o.CAKey, CADir: o.CADir, Cert: o.TLSCert, Key: o.TLSKey, Hosts: hosts}.Load()
	if errors.Is(err, tlsfiles.ErrHalfPair) {
		// Credentials names the files' roles, not the flags an operator
		// set: the usage error says which pair to complete.
		pair := "--fleet-tls-cert and --fleet-tls-key"
		if (o.CACert == "") != (o.CAKey == "") {
			pair = "--fleet-ca-cert and --fleet-ca-key"
		}
		return Config{}, envflag.Usage(pair + " go together")
	}
	if err != nil {
		return Config{}, err
	}
	src := keyfile.Source{Inline: o.JoinTokens, File: o.JoinTokensFile, DevDir: o.DevSecrets, DevFile: "join-tokens", DevName: "default", What: "join tokens"}
	tokens, err := keyfile.Load(ctx, src, tokenSyntax, kf, log)
	if err != nil {
		return Config{}, err
	}
	c := o.Config
	c.CA, c.TLS, c.JoinTokens, c.DisableResumption = ca, tc, JoinTokens{tokens}, !o.Resumption
	if c.GatewayID == "" {
		// The port tells apart the gateways of one host (Config's own
		// default, the host name alone, would not).
		host, _ := os.Hostname()
		_, port, _ := net.SplitHostPort(o.Listen)
		c.GatewayID = host + "-" + port
	}
	c.HandshakeRate, c.HandshakeBurst = float64(o.HandshakeRate), o.HandshakeRate
	c.JoinRatePerClient, c.JoinRate, c.JoinBurst = float64(o.JoinRatePerClient), float64(o.JoinRate), 2*o.JoinRate
	c.ReportRate = float64(o.ReportRate)
	return c, nil
}

// Gateway is a running gateway: its gRPC server and its background loops
// (Server.Run), which Stop ends in the order the Server needs.
type Gateway struct {
	*supervise.GRPCServer
	srv    *Server
	runEnd chan struct{}
	cancel context.CancelFunc
}

// Start loads o (Load), listens on o.Listen and serves the gateway on bb,
// its loops running until Stop. reg gets the gateway's metrics, kf the
// join tokens' reloads; a nil log is slog.Default.
func Start(ctx context.Context, o Options, bb *streams.Backbone, reg prometheus.Registerer, kf *keyfile.Metrics, log *slog.Logger) (*Gateway, error) {
	if log == nil {
		log = slog.Default()
	}
	log = log.With("component", "fleet")
	cfg, err := o.Load(ctx, kf, log)
	if err != nil {
		return nil, err
	}
	srv, err := New(cfg, bb.Publisher(), bb.JS, NewMetrics(reg), log)
	if err != nil {
		return nil, err
	}
	g, err := supervise.NewGRPC(supervise.GRPCConfig{Addr: o.Listen, Options: srv.ServerOptions()})
	if err != nil {
		return nil, fmt.Errorf("fleet listen: %w", err)
	}
	srv.Register(g.Server)
	// The loops outlive ctx (a start's context): Stop ends them, after the
	// drain that needs them to publish the last disconnects.
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	gw := &Gateway{GRPCServer: g, srv: srv, runEnd: make(chan struct{}), cancel: cancel}
	go func() { defer close(gw.runEnd); srv.Run(runCtx) }()
	log.Info("fleet gateway serving", "addr", g.Addr().String(), "gateway", srv.Config().GatewayID)
	return gw, nil
}

// Stop drains the sessions (nodes re-home elsewhere at once), stops the
// gRPC server and then the background loops.
func (gw *Gateway) Stop(ctx context.Context) error {
	gw.srv.Drain(ctx)
	err := gw.GRPCServer.Stop(ctx)
	gw.cancel()
	<-gw.runEnd
	return err
}
