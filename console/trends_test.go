package console

import (
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/testenv"
)

// The trends page draws a window of the rollups by day, with totals and
// a table of the projects; its JSON twin carries the same figures.
func TestConsoleTrends(t *testing.T) {
	pool, _ := testenv.Pool(t)
	if _, err := pool.Exec(context.Background(), `insert into hourly_rollups (project, hour, builds, succeeded, failed, abandoned,
		duration_hist, duration_sum_ms, tests_passed, tests_failed, tests_flaky, cache_hits, cache_misses) values
		('acme', date_trunc('hour', now()), 4, 3, 1, 0, '{0,4,0,0,0,0,0,0,0,0,0,0}', 8000, 10, 1, 2, 75, 25),
		('beta', date_trunc('hour', now()) - interval '3 days', 2, 2, 0, 0, '{0,0,2,0,0,0,0,0,0,0,0,0}', 16000, 0, 0, 0, 0, 0)`); err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }})
	get := pageGetter(t, mux)
	code, _, page := get("/trends")
	if code != http.StatusOK {
		t.Fatalf("trends: %d\n%s", code, page)
	}
	for _, want := range []string{"6<small>builds", "16.7%<small>failed", "75.0%<small>action cache hits",
		`href="/trends?project=acme&amp;days=30"`, `href="/trends?project=beta&amp;days=30"`, `<svg class="chart"`, `class="fail"`, "last 30 days"} {
		if !strings.Contains(page, want) {
			t.Errorf("no %q in the trends page", want)
		}
	}
	if _, _, page := get("/trends?project=acme&days=2"); !strings.Contains(page, "4<small>builds") || strings.Contains(page, `id="projects"`) ||
		!strings.Contains(page, "last 2 days") {
		t.Errorf("acme's trends of 2 days:\n%s", page)
	}
	if code, _, _ := get("/trends?days=400"); code != http.StatusBadRequest {
		t.Errorf("400 days: %d", code)
	}
	resp, err := http.Get(serveURL(t, mux) + "/api/v1/trends?project=acme&days=7")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var tr struct {
		Project string
		Days    []struct {
			Day          string
			Builds       int
			CacheHitRate float64 `json:"cache_hit_rate"`
			P50          int64   `json:"p50_ms"`
		}
		Total struct{ Builds int }
	}
	if err := json.NewDecoder(resp.Body).Decode(&tr); err != nil || tr.Project != "acme" || len(tr.Days) != 7 || tr.Total.Builds != 4 ||
		tr.Days[6].CacheHitRate != 0.75 || tr.Days[6].P50 != 3000 || tr.Days[0].P50 != -1 {
		t.Errorf("the JSON twin: %v %+v", err, tr)
	}
}
