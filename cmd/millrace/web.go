package main

import (
	"context"
	"errors"
	"flag"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/netlimit"
)

// httpOptions configure a command's HTTP server (console, APIs over HTTP,
// /metrics, /healthz, /readyz).
type httpOptions struct {
	listen           string
	consoleKeysFile  string
	metricsTokenFile string
	insecureOpen     bool
	maxConns         int
	idleTimeout      time.Duration
}

func (o *httpOptions) register(fs *flag.FlagSet, def, help string) {
	envflag.String(fs, &o.listen, "http-listen", "MILLRACE_HTTP_LISTEN", def, help)
	envflag.String(fs, &o.consoleKeysFile, "http-console-keys-file", "MILLRACE_HTTP_CONSOLE_KEYS_FILE", "",
		"file of console keys, one a line (a browser gives one as the password of HTTP basic auth, a script as \"authorization: Bearer KEY\"); required when --http-listen is not loopback")
	envflag.String(fs, &o.metricsTokenFile, "http-metrics-token-file", "MILLRACE_HTTP_METRICS_TOKEN_FILE", "",
		"file of bearer tokens for /metrics, one a line (Prometheus: authorization.credentials_file); required when --http-listen is not loopback")
	envflag.Bool(fs, &o.insecureOpen, "http-insecure-open", "MILLRACE_HTTP_INSECURE_OPEN", false,
		"serve the console and /metrics without keys on an address other hosts can reach (refused otherwise)")
	envflag.Int(fs, &o.maxConns, "http-max-conns", "MILLRACE_HTTP_MAX_CONNS", 1024, "most HTTP connections open at once; more are closed as they arrive")
	envflag.Duration(fs, &o.idleTimeout, "http-idle-timeout", "MILLRACE_HTTP_IDLE_TIMEOUT", 2*time.Minute, "a kept-alive HTTP connection idle this long is closed")
}

// guard loads the console keys and metrics tokens (kept current from
// their files) and wraps next. Without them, a listener other hosts can
// reach is refused unless --http-insecure-open.
func (o httpOptions) guard(ctx context.Context, t *telemetry, next http.Handler, log *slog.Logger) (http.Handler, error) {
	g := &console.Guard{Console: &console.Tokens{}, Metrics: &console.Tokens{}, Next: next}
	if o.consoleKeysFile != "" {
		if err := keyfile.Load(ctx, keyfile.Source{File: o.consoleKeysFile, What: "console keys"}, console.ParseTokens("console key"), g.Console, t.kf, log); err != nil {
			return nil, err
		}
	}
	if o.metricsTokenFile != "" {
		if err := keyfile.Load(ctx, keyfile.Source{File: o.metricsTokenFile, What: "metrics tokens"}, console.ParseTokens("metrics token"), g.Metrics, t.kf, log); err != nil {
			return nil, err
		}
	}
	if !netlimit.IsLoopback(o.listen) && !o.insecureOpen {
		var missing []string
		if g.Console.Len() == 0 {
			missing = append(missing, "console keys (--http-console-keys-file, $MILLRACE_HTTP_CONSOLE_KEYS_FILE)")
		}
		if g.Metrics.Len() == 0 {
			missing = append(missing, "a metrics token (--http-metrics-token-file, $MILLRACE_HTTP_METRICS_TOKEN_FILE)")
		}
		if len(missing) > 0 {
			return nil, errors.New("HTTP: refusing to serve the console and /metrics on " + o.listen +
				", which other hosts can reach, without " + strings.Join(missing, " and ") +
				"; listen on 127.0.0.1, give them, or pass --http-insecure-open ($MILLRACE_HTTP_INSECURE_OPEN=true) if this is intended")
		}
	}
	return g, nil
}
