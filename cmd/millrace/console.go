package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"html/template"
	"net/http"
	"net/url"
	"os"
	"text/tabwriter"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/projectors/builds"
)

// registerConsole serves a small read-only console: the latest builds, and
// each build as JSON at /builds/{project}/{id} (the same document
// `builds show --project P --json` prints).
func registerConsole(mux *http.ServeMux, pool func() *pgxpool.Pool) {
	mux.HandleFunc("GET /{$}", func(w http.ResponseWriter, r *http.Request) {
		p := pool()
		if p == nil {
			http.Error(w, "the database is not connected yet", http.StatusServiceUnavailable)
			return
		}
		rows, err := recentBuilds(r.Context(), p, 100)
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		w.Header().Set("Content-Type", "text/html; charset=utf-8")
		consolePage.Execute(w, rows)
	})
	// A build is (project, invocation id): two projects may send the same
	// id, so a build's page names both.
	mux.HandleFunc("GET /builds/{project}/{id}", func(w http.ResponseWriter, r *http.Request) {
		p := pool()
		if p == nil {
			http.Error(w, "the database is not connected yet", http.StatusServiceUnavailable)
			return
		}
		b, err := builds.Show(r.Context(), p, r.PathValue("project"), r.PathValue("id"))
		if errors.Is(err, builds.ErrNotFound) {
			http.Error(w, "no such build", http.StatusNotFound)
			return
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		writeJSON(w, http.StatusOK, b)
	})
	// The invocation id alone (links from before projects were part of a
	// build's address): one project has it, go there; several, list them
	// (300 Multiple Choices) rather than pick one tenant's build.
	mux.HandleFunc("GET /builds/{id}", func(w http.ResponseWriter, r *http.Request) {
		p := pool()
		if p == nil {
			http.Error(w, "the database is not connected yet", http.StatusServiceUnavailable)
			return
		}
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
			http.Redirect(w, r, buildPath(projects[0], id), http.StatusFound)
		default:
			links := make([]string, len(projects))
			for i, project := range projects {
				links[i] = buildPath(project, id)
			}
			writeJSON(w, http.StatusMultipleChoices, map[string]any{"id": id, "projects": projects, "builds": links})
		}
	})
}

// buildPath is the console address of one build.
func buildPath(project, id string) string {
	return "/builds/" + url.PathEscape(project) + "/" + url.PathEscape(id)
}

func writeJSON(w http.ResponseWriter, code int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(code)
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(v)
}

type buildRow struct {
	ID, Project, Status, Command, ExitName string
	Started                                *time.Time
	DurationMs                             *int64
}

func recentBuilds(ctx context.Context, p *pgxpool.Pool, n int) ([]buildRow, error) {
	rows, err := p.Query(ctx, `select id, project, status, coalesce(command, ''), coalesce(exit_code_name, ''), started_at, duration_ms
		from invocations order by first_event_at desc limit $1`, n)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (buildRow, error) {
		var b buildRow
		err := r.Scan(&b.ID, &b.Project, &b.Status, &b.Command, &b.ExitName, &b.Started, &b.DurationMs)
		return b, err
	})
}

var consolePage = template.Must(template.New("console").Funcs(template.FuncMap{"buildPath": buildPath}).Parse(`<!doctype html>
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

// printBuild writes one build for a person.
func printBuild(b *builds.Build) {
	w := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	defer w.Flush()
	fmt.Fprintf(w, "invocation\t%s\nproject\t%s\nstatus\t%s\n", b.ID, b.Project, b.Status)
	if b.Command != nil {
		fmt.Fprintf(w, "command\t%s\n", *b.Command)
	}
	if b.ExitCode != nil && b.ExitCodeName != nil {
		fmt.Fprintf(w, "exit\t%d %s\n", *b.ExitCode, *b.ExitCodeName)
	}
	if b.DurationMs != nil {
		fmt.Fprintf(w, "duration\t%s\n", time.Duration(*b.DurationMs)*time.Millisecond)
	}
	failed := 0
	for _, t := range b.Targets {
		if !t.Success {
			failed++
		}
	}
	fmt.Fprintf(w, "targets\t%d (%d failed)\n", len(b.Targets), failed)
	for _, t := range b.Targets {
		if !t.Success {
			reason := ""
			if t.FailureReason != nil {
				reason = *t.FailureReason
			}
			fmt.Fprintf(w, "  FAILED\t%s\t%s\n", t.Label, reason)
		}
	}
	fmt.Fprintf(w, "tests\t%d\n", len(b.Tests))
	for _, t := range b.Tests {
		fmt.Fprintf(w, "  %s\t%s\n", t.Status, t.Label)
	}
}
