package console

import (
	"errors"
	"net/http"
	"strings"

	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/httpapi"
	"github.com/millrace/millrace/internal/netlimit"
)

// Tokens is a set of secrets (console keys, metrics tokens), one a line:
// an apikey.Table of bare keys, kept as digests and compared in constant
// time, shared by the copies of a Guard (a reload replaces its tokens for
// all). The zero value holds none.
type Tokens struct{ *apikey.Table[struct{}] }

// TokenSyntax is how a file of tokens is written: one a line (# comments),
// each at least apikey.MinKeyBytes long and given once; what names a token
// in errors ("console key").
func TokenSyntax(what string) apikey.Syntax[struct{}] { return apikey.Syntax[struct{}]{What: what} }

// Has reports whether s is one of the tokens.
func (t Tokens) Has(s string) bool {
	_, ok := t.Lookup(s)
	return ok
}

// Guard decides who may see what on a process's HTTP server:
//   - /healthz and /readyz are open, for probes and balancers;
//   - /metrics needs a metrics token (a bearer token);
//   - the APIs under /v1/ check their own API keys;
//   - everything else (the console) needs a console key, given as the
//     password of HTTP basic auth (a browser) or as a bearer token.
//
// A check applies when its tokens are not empty; the command refuses a
// listener other hosts can reach without them.
type Guard struct {
	Console, Metrics Tokens
	Next             http.Handler
}

func (g *Guard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	switch p := r.URL.Path; {
	case p == "/healthz" || p == "/readyz" || strings.HasPrefix(p, "/v1/"):
	case p == "/metrics":
		if g.Metrics.Len() > 0 && !g.Metrics.Has(bearer(r)) {
			w.Header().Set("WWW-Authenticate", `Bearer realm="millrace metrics"`)
			httpapi.WriteJSONError(w, http.StatusUnauthorized, "UNAUTHENTICATED", "/metrics needs \"authorization: Bearer TOKEN\" with a token of --http-metrics-token-file")
			return
		}
	default:
		if g.Console.Len() > 0 && !g.Console.Has(consoleKey(r)) {
			w.Header().Set("WWW-Authenticate", `Basic realm="millrace console", charset="UTF-8"`)
			http.Error(w, "the console needs a key: give it as the password (any user name), or as \"authorization: Bearer KEY\"", http.StatusUnauthorized)
			return
		}
	}
	g.Next.ServeHTTP(w, r)
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

// CheckExposure refuses to serve the console and /metrics on listen, when
// other hosts can reach it, without console keys and a metrics token;
// insecureOpen (--http-insecure-open) allows it. The error says what to do.
func (g *Guard) CheckExposure(listen string, insecureOpen bool) error {
	if netlimit.IsLoopback(listen) || insecureOpen {
		return nil
	}
	var missing []string
	if g.Console.Len() == 0 {
		missing = append(missing, "console keys (--http-console-keys-file, $MILLRACE_HTTP_CONSOLE_KEYS_FILE)")
	}
	if g.Metrics.Len() == 0 {
		missing = append(missing, "a metrics token (--http-metrics-token-file, $MILLRACE_HTTP_METRICS_TOKEN_FILE)")
	}
	if len(missing) == 0 {
		return nil
	}
	return errors.New("HTTP: refusing to serve the console and /metrics on " + listen +
		", which other hosts can reach, without " + strings.Join(missing, " and ") +
		"; listen on 127.0.0.1, give them, or pass --http-insecure-open ($MILLRACE_HTTP_INSECURE_OPEN=true) if this is intended")
}
