package reservations

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"net/http"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/grpclimit"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/internal/tlsfiles"
)

// Options are the API's knobs as an operator sets them: the Config fields
// a flag sets as they are, the gRPC listener and its certificate, and the
// API keys, inline or in a file, that Load turns into Config.Keys. A
// process that serves the API registers them (RegisterFlags) and Starts
// it.
type Options struct {
	// Config holds the fields set straight from a flag; Load adds Keys.
	Config Config
	// Listen is the gRPC address.
	Listen string
	// TLSCert and TLSKey are the gRPC server's certificate; neither serves
	// plaintext.
	TLSCert, TLSKey string
	// APIKeys (inline) and APIKeysFile (reloaded when it changes) are the
	// API keys together (ParseKeys).
	APIKeys, APIKeysFile string
	// DevSecrets, when not empty, is the directory where a development
	// secret is made and kept if none is configured (keyfile.Source). It
	// is no flag: a development process sets it.
	DevSecrets string
}

// RegisterFlags registers the API's flags (--reservations-*, and the
// --fleet-* ones of its keys and limits), each with its variable, on fs.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	envflag.String(fs, &o.Listen, "reservations-listen", "MILLRACE_RESERVATIONS_LISTEN", "127.0.0.1:1988", "reservations API gRPC address (JSON over HTTP is served under /v1/reservations on --http-listen)")
	envflag.String(fs, &o.TLSCert, "reservations-tls-cert", "MILLRACE_RESERVATIONS_TLS_CERT", "", "PEM server certificate for the reservations gRPC API (with --reservations-tls-key); empty serves plaintext, for loopback and behind a TLS proxy")
	envflag.String(fs, &o.TLSKey, "reservations-tls-key", "MILLRACE_RESERVATIONS_TLS_KEY", "", "PEM private key of --reservations-tls-cert")
	envflag.String(fs, &o.APIKeys, "fleet-api-keys", "MILLRACE_FLEET_API_KEYS", "", "reservation API keys as owner=key or owner:pool1|pool2=key, comma-separated")
	envflag.String(fs, &o.APIKeysFile, "fleet-api-keys-file", "MILLRACE_FLEET_API_KEYS_FILE", "", "file of API key lines (added to --fleet-api-keys)")
	envflag.Int(fs, &o.Config.MaxPendingPerOwner, "fleet-max-pending-per-owner", "MILLRACE_FLEET_MAX_PENDING_PER_OWNER", DefaultMaxPendingPerOwner, "reservations one owner may have pending or placed at once")
	envflag.Duration(fs, &o.Config.MaxWait, "fleet-max-wait", "MILLRACE_FLEET_MAX_WAIT", DefaultMaxWait, "longest wait for placement a Create may ask for")
}

// Load makes the API's Config: its keys stay current with their file
// until ctx ends (keyfile.Load; kf counts the reloads).
func (o Options) Load(ctx context.Context, kf *keyfile.Metrics, log *slog.Logger) (Config, error) {
	c := o.Config
	src := keyfile.Source{Inline: o.APIKeys, File: o.APIKeysFile, DevDir: o.DevSecrets, DevFile: "api-keys", DevName: "dev", What: "reservation API keys"}
	keys, err := keyfile.Load(ctx, src, keySyntax, kf, log)
	c.Keys = Keys{keys}
	return c, err
}

// Edge is a running API: its own gRPC server, and the same API for an
// HTTP mux (Mount), which belongs to the process rather than to the edge.
// Its calls may wait up to a minute for a placement, so they do not share
// the connections of a server whose streams are few and short (the fleet
// gateway's). Until Run hands it the database every call is UNAVAILABLE
// (Late), so that a process may serve it before PostgreSQL answers.
type Edge struct {
	*supervise.GRPCServer
	late *Late
	cfg  Config
	m    *Metrics
	log  *slog.Logger
}

// Start loads o (Load) and listens on o.Listen (with TLS when o names a
// certificate) for the API, which answers UNAVAILABLE until Run. reg gets
// its metrics, kf the keys' reloads; a nil log is slog.Default. A half
// pair of certificate flags is an envflag.UsageError. The caller serves it
// (Serve) and stops it (Stop).
func Start(ctx context.Context, o Options, reg prometheus.Registerer, kf *keyfile.Metrics, log *slog.Logger) (*Edge, error) {
	if log == nil {
		log = slog.Default()
	}
	log = log.With("component", "reservations")
	cfg, err := o.Load(ctx, kf, log)
	if err != nil {
		return nil, err
	}
	e, err := listen(o, &Late{}, log)
	if err != nil {
		return nil, err
	}
	e.cfg, e.m = cfg, NewMetrics(reg)
	return e, nil
}

// listen makes the gRPC server of o and registers late on it.
func listen(o Options, late *Late, log *slog.Logger) (*Edge, error) {
	tc, err := tlsfiles.ServerFlags(o.TLSCert, o.TLSKey, "--reservations-tls-cert", "--reservations-tls-key")
	if err != nil {
		return nil, err
	}
	opts, err := grpclimit.ServerOptions(grpclimit.Config{})
	if err != nil {
		return nil, err
	}
	g, err := supervise.NewGRPC(supervise.GRPCConfig{Addr: o.Listen, TLS: tc, Options: append(opts, grpc.MaxRecvMsgSize(MaxRequestBytes))})
	if err != nil {
		return nil, fmt.Errorf("reservations listen: %w", err)
	}
	late.Register(g.Server, nil)
	log.Info("reservations API serving", "addr", g.Addr().String(), "tls", tc != nil)
	return &Edge{GRPCServer: g, late: late, log: log}, nil
}

// Mount serves the HTTP API under /v1/reservations on mux, UNAVAILABLE
// (503 with Retry-After) until Run.
func (e *Edge) Mount(mux *http.ServeMux) { e.late.Register(nil, mux) }

// Run lets the calls through to a Server on the database pool and the
// backbone (js, nc) until ctx ends; it returns nil then, or New's error.
// A process calls it once PostgreSQL answers.
func (e *Edge) Run(ctx context.Context, pool *pgxpool.Pool, js jetstream.JetStream, nc *nats.Conn) error {
	s, err := New(e.cfg, pool, js, nc, e.m, e.log)
	if err != nil {
		return err
	}
	e.late.Set(s)
	<-ctx.Done()
	return nil
}

// Stop answers the calls waiting for a placement at once (over HTTP too:
// Late.Close), so that the graceful stops do not sit out their waits, then
// stops the server.
func (e *Edge) Stop(ctx context.Context) error {
	e.late.Close()
	return e.GRPCServer.Stop(ctx)
}
