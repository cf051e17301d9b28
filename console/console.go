// Package console is millrace's web console: what a person reads in a
// browser on a process's HTTP server (`millrace dev`, `serve console`):
// the list of builds, filtered and paged (/), a build's page
// (/builds/{project}/{id}), live while it runs, a test's history (/test),
// a project's flaky tests (/flaky), trends (/trends), and for operators
// the fleet (/fleet) and the commit log (/commits), each with a JSON twin
// under /api/v1/. Register
// serves it on a mux; Guard decides who may see it; WriteBuild prints a
// build for a terminal (`millrace builds show`).
//
// Handlers are thin: they parse the request, call one read function of a
// projection's package, which owns its SQL (builds.Search,
// builds.WriteJSON, builds.Targets, builds.Tests, builds.OutputReader,
// builds.Projects, builds.ReadTestHistory, builds.FlakyTests), and render
// a view of templates/ (views.go). README.md says what there is.
package console

import (
	"cmp"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"net/url"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/subjects"
)

// Sources are what the console reads, and its limits.
type Sources struct {
	// DB is the database once connected (a process may serve before
	// PostgreSQL answers): nil until then, and every page is 503
	// meanwhile.
	DB func() *pgxpool.Pool
	// Archive reads the objects of archived builds (archive.Objects over
	// the process's bucket), where their console output moves once
	// archived; nil: there is none, and such output is 503.
	Archive func() builds.Archive
	// Live follows the BES stream for the pages of running builds
	// (live.go); nil: such pages do not update themselves.
	Live Follower
	// Layout is how the backbone keeps build events: a running build's
	// page follows its events from its partition's position
	// (builds.PositionOf).
	Layout subjects.BESLayout
	// CommitLog reads the commit log for its page; nil: the process
	// serves none.
	CommitLog CommitLog
	// MaxLive is how many live pages the process follows at once (0:
	// 256); one more is told to try again, which its browser does.
	MaxLive int
	// LiveFor is how long one live connection lasts (0: 10 minutes): the
	// browser then reconnects from the last event it saw, so that a
	// connection a proxy has silently dropped does not hold a consumer.
	LiveFor time.Duration
	// Stopping, when set, is closed as the process begins to stop: live
	// connections then end as at LiveFor, and browsers reconnect (to
	// another instance behind the balancer, or to this one restarted)
	// instead of holding the HTTP server's shutdown to its deadline.
	Stopping <-chan struct{}
}

// Description is the help of `millrace serve console`, beside the flags.
const Description = `Serves the web console and its JSON API (/api/v1/) on --http-listen: the
builds (live while they run), a build's page, a test's history, the flaky
tests, trends, and for operator keys the fleet and the commit log. It reads
the projections in PostgreSQL ($DATABASE_URL, written by project builds,
project fleet and project placer), follows running builds on the BES stream,
reads archived builds' console output and the commit log's checkpoints from
--bucket-url, and publishes nothing: run as many as you like behind a
balancer. Keys: --http-console-keys-file (project=KEY reads a project, KEY
alone is an operator's) and the BES API keys (--bes-api-keys,
--bes-api-keys-file), each of which reads its own project; without keys it
serves only on loopback unless --http-insecure-open.`

// RegisterFlags registers the live pages' limits on fs, each with its
// environment variable (internal/envflag).
func (s *Sources) RegisterFlags(fs *flag.FlagSet) {
	envflag.Int(fs, &s.MaxLive, "console-max-live", "MILLRACE_CONSOLE_MAX_LIVE", defaultMaxLive,
		"live console pages (running builds, the builds list) the process follows at once; one more is told to retry")
	envflag.Duration(fs, &s.LiveFor, "console-live-for", "MILLRACE_CONSOLE_LIVE_FOR", defaultLiveFor,
		"how long one live page's connection lasts before the browser reconnects from the last event it saw")
}

func (s Sources) liveFor() time.Duration {
	if s.LiveFor > 0 {
		return s.LiveFor
	}
	return defaultLiveFor
}

// liveContext is the context of one live connection under parent: it
// ends at LiveFor, or when the process begins to stop.
func (s Sources) liveContext(parent context.Context) (context.Context, context.CancelFunc) {
	ctx, cancel := context.WithTimeout(parent, s.liveFor())
	if s.Stopping != nil {
		go func() {
			select {
			case <-s.Stopping:
				cancel()
			case <-ctx.Done():
			}
		}()
	}
	return ctx, cancel
}

// Register serves the console on mux, reading src.
func Register(mux *http.ServeMux, src Sources) {
	pool, archive := src.DB, src.Archive
	slots := make(chan struct{}, cmp.Or(src.MaxLive, defaultMaxLive))
	mux.Handle("GET /static/", static())
	mux.HandleFunc("GET /{$}", withPool(pool, latest))
	// The list of builds, filtered and paged (builds.Search), as JSON for
	// tools; the front page is its HTML.
	mux.HandleFunc("GET /api/v1/builds", withPool(pool, searchBuilds))
	// The list's first page as it changes (live.go).
	mux.HandleFunc("GET /events/builds", withPool(pool, listEvents(src, slots)))
	// A build is (project, invocation id): two projects may send the same
	// id, so a build's page names both. Its address serves a browser the
	// page and anything else the JSON document; /api/v1/ always the JSON.
	mux.HandleFunc("GET /builds/{project}/{id}", withPool(pool, forProject(build(src))))
	// A running build's events, for its page (live.go).
	mux.HandleFunc("GET /builds/{project}/{id}/events", withPool(pool, forProject(liveEvents(src, slots))))
	mux.HandleFunc("GET /api/v1/builds/{project}/{id}", withPool(pool, forProject(buildJSON)))
	mux.HandleFunc("GET /api/v1/builds/{project}/{id}/targets", withPool(pool, forProject(targetsPage)))
	mux.HandleFunc("GET /api/v1/builds/{project}/{id}/tests", withPool(pool, forProject(testsPage)))
	// Tests across builds (builds.ReadTestHistory, builds.FlakyTests).
	mux.HandleFunc("GET /test", withPool(pool, testHistory))
	mux.HandleFunc("GET /api/v1/tests", withPool(pool, testHistory))
	mux.HandleFunc("GET /flaky", withPool(pool, flakyTests))
	// The fleet, for operators (projectors/fleet).
	mux.HandleFunc("GET /fleet", withPool(pool, operatorOnly(fleetPage)))
	mux.HandleFunc("GET /api/v1/fleet", withPool(pool, operatorOnly(fleetPage)))
	// The commit log's worlds and the consumers' lag, for operators.
	// It needs no database.
	commits := func(w http.ResponseWriter, r *http.Request) { operatorOnly(commitLogPage(src.CommitLog))(w, r, nil) }
	mux.HandleFunc("GET /commits", commits)
	mux.HandleFunc("GET /api/v1/commits", commits)
	// Builds over days from hourly_rollups (builds.ReadTrends).
	mux.HandleFunc("GET /trends", withPool(pool, trends))
	mux.HandleFunc("GET /api/v1/trends", withPool(pool, trends))
	mux.HandleFunc("GET /api/v1/flaky", withPool(pool, flakyTests))
	// A build's rows a page at a time (builds.Targets, builds.Tests,
	// builds.OutputPage): what a page of a build of a million events reads.
	mux.HandleFunc("GET /builds/{project}/{id}/targets", withPool(pool, forProject(targetsPage)))
	mux.HandleFunc("GET /builds/{project}/{id}/tests", withPool(pool, forProject(testsPage)))
	mux.HandleFunc("GET /builds/{project}/{id}/output/{stream}/{page}", withPool(pool, forProject(outputPage(archive))))
	// The invocation id alone (links from before projects were part of a
	// build's address): one project has it, go there; several, list them
	// (300 Multiple Choices) rather than pick one tenant's build.
	mux.HandleFunc("GET /builds/{id}", withPool(pool, byID))
}

type handler func(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool)

// forProject serves the pages of one build ({project} in the address) to
// a grant that sees the project; to any other, the build is not there, as
// one that does not exist is not.
func forProject(h handler) handler {
	return func(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
		project, id := r.PathValue("project"), r.PathValue("id")
		if GrantOf(r.Context()).Sees(project) {
			h(w, r, p)
			return
		}
		if wantsHTML(r) && !isAPI(r) {
			renderError(w, http.StatusNotFound, "No such build", fmt.Errorf("project %s has no build %s", project, id))
			return
		}
		writeJSON(w, http.StatusNotFound, map[string]string{"error": "no such build"})
	}
}

// scoped narrows a search to the request's grant: a read key searches its
// own project. It reports a search of another project, whose answer is
// empty (nothing says whether that project exists).
func scoped(r *http.Request, q *builds.SearchQuery) (elsewhere bool) {
	g := GrantOf(r.Context())
	switch {
	case g.All:
		return false
	case q.Project == "":
		q.Project = g.Project
		return false
	}
	return q.Project != g.Project
}

func withPool(pool func() *pgxpool.Pool, h handler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		p := pool()
		if p == nil {
			http.Error(w, "the database is not connected yet", http.StatusServiceUnavailable)
			return
		}
		h(w, r, p)
	}
}

// searchQuery reads a list's filters from the URL: project, status,
// command, user, host, branch, commit, from and to (RFC 3339 times or
// YYYY-MM-DD days, UTC), q (an invocation id or its start, or part of a
// target pattern), before (the cursor of the previous page's next) and
// limit.
func searchQuery(r *http.Request) (builds.SearchQuery, error) {
	v := r.URL.Query()
	q := builds.SearchQuery{Project: v.Get("project"), Status: v.Get("status"), Command: v.Get("command"),
		User: v.Get("user"), Host: v.Get("host"), Branch: v.Get("branch"), Commit: v.Get("commit"),
		Text: v.Get("q"), Before: v.Get("before")}
	for _, t := range []struct {
		name string
		to   *time.Time
	}{{"from", &q.From}, {"to", &q.To}} {
		s := v.Get(t.name)
		if s == "" {
			continue
		}
		var err error
		if *t.to, err = time.Parse(time.RFC3339, s); err != nil {
			if *t.to, err = time.Parse(time.DateOnly, s); err != nil {
				return q, fmt.Errorf("%s %q is neither an RFC 3339 time nor a YYYY-MM-DD day", t.name, s)
			}
		}
	}
	if l := v.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 0 {
			return q, fmt.Errorf("limit %q is not a count", l)
		}
		q.Limit = n
	}
	return q, q.Validate()
}

func searchBuilds(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	q, err := searchQuery(r)
	if err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
		return
	}
	var page builds.SearchPage
	if !scoped(r, &q) {
		page, err = builds.Search(r.Context(), p, q)
	}
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, page)
}

// listPage is what the front page shows: the filters as given, a page of
// builds, and the address of the next page.
type listPage struct {
	frame
	// Events is the address of the live list (the first page only), Limit
	// how many rows it keeps.
	Events   string
	Limit    int
	Filters  url.Values
	Statuses []string
	Builds   []builds.Summary
	Next     string
	Error    string
}

func latest(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	lp := listPage{Filters: r.URL.Query(), Statuses: builds.Statuses}
	lp.JSON = "/api/v1/builds?" + r.URL.RawQuery
	code := http.StatusOK
	q, err := searchQuery(r)
	if err == nil {
		if q.Before == "" {
			lp.Live, lp.Events, lp.Limit = true, "/events/builds?"+r.URL.RawQuery, cmp.Or(min(q.Limit, builds.MaxSearchRows), builds.DefaultSearchRows)
		}
		var page builds.SearchPage
		if !scoped(r, &q) {
			page, err = builds.Search(r.Context(), p, q)
		}
		if err == nil {
			lp.Builds = page.Builds
			if page.Next != "" {
				next := r.URL.Query()
				next.Set("before", page.Next)
				lp.Next = "/?" + next.Encode()
			}
		} else {
			code = http.StatusInternalServerError
		}
	} else {
		code = http.StatusBadRequest
	}
	if err != nil {
		lp.Error = err.Error()
	}
	render(w, code, "list", lp)
}

// pageQuery reads ?after=&limit=&failed=&status= into a builds.PageQuery.
func pageQuery(r *http.Request) (builds.PageQuery, error) {
	q := r.URL.Query()
	pq := builds.PageQuery{After: q.Get("after"), Failed: q.Get("failed") == "true", Status: q.Get("status")}
	if l := q.Get("limit"); l != "" {
		n, err := strconv.Atoi(l)
		if err != nil || n < 0 {
			return pq, fmt.Errorf("limit %q is not a count", l)
		}
		pq.Limit = n
	}
	return pq, nil
}

func targetsPage(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	pq, err := pageQuery(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	ts, err := builds.Targets(r.Context(), p, r.PathValue("project"), r.PathValue("id"), pq)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"targets": ts})
}

func testsPage(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	pq, err := pageQuery(r)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	ts, err := builds.Tests(r.Context(), p, r.PathValue("project"), r.PathValue("id"), pq)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	writeJSON(w, http.StatusOK, map[string]any{"tests": ts})
}

// outputPage serves one page of a stream (stdout or stderr) of a build's
// console output, as Bazel printed it, from PostgreSQL or, once the build
// is archived, from its object (builds.OutputReader).
func outputPage(archive func() builds.Archive) handler {
	return func(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
		stream := map[string]int16{"stdout": builds.StreamStdout, "stderr": builds.StreamStderr}[r.PathValue("stream")]
		page, err := strconv.ParseInt(r.PathValue("page"), 10, 32)
		if stream == 0 || err != nil || page < 0 {
			http.Error(w, "want /output/stdout/N or /output/stderr/N, N a page from 0", http.StatusBadRequest)
			return
		}
		out := builds.OutputReader{DB: p}
		if archive != nil {
			out.Archive = archive()
		}
		b, err := out.Page(r.Context(), r.PathValue("project"), r.PathValue("id"), stream, int32(page))
		switch {
		case errors.Is(err, builds.ErrNotFound):
			http.Error(w, "no such page", http.StatusNotFound)
		case errors.Is(err, builds.ErrNoArchive):
			http.Error(w, err.Error(), http.StatusServiceUnavailable)
		case err != nil:
			http.Error(w, err.Error(), http.StatusInternalServerError)
		default:
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
			w.Write(b)
		}
	}
}

func byID(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	id := r.PathValue("id")
	all, err := builds.Projects(r.Context(), p, id)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	grant := GrantOf(r.Context())
	projects := slices.DeleteFunc(all, func(project string) bool { return !grant.Sees(project) })
	switch len(projects) {
	case 0:
		http.Error(w, "no such build", http.StatusNotFound)
	case 1:
		http.Redirect(w, r, BuildPath(projects[0], id), http.StatusFound)
	default:
		links := make([]string, len(projects))
		for i, project := range projects {
			links[i] = BuildPath(project, id)
		}
		writeJSON(w, http.StatusMultipleChoices, map[string]any{"id": id, "projects": projects, "builds": links})
	}
}

// BuildPath is the console address of one build.
func BuildPath(project, id string) string {
	return "/builds/" + url.PathEscape(project) + "/" + url.PathEscape(id)
}

// TestPath is the console address of a test's history in a project. The
// label is a parameter, not a path: labels hold slashes and colons.
func TestPath(project, label string) string {
	return "/test?" + url.Values{"project": {project}, "label": {label}}.Encode()
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

// FilterNames are the list's text filters, in the form's order.
func (listPage) FilterNames() []string {
	return []string{"project", "command", "user", "host", "branch", "commit", "from", "to", "q"}
}
