package console

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/apikey"
	"github.com/millrace/millrace/internal/testenv"
)

// The fleet page shows an operator the pools, a pool's nodes, the newest
// reservations and the placements' latency; a project's key is refused.
func TestConsoleFleet(t *testing.T) {
	pool, _ := testenv.Pool(t)
	if _, err := pool.Exec(context.Background(), `
		insert into fleet_nodes (node_id, pool, state, connected, gateway_id, state_since, first_seen, last_seen)
		select format('n%s', i), 'a100', case when i = 3 then 'unreachable' else 'healthy' end, i <> 3, 'gw-1', now(), now(), now()
		from generate_series(1, 4) i;
		insert into fleet_devices (pool, node_id, gpu_index, health) select 'a100', node_id, 0, 'ok' from fleet_nodes;
		insert into fleet_reservations (id, pool, gpus, owner, requested_at) values ('r1', 'a100', 1, 'ml', now() - interval '1 minute');
		insert into fleet_placements (reservation_id, decision_id, placed_at) values ('r1', 'd1', now() - interval '1 minute' + interval '250 milliseconds')`); err != nil {
		t.Fatal(err)
	}
	keys, _ := apikey.Parse(operatorKey+"\nacme="+acmeKey, KeySyntax)
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }})
	srv := httptest.NewServer(&Guard{Console: Keys{keys}, Next: mux})
	defer srv.Close()
	get := func(key, path string) (int, string) {
		req, _ := http.NewRequest("GET", srv.URL+path, nil)
		req.SetBasicAuth("me", key)
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	code, page := get(operatorKey, "/fleet?pool=a100")
	if code != http.StatusOK {
		t.Fatalf("fleet: %d\n%s", code, page)
	}
	for _, want := range []string{`href="/fleet?pool=a100"`, "<code>n3</code>", `class="status unreachable"`, "gw-1", "<code>r1</code>", "250 ms", "last hour"} {
		if !strings.Contains(page, want) {
			t.Errorf("no %q on the fleet page", want)
		}
	}
	if _, page := get(operatorKey, "/fleet?pool=a100&state=unreachable"); strings.Contains(page, "<code>n1</code>") || !strings.Contains(page, "<code>n3</code>") {
		t.Error("the unreachable nodes of a100 list others")
	}
	if code, _ := get(operatorKey, "/fleet?pool=a100&state=gone"); code != http.StatusBadRequest {
		t.Errorf("a bad state: %d", code)
	}
	code, body := get(operatorKey, "/api/v1/fleet?pool=a100&limit=2")
	var f struct {
		Pools []struct{ Pool string }
		Nodes []struct{ ID string }
		Next  string
		Hour  struct{ Placements int } `json:"placement_last_hour"`
	}
	if err := json.Unmarshal([]byte(body), &f); code != http.StatusOK || err != nil || len(f.Pools) != 1 || len(f.Nodes) != 2 || f.Next != "n2" || f.Hour.Placements != 1 {
		t.Errorf("the JSON twin: %d %v %s", code, err, body)
	}
	for _, path := range []string{"/fleet", "/api/v1/fleet"} {
		if code, body := get(acmeKey, path); code != http.StatusForbidden || strings.Contains(body, "a100") {
			t.Errorf("a project's key on %s: %d", path, code)
		}
	}
}
