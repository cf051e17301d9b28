// Package console is millrace's web console: what a person reads in a
// browser on a process's HTTP server (`millrace dev`, `serve bes`). Today
// it is small: the latest builds as a page, and each build as JSON at
// /builds/{project}/{id}, the document `builds show --project P --json`
// prints. Register serves it on a mux; Guard decides who may see it;
// WriteBuild prints a build for a terminal (`millrace builds show`).
//
// Handlers are thin: they parse the request, call one read function of a
// projection's package, which owns its SQL (builds.Latest,
// builds.WriteJSON, builds.Targets, builds.Tests, builds.OutputReader,
// builds.Projects), and render. The agreed direction (embedded templates
// with a layout, CSP, server-sent events) is in docs/design.md,
// "Planned"; README.md says what there is.
package console

import (
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"strconv"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/projectors/builds"
)

// Latest is how many builds the front page lists.
const Latest = 100

// Register serves the console on mux. pool is the database once connected
// (a process may serve before PostgreSQL answers): nil until then, and
// every page is 503 meanwhile. archive reads the objects of archived
// builds (archive.Objects over the process's bucket), where their console
// output moves once archived; nil: there is none, and such output is 503.
func Register(mux *http.ServeMux, pool func() *pgxpool.Pool, archive func() builds.Archive) {
	mux.HandleFunc("GET /{$}", withPool(pool, latest))
	// A build is (project, invocation id): two projects may send the same
	// id, so a build's page names both.
	mux.HandleFunc("GET /builds/{project}/{id}", withPool(pool, build))
	// A build's rows a page at a time (builds.Targets, builds.Tests,
	// builds.OutputPage): what a page of a build of a million events reads.
	mux.HandleFunc("GET /builds/{project}/{id}/targets", withPool(pool, targetsPage))
	mux.HandleFunc("GET /builds/{project}/{id}/tests", withPool(pool, testsPage))
	mux.HandleFunc("GET /builds/{project}/{id}/output/{stream}/{page}", withPool(pool, outputPage(archive)))
	// The invocation id alone (links from before projects were part of a
	// build's address): one project has it, go there; several, list them
	// (300 Multiple Choices) rather than pick one tenant's build.
	mux.HandleFunc("GET /builds/{id}", withPool(pool, byID))
}

type handler func(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool)

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

func latest(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	rows, err := builds.Latest(r.Context(), p, Latest)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "text/html; charset=utf-8")
	page.Execute(w, rows)
}

func build(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	// Streamed: the document holds every target and test of the build, and
	// builds.WriteJSON writes them as it reads them.
	w.Header().Set("Content-Type", "application/json")
	err := builds.WriteJSON(r.Context(), p, w, r.PathValue("project"), r.PathValue("id"))
	if errors.Is(err, builds.ErrNotFound) { // nothing written yet
		http.Error(w, "no such build", http.StatusNotFound)
		return
	}
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
	}
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
	projects, err := builds.Projects(r.Context(), p, id)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
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

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

var page = template.Must(template.New("console").Funcs(template.FuncMap{"buildPath": BuildPath}).Parse(`<!doctype html>
<html><head><meta charset="utf-8"><title>millrace</title>
<style>body{font-family:system-ui,sans-serif;margin:2em}table{border-collapse:collapse}td,th{padding:.3em .8em;border-bottom:1px solid #ddd;text-align:left}
.failed{color:#b00}.succeeded{color:#070}.abandoned{color:#888}</style></head>
<body><h1>millrace: latest builds</h1>
<p><a href="/metrics">metrics</a> · <a href="/readyz">readiness</a></p>
<table><tr><th>invocation</th><th>project</th><th>command</th><th>status</th><th>exit</th><th>started</th><th>duration</th></tr>
{{range .}}<tr><td><a href="{{buildPath .Project .ID}}">{{.ID}}</a></td><td>{{.Project}}</td><td>{{.Command}}</td><td class="{{.Status}}">{{.Status}}</td><td>{{.ExitName}}</td>
<td>{{if .Started}}{{.Started.Format "2006-01-02 15:04:05"}}{{end}}</td><td>{{if .DurationMs}}{{.DurationMs}} ms{{end}}</td></tr>
{{else}}<tr><td colspan="7">No builds yet. Try: bazel build //... --bes_backend=grpc://127.0.0.1:1985</td></tr>{{end}}
</table></body></html>`))
