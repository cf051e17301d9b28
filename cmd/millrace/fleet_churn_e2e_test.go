package main

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/loadtest/fleetsim"
)

// TestFleetChurnNoConflicts runs the fleet simulator against `millrace dev`
// with the churn that used to double-book GPUs: reservations cancelled two
// seconds after they are made, a reconnect storm, node crashes shorter and
// longer than the grace (6 s here), and a kill -9 of the whole control
// plane in the middle. No node may receive a Bind for a GPU it holds for
// another allocation (binds.conflicts).
func TestFleetChurnNoConflicts(t *testing.T) {
	db := testenv.Database(t)
	dev := fleetDev(t, db, "MILLRACE_PLACER_UNBIND_RETRY=1s")
	b, err := os.ReadFile(filepath.Join(dev.fleetDir, "api-keys"))
	if err != nil {
		t.Fatal(err)
	}
	_, key, _ := strings.Cut(strings.TrimSpace(string(b)), "=")
	run := func(name string, crashFor time.Duration, storm time.Duration, during func()) *fleetsim.Report {
		cfg := fleetsim.Config{
			Gateways: []string{dev.fleetAddr}, ServerName: "localhost",
			Nodes: 24, NodePrefix: name + "-", Pool: "churn", GPUsPerNode: 4,
			CACert: filepath.Join(dev.fleetDir, "ca", "ca.crt"), CAKey: filepath.Join(dev.fleetDir, "ca", "ca.key"),
			Duration: 20 * time.Second, Ramp: time.Second, Settle: 5 * time.Second,
			CrashRate: 30, CrashFor: crashFor, StormAt: storm,
			ReservationsAddr: dev.resvAddr, APIKey: key, ReservationRate: 15, ReservationHold: 2 * time.Second,
			DatabaseURL: db, UnreachableAfter: 6 * time.Second, ProgressEvery: -1, Seed: 7,
		}
		if err := cfg.Validate(); err != nil {
			t.Fatal(err)
		}
		if during != nil {
			go during()
		}
		rep, err := fleetsim.Run(context.Background(), cfg, io.Discard)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		t.Logf("%s: binds received %d, conflicts %d, unbinds %d; placed %d, released %d; crashes %d", name,
			rep.Binds.Received, rep.Binds.Conflicts, rep.Binds.Unbinds, rep.Placements.Placed, rep.Placements.Released, rep.Crash.Started)
		traceConflicts(t, db, rep.Binds.ConflictSamples)
		return rep
	}
	// Crashes shorter than the grace, and a storm.
	short := run("short", 2*time.Second, 8*time.Second, nil)
	// Crashes longer than the grace (the nodes are fenced), and the whole
	// control plane killed with SIGKILL and started again.
	restarted := make(chan time.Time, 1)
	loadStart := time.Now()
	long := run("long", 9*time.Second, 0, func() {
		time.Sleep(10 * time.Second) // the point in the load at which to crash; nothing waits on it
		dev.kill()
		dev.start()
		restarted <- time.Now()
	})
	loadEnd := time.Now()
	// The restarted gateway held its binds back until it had read the
	// decisions up to the head, and then sent them.
	caughtUp := false
	for _, l := range strings.Split(dev.log.String(), "\n") {
		if strings.Contains(l, "placement decisions read up to the head") {
			caughtUp = true
			t.Logf("restarted control plane: %s", l)
		}
	}
	if !caughtUp {
		t.Error("the restarted gateway never read the decisions up to the head (binds held back for good)")
	}
	for name, r := range map[string]*fleetsim.Report{"short": short, "long": long} {
		if r.Binds.Received == 0 || r.Binds.Unbinds == 0 {
			t.Errorf("%s: no churn (%d binds, %d unbinds)", name, r.Binds.Received, r.Binds.Unbinds)
		}
		if r.Crash.Started == 0 || r.Crash.Resumed == 0 {
			t.Errorf("%s: no crashes (%+v)", name, r.Crash)
		}
		if r.Binds.Conflicts != 0 {
			t.Errorf("%s: %d Binds met a GPU held for another allocation", name, r.Binds.Conflicts)
		}
	}
	if short.Storm == nil || short.Storm.Rehome.Count == 0 {
		t.Errorf("short: no storm re-homes (%+v)", short.Storm)
	}
	// The kill -9 happened during the load, not after it.
	select {
	case at := <-restarted:
		if !at.Before(loadEnd) {
			t.Errorf("control plane restarted at %s, after the load (%s to %s)", at, loadStart, loadEnd)
		}
	default:
		t.Error("the control plane was not killed and restarted")
	}
	// The long crashes outlasted the grace: nodes were declared
	// unreachable (whether one of them had an allocation released
	// meanwhile, to be freed with a fence, is chance: logged).
	if long.Liveness == nil || long.Liveness.UnreachableMarks == 0 {
		t.Fatalf("long: no node was declared unreachable: the crashes did not outlast the grace (%+v)", long.Liveness)
	}
	pool := testPool(t, db)
	t.Logf("long: %d nodes marked unreachable, %d allocations freed as node_unreachable (fenced)", long.Liveness.UnreachableMarks,
		count(t, pool, `select count(*) from fleet_allocations where pool = 'churn' and node_id like 'long-%' and free_reason = 'node_unreachable'`))
}

// traceConflicts logs each sampled conflict with what the decisions say of
// both allocations, to find how the node came to be told to bind it.
func traceConflicts(t *testing.T, db string, cs []fleetsim.Conflict) {
	if len(cs) == 0 {
		return
	}
	pool := testPool(t, db)
	row := func(id string) string {
		var s string
		err := pool.QueryRow(context.Background(), `select format('%s on %s/%s gpus %s placed %s released %s (%s) freed %s (%s) report %s at %s',
				a.id, a.pool, a.node_id, a.gpu_indices, a.placed_at::time, a.released_at::time, a.release_reason,
				a.freed_at::time, a.free_reason, r.state, r.reported_at::time)
			from fleet_allocations a left join fleet_allocation_reports r on r.allocation_id = a.id where a.id = $1`, id).Scan(&s)
		if err != nil {
			return id + ": " + err.Error()
		}
		return s
	}
	for _, c := range cs {
		t.Logf("conflict at %s on %s GPU %d: bind %s, held %s (bound at %s)\n  bound: %s\n  held:  %s",
			c.At.UTC().Format("15:04:05.000"), c.Node, c.GPU, c.Bound, c.Held, c.HeldSince.UTC().Format("15:04:05.000"), row(c.Bound), row(c.Held))
	}
}
