package console

import (
	"fmt"
	"html/template"
	"net/http"
	"net/url"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/projectors/builds"
)

// trendsView is the trends page: a window of days of a project (or of
// every project the key sees) from hourly_rollups, as charts drawn by the
// server.
type trendsView struct {
	frame
	T                           builds.Trends
	Query                       url.Values
	Days                        int
	Builds, Failures, Durations template.HTML
	Cache                       template.HTML
	HasCache                    bool
}

// trends serves /trends and /api/v1/trends: ?project=&days=.
func trends(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	v := r.URL.Query()
	q := builds.TrendQuery{Project: v.Get("project")}
	days, err := intParam(v, "days")
	q.Days = days
	if err == nil {
		err = q.Validate()
	}
	if err != nil {
		if isAPI(r) {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
			return
		}
		renderError(w, http.StatusBadRequest, "Trends", err)
		return
	}
	// A read key's trends are its project's: the read is of that project
	// alone, and another project's are those of a project without builds.
	if grant := GrantOf(r.Context()); !grant.All {
		q.Projects = []string{grant.Project}
		if q.Project == "" {
			q.Project = grant.Project
		}
	}
	t, err := builds.ReadTrends(r.Context(), p, q)
	if err != nil {
		if isAPI(r) {
			writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
			return
		}
		renderError(w, http.StatusInternalServerError, "Trends", err)
		return
	}
	if isAPI(r) {
		writeJSON(w, http.StatusOK, t)
		return
	}
	view := trendsView{T: t, Query: v, Days: len(t.Days)}
	view.JSON = "/api/v1/trends?" + r.URL.RawQuery
	var counts, fails, durations, cache []stack
	for _, d := range t.Days {
		label := d.Day[5:]
		counts = append(counts, stack{Label: label, Parts: []float64{float64(d.Succeeded), float64(d.Failed), float64(d.Abandoned)},
			Title: fmt.Sprintf("%s: %d builds, %d succeeded, %d failed, %d cut off", d.Day, d.Builds, d.Succeeded, d.Failed, d.Abandoned)})
		fails = append(fails, stack{Label: label, Parts: []float64{100 * d.FailureRate},
			Title: fmt.Sprintf("%s: %.1f%% of %d builds failed", d.Day, 100*d.FailureRate, d.Builds)})
		dur := stack{Label: label, Title: d.Day + ": no builds"}
		if d.P50Ms >= 0 {
			dur.Parts = []float64{float64(d.P50Ms) / 1000, float64(d.P90Ms-d.P50Ms) / 1000}
			dur.Title = fmt.Sprintf("%s: p50 %s, p90 %s, p99 %s", d.Day, formatMs(d.P50Ms), formatMs(d.P90Ms), formatMs(d.P99Ms))
		}
		durations = append(durations, dur)
		c := stack{Label: label, Title: d.Day + ": no cache lookups reported"}
		if d.CacheHitRate >= 0 {
			view.HasCache = true
			c.Parts = []float64{100 * d.CacheHitRate}
			c.Title = fmt.Sprintf("%s: %.1f%% of %d action cache lookups hit", d.Day, 100*d.CacheHitRate, d.CacheHits+d.CacheMisses)
		}
		cache = append(cache, c)
	}
	view.Builds = stackedBars(counts, []string{"pass", "fail", "other"}, 720, 160)
	view.Failures = stackedBars(fails, []string{"bar bad"}, 720, 120)
	view.Durations = stackedBars(durations, []string{"bar", "bar light"}, 720, 140)
	view.Cache = stackedBars(cache, []string{"bar"}, 720, 120)
	render(w, http.StatusOK, "trends", view)
}
