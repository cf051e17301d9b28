package console

import (
	"bytes"
	"embed"
	"fmt"
	"html/template"
	"io/fs"
	"log/slog"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/projectors/fleet"
)

// namedLatency is a row of the fleet page's placement latency.
type namedLatency struct {
	Name string
	L    fleet.Latency
}

// The console's pages are Go templates in templates/: layout.html draws
// the frame (the header, the navigation, the stylesheet and, for a live
// page, live.js), and each view defines its "title" and "content". The
// stylesheet and the script are in static/ and served from the binary:
// nothing is fetched from elsewhere at run time, and the pages' policy
// (contentPolicy) forbids it.
var (
	//go:embed templates/*.html
	templateFS embed.FS
	//go:embed static
	staticFS embed.FS
)

// contentPolicy is every page's Content-Security-Policy: scripts, styles
// and connections (the live pages' event streams) from this server only,
// no inline script or style, no framing.
const contentPolicy = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; " +
	"connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"

// frame is what the layout reads of every view: whether the page is live
// (loads live.js) and the address of its JSON twin.
type frame struct {
	Live bool
	JSON string
}

var funcs = template.FuncMap{
	"buildPath": BuildPath,
	"testPath":  TestPath,
	"join":      strings.Join,
	"lower":     strings.ToLower,
	"ansi":      func(s string) template.HTML { return ANSI([]byte(s)) },
	"short": func(s string) string {
		if len(s) > 12 {
			return s[:8] + "…"
		}
		return s
	},
	"deref": func(s *string) string {
		if s == nil {
			return ""
		}
		return *s
	},
	"derefInt": func(n *int32) int32 {
		if n == nil {
			return 0
		}
		return *n
	},
	"derefInt64": func(n *int64) int64 {
		if n == nil {
			return 0
		}
		return *n
	},
	"rfc3339": func(t *time.Time) string { return t.Format(time.RFC3339) },
	"ms":      formatMs,
	"bytes":   formatBytes,
	"mib":     func(n int64) string { return formatBytes(n) },
	"inc":     func(n int32) int32 { return n + 1 },
	"pct":     func(f float64) string { return strconv.FormatFloat(100*f, 'f', 1, 64) + "%" },
	// runClass is the colour of a run in a test's strip.
	"runClass": func(r builds.TestRun) string {
		switch {
		case r.Status == "PASSED":
			return "passed"
		case r.Status == "FLAKY" || r.Flaked:
			return "flaky"
		case r.Status == "NO_STATUS":
			return "other"
		}
		return "failed"
	},
	"dec": func(n int32) int32 { return n - 1 },
	"hitRate": func(hits, misses int64) string {
		if hits+misses == 0 {
			return ""
		}
		return strconv.FormatFloat(100*float64(hits)/float64(hits+misses), 'f', 1, 64) + "%"
	},
	// set is the current query with some parameters replaced ("" removes
	// one): the links of a page's tabs and pages keep its other choices.
	"set": func(q url.Values, kv ...any) string {
		next := url.Values{}
		for k, v := range q {
			next[k] = v
		}
		for i := 0; i+1 < len(kv); i += 2 {
			k, v := fmt.Sprint(kv[i]), fmt.Sprint(kv[i+1])
			if v == "" {
				next.Del(k)
			} else {
				next.Set(k, v)
			}
		}
		if len(next) == 0 {
			return "?"
		}
		return "?" + next.Encode()
	},
	// row is a test with its build's project, for templates/rows.html.
	"row": func(project string, t builds.Test) row { return row{project, t} },
	// share is part as a percentage of whole ("" when whole is 0).
	"share": func(part, whole int64) string {
		if whole <= 0 {
			return ""
		}
		return strconv.FormatFloat(100*float64(part)/float64(whole), 'f', 0, 64) + "%"
	},
	// since is how long ago t was, as a person reads it.
	"since": func(now time.Time, t *time.Time) string { return formatMs(now.Sub(*t).Milliseconds()) },
	// list is its arguments, for a range in a template.
	"list": func(s ...string) []string { return s },
	// msf is formatMs of a fractional count of milliseconds.
	"msf": func(ms float64) string { return formatMs(int64(ms + 0.5)) },
	// latencies names the fleet page's two windows.
	"latencies": func(hour, day fleet.Latency) []namedLatency {
		return []namedLatency{{"last hour", hour}, {"last 24 hours", day}}
	},
	// attempts says how a test ran when it was more than once.
	"attempts": func(t builds.Test) string {
		if t.Attempts > 1 {
			return strconv.Itoa(int(t.Attempts)) + " attempts"
		}
		return ""
	},
}

// views are the parsed pages, by file name: each with the layout and the
// rows that pages and live events share.
var views = func() map[string]*template.Template {
	m := map[string]*template.Template{}
	names, err := fs.Glob(templateFS, "templates/*.html")
	if err != nil {
		panic(err)
	}
	for _, name := range names {
		if name == "templates/layout.html" || name == "templates/rows.html" {
			continue
		}
		base := strings.TrimSuffix(strings.TrimPrefix(name, "templates/"), ".html")
		m[base] = template.Must(template.New(base).Funcs(funcs).ParseFS(templateFS, "templates/layout.html", "templates/rows.html", name))
	}
	return m
}()

// render writes view with data as an HTML page, with the console's
// security headers. It renders into a buffer first, so that a template
// error is a 500 page rather than half a page.
func render(w http.ResponseWriter, code int, view string, data any) {
	var buf bytes.Buffer
	if err := views[view].ExecuteTemplate(&buf, "layout", data); err != nil {
		slog.Error("console: rendering a page", "op", "render "+view, "err", err)
		http.Error(w, "console: rendering the page failed: "+err.Error(), http.StatusInternalServerError)
		return
	}
	h := w.Header()
	h.Set("Content-Type", "text/html; charset=utf-8")
	h.Set("Content-Security-Policy", contentPolicy)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "same-origin")
	w.WriteHeader(code)
	w.Write(buf.Bytes())
}

// errorPage is the page of a request the console cannot answer.
type errorPage struct {
	frame
	Title, Error string
}

func renderError(w http.ResponseWriter, code int, title string, err error) {
	render(w, code, "error", errorPage{Title: title, Error: err.Error()})
}

// static serves the stylesheet and the script, cached for an hour.
func static() http.Handler {
	sub, err := fs.Sub(staticFS, "static")
	if err != nil {
		panic(err)
	}
	files := http.FileServerFS(sub)
	return http.StripPrefix("/static/", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Cache-Control", "public, max-age=3600")
		w.Header().Set("X-Content-Type-Options", "nosniff")
		files.ServeHTTP(w, r)
	}))
}

// formatMs writes a duration in milliseconds as a person reads it: 850 ms,
// 4.6 s, 3m12s, 2h05m.
func formatMs(ms int64) string {
	d := time.Duration(ms) * time.Millisecond
	switch {
	case ms < 1000:
		return strconv.FormatInt(ms, 10) + " ms"
	case d < time.Minute:
		return strconv.FormatFloat(d.Seconds(), 'f', 1, 64) + " s"
	case d < time.Hour:
		return fmt.Sprintf("%dm%02ds", int(d.Minutes()), int(d.Seconds())%60)
	}
	return fmt.Sprintf("%dh%02dm", int(d.Hours()), int(d.Minutes())%60)
}

func formatBytes(n int64) string {
	switch {
	case n < 1<<10:
		return strconv.FormatInt(n, 10) + " B"
	case n < 1<<20:
		return strconv.FormatFloat(float64(n)/(1<<10), 'f', 1, 64) + " KiB"
	case n < 1<<30:
		return strconv.FormatFloat(float64(n)/(1<<20), 'f', 1, 64) + " MiB"
	}
	return strconv.FormatFloat(float64(n)/(1<<30), 'f', 1, 64) + " GiB"
}
