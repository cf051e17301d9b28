package console

import (
	"context"
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

// Grant is what a request may see of the console.
type Grant struct {
	// All is every project, and the pages of the fleet and the commit log:
	// an operator's key, or a console that needs none (loopback, no keys).
	All bool
	// Project is the one project a read key or a BES API key grants.
	Project string
}

// Sees reports whether the grant shows project's builds and tests.
func (g Grant) Sees(project string) bool { return g.All || g.Project == project }

type grantKey struct{}

// GrantOf is the grant of a request that passed the Guard. A request
// that did not (a mux served without one, as in tests) sees everything,
// as the console without keys does.
func GrantOf(ctx context.Context) Grant {
	if g, ok := ctx.Value(grantKey{}).(Grant); ok {
		return g
	}
	return Grant{All: true}
}

// Keys are the console's keys (--http-console-keys-file), an apikey.Table
// of grants: a line "project=KEY" is a read key of that project, a line
// of a key alone is an operator's key, which sees every project and the
// fleet and commit-log pages. Shared by the copies of a Guard: a reload
// replaces them for all.
type Keys struct{ *apikey.Table[Grant] }

// KeySyntax is how the console's key file is written (Keys).
var KeySyntax = apikey.Syntax[Grant]{
	What: "console key", Name: "project", Form: "project=KEY (a read key) or KEY alone (an operator's key)", Bare: true,
	Principal: func(project string) (Grant, error) {
		if project == "" {
			return Grant{All: true}, nil
		}
		return Grant{Project: project}, nil
	},
}

// Guard decides who may see what on a process's HTTP server:
//   - /healthz and /readyz are open, for probes and balancers;
//   - /metrics needs a metrics token (a bearer token);
//   - the APIs under /v1/ check their own API keys;
//   - everything else (the console) needs a key, given as the password of
//     HTTP basic auth (a browser) or as a bearer token: a console key
//     (Keys) or a BES API key, which reads its own project.
//
// A check applies when its keys are not empty (the console's: console
// keys or BES keys); the command refuses a listener other hosts can reach
// without them.
type Guard struct {
	Console Keys
	// Projects are the BES API keys (project=key): each reads its
	// project's builds in the console, as a read key does.
	Projects *apikey.Table[string]
	Metrics  Tokens
	Next     http.Handler
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
		grant, ok := g.grant(consoleKey(r))
		if !ok {
			w.Header().Set("WWW-Authenticate", `Basic realm="millrace console", charset="UTF-8"`)
			http.Error(w, "the console needs a key: give it as the password (any user name), or as \"authorization: Bearer KEY\"", http.StatusUnauthorized)
			return
		}
		r = r.WithContext(context.WithValue(r.Context(), grantKey{}, grant))
	}
	g.Next.ServeHTTP(w, r)
}

// grant is what key sees: everything when the console needs no key.
func (g *Guard) grant(key string) (Grant, bool) {
	if g.Console.Len() == 0 && g.Projects.Len() == 0 {
		return Grant{All: true}, true
	}
	if gr, ok := g.Console.Lookup(key); ok {
		return gr, true
	}
	if project, ok := g.Projects.Lookup(key); ok {
		return Grant{Project: project}, true
	}
	return Grant{}, false
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
	if g.Console.Len() == 0 && g.Projects.Len() == 0 {
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
