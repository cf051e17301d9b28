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
		t.Logf("%s: binds received %d, conflicts %d, unbinds %d", name, rep.Binds.Received, rep.Binds.Conflicts, rep.Binds.Unbinds)
		return rep
	}
	// Crashes shorter than the grace, and a storm.
	short := run("short", 2*time.Second, 8*time.Second, nil)
	// Crashes longer than the grace (the nodes are fenced), and the whole
	// control plane killed with SIGKILL and started again.
	long := run("long", 9*time.Second, 0, func() {
		time.Sleep(10 * time.Second) // the point in the load at which to crash; nothing waits on it
		dev.kill()
		dev.start()
	})
	for name, r := range map[string]*fleetsim.Report{"short": short, "long": long} {
		if r.Binds.Received == 0 || r.Binds.Unbinds == 0 {
			t.Errorf("%s: no churn (%d binds, %d unbinds)", name, r.Binds.Received, r.Binds.Unbinds)
		}
		if r.Binds.Conflicts != 0 {
			t.Errorf("%s: %d Binds met a GPU held for another allocation", name, r.Binds.Conflicts)
		}
	}
}
