package console

import (
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strconv"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/projectors/builds"
)

// testView is a test's history page.
type testView struct {
	frame
	H             builds.TestHistory
	Query         url.Values
	Chart, Timing any
}

// historyQuery reads ?project=&label=&before=&limit=&days=.
func historyQuery(r *http.Request) (builds.HistoryQuery, error) {
	v := r.URL.Query()
	q := builds.HistoryQuery{Project: v.Get("project"), Label: v.Get("label"), Before: v.Get("before")}
	var err error
	if q.Limit, err = intParam(v, "limit"); err != nil {
		return q, err
	}
	if q.Days, err = intParam(v, "days"); err != nil {
		return q, err
	}
	if q.Project == "" || q.Label == "" {
		return q, errors.New("name the test: ?project=P&label=//pkg:test")
	}
	return q, q.Validate()
}

func intParam(v url.Values, name string) (int, error) {
	s := v.Get(name)
	if s == "" {
		return 0, nil
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("%s %q is not a count", name, s)
	}
	return n, nil
}

func testHistory(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	q, err := historyQuery(r)
	if err != nil {
		if !wantsHTML(r) || isAPI(r) {
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
			return
		}
		renderError(w, http.StatusBadRequest, "Test", err)
		return
	}
	var h builds.TestHistory
	if GrantOf(r.Context()).Sees(q.Project) {
		h, err = builds.ReadTestHistory(r.Context(), p, q)
	} else {
		err = builds.ErrNotFound // another project's tests are not there
	}
	code := http.StatusOK
	switch {
	case errors.Is(err, builds.ErrNotFound):
		code, err = http.StatusNotFound, fmt.Errorf("project %s has run no test %s", q.Project, q.Label)
	case err != nil:
		code = http.StatusInternalServerError
	}
	if isAPI(r) {
		if err != nil {
			writeJSON(w, code, map[string]string{"error": err.Error()})
			return
		}
		writeJSON(w, http.StatusOK, h)
		return
	}
	if err != nil {
		renderError(w, code, "Test", err)
		return
	}
	v := testView{H: h, Query: r.URL.Query()}
	v.JSON = "/api/v1/tests?" + r.URL.RawQuery
	if len(h.Daily) > 0 {
		var counts, means []stack
		for _, d := range h.Daily {
			title := fmt.Sprintf("%s: %d runs, %d passed, %d flaky, %d failed", d.Day, d.Runs, d.Passed, d.Flaky, d.Failed)
			counts = append(counts, stack{Label: d.Day[5:], Parts: []float64{float64(d.Passed), float64(d.Flaky), float64(d.Failed)}, Title: title})
			means = append(means, stack{Label: d.Day[5:], Parts: []float64{float64(d.MeanMs) / 1000}, Title: fmt.Sprintf("%s: mean %s", d.Day, formatMs(d.MeanMs))})
		}
		v.Chart = stackedBars(counts, []string{"pass", "flake", "fail"}, 720, 160)
		v.Timing = stackedBars(means, []string{"bar"}, 720, 120)
	}
	render(w, http.StatusOK, "test", v)
}

// isAPI: the request is for a JSON twin under /api/v1/.
func isAPI(r *http.Request) bool { return len(r.URL.Path) >= 8 && r.URL.Path[:8] == "/api/v1/" }

// flakyView is a project's flaky tests.
type flakyView struct {
	frame
	Project  string
	Days     int
	Projects []string
	Tests    []builds.FlakyTest
	Error    string
}

func flakyTests(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	v := flakyView{Project: r.URL.Query().Get("project"), Days: builds.DefaultWindowDays}
	grant := GrantOf(r.Context())
	if v.Project == "" && !grant.All {
		v.Project = grant.Project
	}
	v.JSON = "/api/v1/flaky?" + r.URL.RawQuery
	code := http.StatusOK
	days, err := intParam(r.URL.Query(), "days")
	if days > 0 {
		v.Days = days
	}
	// Another project's page is an empty one: nothing says it exists.
	if err == nil && v.Project != "" && grant.Sees(v.Project) {
		v.Tests, err = builds.FlakyTests(r.Context(), p, builds.FlakyQuery{Project: v.Project, Days: days})
	}
	if err != nil {
		code = http.StatusBadRequest
		v.Error = err.Error()
	}
	if isAPI(r) {
		switch {
		case err != nil:
			writeJSON(w, code, map[string]string{"error": err.Error()})
		case v.Project == "":
			writeJSON(w, http.StatusBadRequest, map[string]string{"error": "flaky tests are a project's: ?project=P"})
		default:
			writeJSON(w, http.StatusOK, map[string]any{"project": v.Project, "days": v.Days, "tests": v.Tests})
		}
		return
	}
	if v.Project == "" {
		if v.Projects, err = builds.ProjectNames(r.Context(), p); err != nil {
			renderError(w, http.StatusInternalServerError, "Flaky tests", err)
			return
		}
	}
	render(w, code, "flaky", v)
}
