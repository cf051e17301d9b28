package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"os"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/grpclimit"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/internal/tlsfiles"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	"github.com/millrace/millrace/projectors/placer"
	"github.com/millrace/millrace/services/fleet"
	"github.com/millrace/millrace/services/reservations"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// fleetOptions configure the fleet gateway.
type fleetOptions struct {
	c                             fleet.Config
	listen, caDir, caCert, caKey  string
	tlsCert, tlsKey, tlsHosts     string
	joinTokens, joinTokensFile    string
	handshakeRate, joinRate       int
	joinRatePerClient, reportRate int
	resumption                    bool
}

func (o *fleetOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.listen, "fleet-listen", "MILLRACE_FLEET_LISTEN", "127.0.0.1:1986", "fleet gateway gRPC address (mTLS): node sessions and Join")
	envflag.String(fs, &o.c.GatewayID, "fleet-gateway-id", "MILLRACE_FLEET_GATEWAY_ID", "", "this gateway instance's id (default: host name and listen port); every instance needs its own")
	envflag.String(fs, &o.caDir, "fleet-ca-dir", "MILLRACE_FLEET_CA_DIR", "var/fleet/ca", "directory of the fleet CA (ca.crt, ca.key), created on first start when --fleet-ca-cert is not given")
	envflag.String(fs, &o.caCert, "fleet-ca-cert", "MILLRACE_FLEET_CA_CERT", "", "PEM file of the CA that signs node certificates (with --fleet-ca-key); overrides --fleet-ca-dir")
	envflag.String(fs, &o.caKey, "fleet-ca-key", "MILLRACE_FLEET_CA_KEY", "", "PEM file of the CA's private key")
	envflag.String(fs, &o.tlsCert, "fleet-tls-cert", "MILLRACE_FLEET_TLS_CERT", "", "PEM server certificate of the gateway (with --fleet-tls-key); default: one issued by the fleet CA")
	envflag.String(fs, &o.tlsKey, "fleet-tls-key", "MILLRACE_FLEET_TLS_KEY", "", "PEM private key of --fleet-tls-cert")
	envflag.String(fs, &o.tlsHosts, "fleet-tls-hosts", "MILLRACE_FLEET_TLS_HOSTS", "", "extra host names and IPs, comma-separated, for the CA-issued server certificate (localhost and the listen host are always in)")
	envflag.String(fs, &o.joinTokens, "fleet-join-tokens", "MILLRACE_FLEET_JOIN_TOKENS", "", "join tokens as pool=token,pool=token (a node exchanges one for a certificate)")
	envflag.String(fs, &o.joinTokensFile, "fleet-join-tokens-file", "MILLRACE_FLEET_JOIN_TOKENS_FILE", "", "file of pool=token lines (added to --fleet-join-tokens)")
	envflag.Int(fs, &o.c.MaxSessions, "fleet-max-sessions", "MILLRACE_FLEET_MAX_SESSIONS", fleet.DefaultMaxSessions, "most node sessions this gateway holds; more are refused with a retry-after")
	envflag.Int(fs, &o.handshakeRate, "fleet-handshake-rate", "MILLRACE_FLEET_HANDSHAKE_RATE", fleet.DefaultHandshakeRate, "new sessions accepted per second (token bucket, burst the same); Joins have their own limits")
	envflag.Int(fs, &o.c.MaxHellosInFlight, "fleet-max-hellos-in-flight", "MILLRACE_FLEET_MAX_HELLOS_IN_FLIGHT", fleet.DefaultMaxHellosInFlight, "Hellos being checked and stored at once")
	envflag.Duration(fs, &o.c.HeartbeatInterval, "fleet-heartbeat-interval", "MILLRACE_FLEET_HEARTBEAT_INTERVAL", fleet.DefaultHeartbeatInterval, "how often nodes send a heartbeat (told in Welcome)")
	envflag.Duration(fs, &o.c.FlushInterval, "fleet-flush-interval", "MILLRACE_FLEET_FLUSH_INTERVAL", fleet.DefaultFlushInterval, "how often heartbeat ages are published, one batch per pool")
	envflag.Duration(fs, &o.c.BindWindow, "fleet-bind-window", "MILLRACE_FLEET_BIND_WINDOW", fleet.DefaultBindWindow, "how long a gateway keeps binds for nodes not connected to it")
	envflag.Bool(fs, &o.resumption, "fleet-tls-resumption", "MILLRACE_FLEET_TLS_RESUMPTION", true, "TLS session tickets (keys derived from the CA key, shared by every gateway of the fleet) so that re-homing nodes resume rather than redo a full handshake")
	envflag.Duration(fs, &o.c.NodeCertValidity, "fleet-node-cert-validity", "MILLRACE_FLEET_NODE_CERT_VALIDITY", fleet.DefaultNodeCertValidity, "validity of node certificates issued by Join")
	envflag.Int(fs, &o.reportRate, "fleet-report-rate", "MILLRACE_FLEET_REPORT_RATE", fleet.DefaultReportRate, "status and allocation reports per second one node session may send (token bucket); a node over it is refused report_rate")
	envflag.Int(fs, &o.c.ReportBurst, "fleet-report-burst", "MILLRACE_FLEET_REPORT_BURST", fleet.DefaultReportBurst, "burst of --fleet-report-rate (a reconnect answering every pending bind at once must fit)")
	envflag.Int(fs, &o.c.MaxHeldAllocations, "fleet-max-held-allocations", "MILLRACE_FLEET_MAX_HELD_ALLOCATIONS", fleet.DefaultMaxHeld, "allocations one node session may hold (Hello list and BOUND reports); bounds its Connected and resync events")
	envflag.Int(fs, &o.c.SessionQueueShare, "fleet-session-queue-share", "MILLRACE_FLEET_SESSION_QUEUE_SHARE", fleet.DefaultSessionQueueShare, "events of one node session that may wait in the gateway's shared publish queue at once")
	envflag.Int(fs, &o.joinRatePerClient, "fleet-join-rate-per-client", "MILLRACE_FLEET_JOIN_RATE_PER_CLIENT", fleet.DefaultJoinRatePerClient, "Joins per second from one client address (an IPv6 client's /64); apart from session handshakes, so a Join flood never refuses reconnecting nodes")
	envflag.Int(fs, &o.c.JoinBurstPerClient, "fleet-join-burst-per-client", "MILLRACE_FLEET_JOIN_BURST_PER_CLIENT", fleet.DefaultJoinBurstPerClient, "Joins one client address may make at once (token bucket burst)")
	envflag.Int(fs, &o.joinRate, "fleet-join-rate", "MILLRACE_FLEET_JOIN_RATE", fleet.DefaultJoinRate, "Joins per second from all clients together (burst twice this)")
	envflag.Duration(fs, &o.c.TLSHandshakeTimeout, "fleet-tls-handshake-timeout", "MILLRACE_FLEET_TLS_HANDSHAKE_TIMEOUT", fleet.DefaultTLSHandshakeTimeout, "a connection's TLS handshake must finish this soon after it starts (a client that opens TCP and says nothing is dropped then)")
	envflag.String(fs, &o.c.DenyListFile, "fleet-deny-list", "MILLRACE_FLEET_DENY_LIST", "", "file of revoked node certificate serials (hex) and node identities (pool/node), one per line, # comments; reloaded when it changes (checked every second): revoked sessions are closed and refused")
}

// config loads the CA and TLS material. devSecrets, when not empty, is the
// directory where a development join token is kept if none is configured.
func (o *fleetOptions) config(ctx context.Context, t *telemetry, devSecrets string, log *slog.Logger) (fleet.Config, error) {
	if (o.caCert == "") != (o.caKey == "") {
		return fleet.Config{}, envflag.Usage("--fleet-ca-cert and --fleet-ca-key go together")
	}
	hosts := envflag.SplitList(o.tlsHosts)
	if h, _, err := net.SplitHostPort(o.listen); err == nil && h != "" {
		hosts = append(hosts, h)
	}
	ca, tc, err := fleet.Credentials{CACert: o.caCert, CAKey: o.caKey, CADir: o.caDir, Cert: o.tlsCert, Key: o.tlsKey, Hosts: hosts}.Load()
	if err != nil {
		return fleet.Config{}, err
	}
	tokens := &fleet.JoinTokens{}
	src := keyfile.Source{Inline: o.joinTokens, File: o.joinTokensFile, DevDir: devSecrets, DevFile: "join-tokens", DevName: "default", What: "join tokens"}
	if err := keyfile.Load(ctx, src, fleet.ParseJoinTokens, tokens, t.kf, log); err != nil {
		return fleet.Config{}, err
	}
	c := o.c
	c.CA, c.TLS, c.JoinTokens, c.DisableResumption = ca, tc, tokens, !o.resumption
	if c.GatewayID == "" {
		host, _ := os.Hostname()
		_, port, _ := net.SplitHostPort(o.listen)
		c.GatewayID = host + "-" + port
	}
	c.HandshakeRate, c.HandshakeBurst = float64(o.handshakeRate), o.handshakeRate
	c.JoinRatePerClient, c.JoinRate, c.JoinBurst = float64(o.joinRatePerClient), float64(o.joinRate), 2*o.joinRate
	c.ReportRate = float64(o.reportRate)
	return c, nil
}

// reservationsOptions configure the reservations API.
type reservationsOptions struct {
	c                       reservations.Config
	listen, tlsCert, tlsKey string
	keys, keysFile          string
}

func (o *reservationsOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.listen, "reservations-listen", "MILLRACE_RESERVATIONS_LISTEN", "127.0.0.1:1988", "reservations API gRPC address (JSON over HTTP is served under /v1/reservations on --http-listen)")
	envflag.String(fs, &o.tlsCert, "reservations-tls-cert", "MILLRACE_RESERVATIONS_TLS_CERT", "", "PEM server certificate for the reservations gRPC API (with --reservations-tls-key); empty serves plaintext, for loopback and behind a TLS proxy")
	envflag.String(fs, &o.tlsKey, "reservations-tls-key", "MILLRACE_RESERVATIONS_TLS_KEY", "", "PEM private key of --reservations-tls-cert")
	envflag.String(fs, &o.keys, "fleet-api-keys", "MILLRACE_FLEET_API_KEYS", "", "reservation API keys as owner=key or owner:pool1|pool2=key, comma-separated")
	envflag.String(fs, &o.keysFile, "fleet-api-keys-file", "MILLRACE_FLEET_API_KEYS_FILE", "", "file of API key lines (added to --fleet-api-keys)")
	envflag.Int(fs, &o.c.MaxPendingPerOwner, "fleet-max-pending-per-owner", "MILLRACE_FLEET_MAX_PENDING_PER_OWNER", reservations.DefaultMaxPendingPerOwner, "reservations one owner may have pending or placed at once")
	envflag.Duration(fs, &o.c.MaxWait, "fleet-max-wait", "MILLRACE_FLEET_MAX_WAIT", reservations.DefaultMaxWait, "longest wait for placement a Create may ask for")
}

func (o *reservationsOptions) config(ctx context.Context, t *telemetry, devSecrets string, log *slog.Logger) (reservations.Config, error) {
	c := o.c
	c.Keys = &reservations.Keys{}
	src := keyfile.Source{Inline: o.keys, File: o.keysFile, DevDir: devSecrets, DevFile: "api-keys", DevName: "dev", What: "reservation API keys"}
	return c, keyfile.Load(ctx, src, reservations.ParseKeys, c.Keys, t.kf, log)
}

// reservationsGRPC is the reservations API's own gRPC server: its calls
// may wait up to a minute for a placement, so they do not share the
// gateway's connections (which allow a few streams each).
type reservationsGRPC struct {
	*supervise.GRPCServer
	api *reservations.Late
}

func startReservationsGRPC(o reservationsOptions, api *reservations.Late, log *slog.Logger) (*reservationsGRPC, error) {
	tc, err := tlsfiles.ServerFlags(o.tlsCert, o.tlsKey, "--reservations-tls-cert", "--reservations-tls-key")
	if err != nil {
		return nil, err
	}
	opts, err := grpclimit.ServerOptions(grpclimit.Config{})
	if err != nil {
		return nil, err
	}
	g, err := supervise.NewGRPC(supervise.GRPCConfig{Addr: o.listen, TLS: tc, Options: append(opts, grpc.MaxRecvMsgSize(reservations.MaxRequestBytes))})
	if err != nil {
		return nil, fmt.Errorf("reservations listen: %w", err)
	}
	api.Register(g.Server, nil)
	log.Info("reservations API serving", "addr", g.Addr().String(), "tls", tc != nil)
	return &reservationsGRPC{GRPCServer: g, api: api}, nil
}

// Stop answers the calls waiting for a placement at once (over HTTP too),
// so that the graceful stops do not sit out their waits, then stops.
func (r *reservationsGRPC) Stop(ctx context.Context) error {
	r.api.Close()
	return r.GRPCServer.Stop(ctx)
}

// reservations serves the reservations API: over gRPC on its own listener
// and under /v1/reservations on the process's mux at once, UNAVAILABLE
// until the database is there (reservations.Late).
func (p *process) reservations(o reservationsOptions, devSecrets string) (api, grpc supervise.Component) {
	var late reservations.Late
	late.Register(nil, p.mux)
	var cfg reservations.Config
	api = p.consumer("reservations API", func(ctx context.Context, pool *pgxpool.Pool) error {
		s, err := reservations.New(cfg, pool, p.bb.JS, p.bb.Conn, reservations.NewMetrics(p.t.reg), p.log.With("component", "reservations"))
		if err != nil {
			return err
		}
		late.Set(s)
		<-ctx.Done()
		return nil
	})
	api.Start = func(ctx context.Context) (err error) {
		cfg, err = o.config(ctx, p.t, devSecrets, p.log)
		return err
	}
	grpc = supervise.Serve("reservations gRPC", func(context.Context) (*reservationsGRPC, error) {
		return startReservationsGRPC(o, &late, p.log)
	})
	return api, grpc
}

// fleetGateway is a running gateway: its gRPC server and its background
// loops.
type fleetGateway struct {
	*supervise.GRPCServer
	srv    *fleet.Server
	runEnd chan struct{}
	cancel context.CancelFunc
}

// startFleet listens on o.listen and serves the gateway on bb.
func startFleet(ctx context.Context, o fleetOptions, devSecrets string, bb *streams.Backbone, t *telemetry, log *slog.Logger) (*fleetGateway, error) {
	log = log.With("component", "fleet")
	cfg, err := o.config(ctx, t, devSecrets, log)
	if err != nil {
		return nil, err
	}
	srv, err := fleet.New(cfg, bb.Publisher(), bb.JS, fleet.NewMetrics(t.reg), log)
	if err != nil {
		return nil, err
	}
	g, err := supervise.NewGRPC(supervise.GRPCConfig{Addr: o.listen, Options: srv.ServerOptions()})
	if err != nil {
		return nil, fmt.Errorf("fleet listen: %w", err)
	}
	srv.Register(g.Server)
	runCtx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	fg := &fleetGateway{GRPCServer: g, srv: srv, runEnd: make(chan struct{}), cancel: cancel}
	go func() { defer close(fg.runEnd); srv.Run(runCtx) }()
	log.Info("fleet gateway serving", "addr", g.Addr().String(), "gateway", srv.Config().GatewayID)
	return fg, nil
}

// Stop drains the sessions (nodes re-home elsewhere at once), stops the
// gRPC server and then the background loops.
func (fg *fleetGateway) Stop(ctx context.Context) error {
	fg.srv.Drain(ctx)
	err := fg.GRPCServer.Stop(ctx)
	fg.cancel()
	<-fg.runEnd
	return err
}

// gateway serves the fleet gateway; devSecrets, when not empty, is where
// a development join token is kept if none is configured.
func (p *process) gateway(o fleetOptions, devSecrets string) supervise.Component {
	return supervise.Serve("fleet gateway", func(ctx context.Context) (*fleetGateway, error) {
		return startFleet(ctx, o, devSecrets, p.bb, p.t, p.log)
	})
}

// fleetProjectorOptions tune the liveness projector.
type fleetProjectorOptions struct {
	c  fleetproj.Config
	rc streams.RunnerConfig
}

func (o *fleetProjectorOptions) register(fs *flag.FlagSet) {
	envflag.Int(fs, &o.rc.Batch, "fleet-projector-batch", "MILLRACE_FLEET_PROJECTOR_BATCH", 1000, "most node messages applied in one transaction")
	envflag.Duration(fs, &o.rc.MaxWait, "fleet-projector-max-wait", "MILLRACE_FLEET_PROJECTOR_MAX_WAIT", 250*time.Millisecond, "how long a fetch waits to fill a batch of node messages")
	envflag.Duration(fs, &o.c.SuspectAfter, "fleet-suspect-after", "MILLRACE_FLEET_SUSPECT_AFTER", fleetproj.DefaultSuspectAfter, "a node unheard for this long is suspect: nothing new is placed on it, what it holds stays")
	envflag.Duration(fs, &o.c.UnreachableAfter, "fleet-unreachable-after", "MILLRACE_FLEET_UNREACHABLE_AFTER", fleetproj.DefaultUnreachableAfter, "a node unheard for this long is unreachable: nothing is placed on it and its reservations are placed elsewhere")
	envflag.Duration(fs, &o.c.ClockSlack, "fleet-clock-slack", "MILLRACE_FLEET_CLOCK_SLACK", fleetproj.DefaultClockSlack, "how far past the newest liveness batch nodes may age (a silent control plane marks nothing)")
}

// projector makes the liveness projector; reg (nil: none) gets its
// counter of foreign allocation reports.
func (o *fleetProjectorOptions) projector(log *slog.Logger, reg prometheus.Registerer) (*fleetproj.Projector, error) {
	cfg := o.c
	cfg.Logger, cfg.ForeignReports = log, fleetproj.NewForeignReportsCounter(reg)
	if err := cfg.Validate(); err != nil {
		return nil, envflag.Usage(err.Error())
	}
	return fleetproj.New(cfg)
}

func (o *fleetProjectorOptions) runnerConfig(log *slog.Logger) streams.RunnerConfig {
	c := o.rc
	c.Stream, c.Filter = subjects.StreamFleetNodes, subjects.FleetNodeFilter
	// The projector ages nodes on the stream's clock as batches arrive;
	// the idle sweep covers a quiet stream.
	c.SweepEvery = 5 * time.Second
	c.Logger = log.With("component", "projector")
	return c
}

// placerOptions tune the placer.
type placerOptions struct {
	c  placer.Config
	rc streams.RunnerConfig
}

func (o *placerOptions) register(fs *flag.FlagSet) {
	envflag.Int(fs, &o.rc.Batch, "placer-batch", "MILLRACE_PLACER_BATCH", 500, "most reservation requests planned and committed in one transaction")
	envflag.Duration(fs, &o.rc.MaxWait, "placer-max-wait", "MILLRACE_PLACER_MAX_WAIT", 20*time.Millisecond, "how long requests may gather before the placer plans them (adds to the time to place)")
	envflag.Duration(fs, &o.c.BindTimeout, "placer-bind-timeout", "MILLRACE_PLACER_BIND_TIMEOUT", placer.DefaultBindTimeout, "an allocation its node has not confirmed within this is released and placed again")
	envflag.Duration(fs, &o.c.PendingTimeout, "placer-pending-timeout", "MILLRACE_PLACER_PENDING_TIMEOUT", placer.DefaultPendingTimeout, "a reservation that found no capacity within this fails")
	envflag.Duration(fs, &o.c.UnbindRetry, "placer-unbind-retry", "MILLRACE_PLACER_UNBIND_RETRY", placer.DefaultUnbindRetry, "how often the nodes are asked again to unbind a released allocation they have not confirmed (its GPUs are not bookable until they do)")
	envflag.Duration(fs, &o.rc.SweepEvery, "placer-sweep-every", "MILLRACE_PLACER_SWEEP_EVERY", time.Second, "how often an idle placer retries pending reservations and applies its release policies")
}

func (o *placerOptions) config(log *slog.Logger) (placer.Config, error) {
	cfg := o.c
	cfg.Subject, cfg.Logger = subjects.FleetPlace, log.With("component", "placer")
	if err := cfg.Validate(); err != nil {
		return cfg, envflag.Usage(err.Error())
	}
	return cfg, nil
}

func (o *placerOptions) runnerConfig(log *slog.Logger) streams.RunnerConfig {
	c := o.rc
	c.Stream, c.Filter = subjects.StreamFleetResv, subjects.FleetResvFilter
	c.Logger = log.With("component", "projector")
	return c
}

// placer runs the placer's consumer and the outbox relay that publishes
// its decisions.
func (p *process) placer(cfg placer.Config, o placerOptions) supervise.Component {
	return p.consumer(placer.ConsumerName, func(ctx context.Context, pool *pgxpool.Pool) error {
		pl, err := placer.New(cfg)
		if err != nil {
			return err
		}
		relay, err := streams.NewOutbox(pool, p.bb.Publisher(), streams.OutboxConfig{Registerer: p.t.reg, Metrics: p.t.sm, Logger: p.log})
		if err != nil {
			return err
		}
		r, err := streams.NewRunner(p.bb.JS, pool, pl, o.runnerConfig(p.log), p.t.sm)
		if err != nil {
			return err
		}
		done := make(chan error, 1)
		go func() { done <- relay.Run(ctx) }()
		err = r.Run(ctx)
		if rerr := <-done; err == nil && !errors.Is(rerr, context.Canceled) {
			err = rerr
		}
		return err
	})
}
