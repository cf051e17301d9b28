package reservations

import (
	"context"
	"flag"
	"fmt"
	"log/slog"

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
// process that serves the API registers them (RegisterFlags), Loads its
// Config and starts the gRPC server (StartGRPC).
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
	// DevSecrets, when not empty, is the directory where a development API
	// key is made and kept if none is configured (keyfile.Source). It is
	// no flag: a development process sets it.
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

// GRPC is the API's own gRPC server: its calls may wait up to a minute
// for a placement, so they do not share the connections of a server whose
// streams are few and short (the fleet gateway's).
type GRPC struct {
	*supervise.GRPCServer
	api *Late
}

// StartGRPC listens on o.Listen (with TLS when o names a certificate) and
// serves api there. A half pair of certificate flags is an
// envflag.UsageError.
func StartGRPC(o Options, api *Late, log *slog.Logger) (*GRPC, error) {
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
	api.Register(g.Server, nil)
	log.Info("reservations API serving", "addr", g.Addr().String(), "tls", tc != nil)
	return &GRPC{GRPCServer: g, api: api}, nil
}

// Stop answers the calls waiting for a placement at once (over HTTP too:
// Late.Close), so that the graceful stops do not sit out their waits, then
// stops the server.
func (r *GRPC) Stop(ctx context.Context) error {
	r.api.Close()
	return r.GRPCServer.Stop(ctx)
}
