package console

import (
	"net/http"
	"net/url"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/projectors/fleet"
)

// operatorOnly serves a page of the control plane (the fleet, the commit
// log) to an operator's key only: a project's read key is refused.
func operatorOnly(h handler) handler {
	return func(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
		if GrantOf(r.Context()).All {
			h(w, r, p)
			return
		}
		const msg = "this page needs an operator's console key (a key alone on its line of --http-console-keys-file); a project's key reads its builds"
		if isAPI(r) {
			writeJSON(w, http.StatusForbidden, map[string]string{"error": msg})
			return
		}
		render(w, http.StatusForbidden, "error", errorPage{Title: "Operators only", Error: msg})
	}
}

// fleetView is the fleet page: the pools, the placements' latency, a
// pool's nodes and the newest reservations.
type fleetView struct {
	frame
	Query        url.Values          `json:"-"`
	Pool         string              `json:"pool,omitempty"`
	State        string              `json:"state,omitempty"`
	Pools        []fleet.PoolSummary `json:"pools"`
	LastHour     fleet.Latency       `json:"placement_last_hour"`
	LastDay      fleet.Latency       `json:"placement_last_day"`
	Nodes        []fleet.NodeRow     `json:"nodes,omitempty"`
	Next         string              `json:"next,omitempty"`
	Reservations []fleet.Reservation `json:"reservations"`
	Now          time.Time           `json:"-"`
}

// fleetPage serves /fleet and /api/v1/fleet: ?pool=&state=&after=&limit=.
func fleetPage(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
	ctx := r.Context()
	v := r.URL.Query()
	fv := fleetView{Query: v, Pool: v.Get("pool"), State: v.Get("state"), Now: time.Now().UTC()}
	fv.JSON = "/api/v1/fleet?" + r.URL.RawQuery
	limit, err := intParam(v, "limit")
	fail := func(code int, err error) {
		if isAPI(r) {
			writeJSON(w, code, map[string]string{"error": err.Error()})
			return
		}
		renderError(w, code, "Fleet", err)
	}
	if err != nil {
		fail(http.StatusBadRequest, err)
		return
	}
	if fv.Pools, err = fleet.Pools(ctx, p); err != nil {
		fail(http.StatusInternalServerError, err)
		return
	}
	for _, l := range []struct {
		to  *fleet.Latency
		ago time.Duration
	}{{&fv.LastHour, time.Hour}, {&fv.LastDay, 24 * time.Hour}} {
		if *l.to, err = fleet.PlacementLatency(ctx, p, fv.Pool, fv.Now.Add(-l.ago)); err != nil {
			fail(http.StatusInternalServerError, err)
			return
		}
	}
	if fv.Pool != "" {
		fv.Nodes, fv.Next, err = fleet.NodesPage(ctx, p, fleet.NodeQuery{Pool: fv.Pool, State: fv.State, After: v.Get("after"), Limit: limit})
		if err != nil {
			fail(http.StatusBadRequest, err)
			return
		}
	}
	if fv.Reservations, err = fleet.Reservations(ctx, p, fv.Pool, 50); err != nil {
		fail(http.StatusInternalServerError, err)
		return
	}
	if isAPI(r) {
		writeJSON(w, http.StatusOK, fv)
		return
	}
	render(w, http.StatusOK, "fleet", fv)
}
