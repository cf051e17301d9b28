package main

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/http"
	"strings"
	"sync/atomic"
	"time"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/httpapi"
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

// tokens is a set of secrets (console keys, metrics tokens), one a line,
// kept as SHA-256 digests and compared in constant time.
type tokens struct {
	set atomic.Pointer[[][32]byte]
}

func parseTokens(what string) func(string) (*tokens, error) {
	return func(text string) (*tokens, error) {
		var ds [][32]byte
		for _, line := range strings.Split(text, "\n") {
			line = strings.TrimSpace(line)
			if line == "" || strings.HasPrefix(line, "#") {
				continue
			}
			if len(line) < 16 {
				return nil, fmt.Errorf("a %s is shorter than 16 characters", what)
			}
			ds = append(ds, sha256.Sum256([]byte(line)))
		}
		t := &tokens{}
		t.set.Store(&ds)
		return t, nil
	}
}

func (t *tokens) list() [][32]byte {
	if t == nil {
		return nil
	}
	if p := t.set.Load(); p != nil {
		return *p
	}
	return nil
}

func (t *tokens) Len() int { return len(t.list()) }

func (t *tokens) Replace(from *tokens) { l := from.list(); t.set.Store(&l) }

// has reports whether s is one of the tokens; every one is compared.
func (t *tokens) has(s string) bool {
	if s == "" {
		return false
	}
	d := sha256.Sum256([]byte(s))
	found := 0
	for _, e := range t.list() {
		found |= subtle.ConstantTimeCompare(d[:], e[:])
	}
	return found == 1
}

// httpGuard decides who may see what on the HTTP server:
//   - /healthz and /readyz are open, for probes and balancers;
//   - /metrics needs a metrics token (a bearer token);
//   - the APIs under /v1/ check their own API keys;
//   - everything else (the console) needs a console key.
//
// A check applies when its tokens are configured; on a listener other hosts
// can reach, startHTTP requires them.
type httpGuard struct {
	console, metrics *tokens
	next             http.Handler
}

func (g *httpGuard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch p := r.URL.Path; {
	case p == "/healthz" || p == "/readyz" || strings.HasPrefix(p, "/v1/"):
	case p == "/metrics":
		if g.metrics.Len() > 0 && !g.metrics.has(bearer(r)) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="millrace metrics"`)
			httpapi.WriteJSONError(w, http.StatusUnauthorized, "UNAUTHENTICATED", "/metrics needs \"authorization: Bearer TOKEN\" with a token of --http-metrics-token-file")
			return
		}
	default:
		if g.console.Len() > 0 && !g.console.has(consoleKey(r)) {
			w.Header().Set("WWW-Authenticate", `Basic realm="millrace console", charset="UTF-8"`)
			http.Error(w, "the console needs a key: give it as the password (any user name), or as \"authorization: Bearer KEY\"", http.StatusUnauthorized)
			return
		}
	}
	g.next.ServeHTTP(w, r)
}

func bearer(r *http.Request) string {
	scheme, v, ok := strings.Cut(strings.TrimSpace(r.Header.Get("Authorization")), " ")
	if !ok || !strings.EqualFold(scheme, "bearer") {
		return ""
	}
	return strings.TrimSpace(v)
}

func consoleKey(r *http.Request) string {
	if _, pw, ok := r.BasicAuth(); ok {
		return pw
	}
	return bearer(r)
}

// guard loads the console keys and metrics tokens (kept current from
// their files) and wraps next. Without them, a listener other hosts can
// reach is refused unless --http-insecure-open.
func (o httpOptions) guard(ctx context.Context, t *telemetry, next http.Handler, log *slog.Logger) (http.Handler, error) {
	g := &httpGuard{console: &tokens{}, metrics: &tokens{}, next: next}
	if o.consoleKeysFile != "" {
		if err := loadKeys(ctx, t, keySource{file: o.consoleKeysFile, what: "console keys"}, parseTokens("console key"), g.console, log); err != nil {
			return nil, err
		}
	}
	if o.metricsTokenFile != "" {
		if err := loadKeys(ctx, t, keySource{file: o.metricsTokenFile, what: "metrics tokens"}, parseTokens("metrics token"), g.metrics, log); err != nil {
			return nil, err
		}
	}
	if !netlimit.IsLoopback(o.listen) && !o.insecureOpen {
		var missing []string
		if g.console.Len() == 0 {
			missing = append(missing, "console keys (--http-console-keys-file, $MILLRACE_HTTP_CONSOLE_KEYS_FILE)")
		}
		if g.metrics.Len() == 0 {
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
