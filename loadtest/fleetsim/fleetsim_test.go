package fleetsim_test

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"io"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/loadtest/fleetsim"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.DropTemplate()
	os.Exit(code)
}

// syncBuffer is a progress writer the test can read while Run writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestRun simulates 50 nodes against the fake fleet with every kind of
// load and checks the report's counts against what the fake saw.
func TestRun(t *testing.T) {
	ca := newTestCA(t)
	ns := testenv.NATS(t)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	db, dbURL := testenv.Pool(t)
	f := startFleet(t, ca, "sim-test", 4, 200*time.Millisecond, nc, db)
	f.refuseFirst.Store(10)
	f.markUnreachable = "n-00007"
	// A double booking the simulator must find: two live allocations
	// holding GPU 1 of some node.
	if _, err := db.Exec(context.Background(), `insert into fleet_allocations
		(id, reservation_id, pool, node_id, gpu_indices, decision_id, placed_at) values
		('x1', 'rx1', 'sim-test', 'other-node', '{0,1}', 'dx1', now()),
		('x2', 'rx2', 'sim-test', 'other-node', '{1,2}', 'dx2', now())`); err != nil {
		t.Fatal(err)
	}

	cfg := fleetsim.Config{
		Gateways:         []string{f.addr},
		Nodes:            50,
		NodePrefix:       "n-",
		Pool:             "sim-test",
		GPUsPerNode:      4,
		CACert:           ca.certFile,
		CAKey:            ca.keyFile,
		Duration:         7 * time.Second,
		Ramp:             500 * time.Millisecond,
		Settle:           5 * time.Second,
		SilenceTimeout:   10 * time.Second, // the race detector can starve the fake's acks
		StatusRate:       20,
		CrashRate:        300, // per minute: about 5/s, 300 ms each
		CrashFor:         300 * time.Millisecond,
		StormAt:          5 * time.Second, // after every node connected, even under the race detector
		ReservationsAddr: f.resvAddr,
		APIKey:           "test-key",
		ReservationRate:  20,
		ReservationHold:  time.Second,
		NATSURL:          ns.ClientURL(),
		DatabaseURL:      dbURL,
		GatewayPIDs:      []int{os.Getpid()},
		UnreachableAfter: 30 * time.Second,
		LivenessSamples:  20,
		ProgressEvery:    time.Second,
		Seed:             7,
	}
	var progress syncBuffer
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	rep, err := fleetsim.Run(ctx, cfg, &progress)
	if err != nil {
		t.Fatalf("Run: %v\n%s", err, progress.String())
	}
	js, _ := json.MarshalIndent(rep, "", "  ")
	t.Logf("progress:\n%s\nreport:\n%s", progress.String(), js)

	if rep.Setup.Nodes != 50 || rep.Setup.Certificates != "ca" {
		t.Errorf("setup %+v", rep.Setup)
	}
	if rep.Sessions.Peak != 50 || rep.Sessions.NeverConnected != 0 || rep.Sessions.AllHeldS <= 0 {
		t.Errorf("sessions %+v, want all 50 connected", rep.Sessions)
	}
	if rep.Sessions.FirstWelcome.Count != 50 {
		t.Errorf("first welcomes %d, want 50", rep.Sessions.FirstWelcome.Count)
	}
	if rep.Refusals["handshake_rate"] != 10 {
		t.Errorf("refusals %v, want 10 handshake_rate", rep.Refusals)
	}
	if rep.Heartbeats < 50 {
		t.Errorf("%d heartbeats", rep.Heartbeats)
	}
	if rep.StatusChanges == 0 {
		t.Error("no status changes")
	}
	// The storm: every node not crashed then was dropped, and each came back.
	if rep.Storm == nil || rep.Storm.Dropped == 0 || rep.Storm.Rehome.Count != uint64(rep.Storm.Dropped) || rep.Storm.RecoveredS < 0 {
		t.Errorf("storm %+v", rep.Storm)
	}
	if rep.Disconnect["dropped"] != int64(rep.Storm.Dropped) {
		t.Errorf("disconnects %v, want %d dropped", rep.Disconnect, rep.Storm.Dropped)
	}
	if rep.Crash.Started == 0 || rep.Crash.Resumed != rep.Crash.Started || rep.Crash.Forever != 0 {
		t.Errorf("crashes %+v, want some, all resumed", rep.Crash)
	}
	// Reservations, placements, binds.
	placed := int64(f.placements())
	if rep.Reservations.Created < 20 || len(rep.Reservations.CreateErrors) != 0 {
		t.Errorf("reservations %+v", rep.Reservations)
	}
	if rep.Placements.Source != "nats" || rep.Placements.Placed != placed || placed == 0 {
		t.Errorf("placements %+v, the fake placed %d", rep.Placements, placed)
	}
	// Every allocation is bound, or was released (cancelled) first.
	p := rep.Placements
	if int64(p.PlaceToActive.Count)+p.ReleasedUnbound != p.Allocations || p.NotBound != 0 || p.PlaceToActive.Count == 0 {
		t.Errorf("place-to-active %+v of %d allocations, %d released first, %d not bound", p.PlaceToActive, p.Allocations, p.ReleasedUnbound, p.NotBound)
	}
	if rep.Binds.Received < int64(p.PlaceToActive.Count) || rep.Binds.Received > p.Allocations || rep.Binds.Conflicts != 0 || rep.Binds.Invalid != 0 {
		t.Errorf("binds %+v, want one per allocation (%d), no conflicts", rep.Binds, p.Allocations)
	}
	if rep.Placements.PerSecond <= 0 {
		t.Errorf("placements per second %v", rep.Placements.PerSecond)
	}
	// Database checks.
	if rep.DoubleBookings == nil || rep.DoubleBookings.GPUs != 1 || rep.DoubleBookings.Total != 1 {
		t.Errorf("double bookings %+v, want the one planted", rep.DoubleBookings)
	}
	if l := rep.Liveness; l == nil || l.Lag.Count == 0 || l.UnreachableMarks != 1 || l.FalseUnreachable != 1 ||
		len(l.FalseExamples) != 1 || l.FalseExamples[0].Node != "n-00007" {
		t.Errorf("liveness %+v, want lag samples and the one false mark of n-00007", rep.Liveness)
	}
	// Memory: this process stands in for a gateway.
	if len(rep.Gateways) != 1 || rep.Gateways[0].BaselineKiB <= 0 || rep.Gateways[0].MaxKiB < rep.Gateways[0].BaselineKiB || rep.Gateways[0].CPUS <= 0 {
		t.Errorf("gateway process %+v", rep.Gateways)
	}
	if rep.Simulator.CPUS <= 0 || rep.Simulator.MaxRSSKiB <= 0 || rep.Simulator.PeakGoroutines < 50 {
		t.Errorf("simulator %+v", rep.Simulator)
	}
	if !strings.Contains(progress.String(), "all 50 nodes hold sessions") || !strings.Contains(progress.String(), "sessions ") {
		t.Errorf("progress lines missing:\n%s", progress.String())
	}
	if len(rep.Errors) != 0 {
		t.Errorf("errors: %v", rep.Errors)
	}
	var out bytes.Buffer
	if err := fleetsim.WriteReport("-", rep, &out); err != nil || !json.Valid(out.Bytes()) {
		t.Errorf("WriteReport: %v", err)
	}
}

// TestRunJoin gets the node certificates with Join (refused half the
// time, retried after the RetryInfo) and places nothing: no NATS, no
// database.
func TestRunJoin(t *testing.T) {
	ca := newTestCA(t)
	f := startFleet(t, ca, "pool-j", 2, 100*time.Millisecond, nil, (*pgxpool.Pool)(nil))
	cfg := fleetsim.Config{
		Gateways: []string{f.addr}, Nodes: 6, Pool: "pool-j", GPUsPerNode: 2,
		JoinToken: "tok", GatewayCA: ca.certFile, JoinConcurrency: 3,
		Duration: time.Second, Ramp: 100 * time.Millisecond, Settle: time.Millisecond, ProgressEvery: -1,
	}
	rep, err := fleetsim.Run(context.Background(), cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Setup.Certificates != "join" || rep.Sessions.Peak != 6 || rep.Liveness != nil || rep.DoubleBookings != nil {
		t.Errorf("report %+v", rep)
	}
	if f.joins.Load() < 12 {
		t.Errorf("%d Join calls, want at least 12 (each node refused once)", f.joins.Load())
	}

	cfg.JoinToken = "wrong"
	if _, err := fleetsim.Run(context.Background(), cfg, nil); err == nil || !strings.Contains(err.Error(), "bad token") {
		t.Errorf("Run with a bad join token: %v", err)
	}
}

func TestRefusesWhatCannotFitInOpenFiles(t *testing.T) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Skip(err)
	}
	ca := newTestCA(t)
	cfg := fleetsim.Config{Nodes: int(lim.Max), CACert: ca.certFile, CAKey: ca.keyFile}
	_, err := fleetsim.Run(context.Background(), cfg, nil)
	if err == nil || !strings.Contains(err.Error(), "open files") || !strings.Contains(err.Error(), "--first-node") {
		t.Errorf("Run with %d nodes: %v, want a refusal naming the open-files limit", lim.Max, err)
	}
}

func TestValidate(t *testing.T) {
	ok := fleetsim.Config{CACert: "ca.pem", CAKey: "ca-key.pem"}
	if err := ok.Validate(); err != nil {
		t.Errorf("valid config: %v", err)
	}
	for name, c := range map[string]fleetsim.Config{
		"no certificates":     {},
		"both":                {CACert: "a", CAKey: "b", JoinToken: "t"},
		"key missing":         {CACert: "a"},
		"join without trust":  {JoinToken: "t"},
		"bad gateway":         {Gateways: []string{"nohost"}, CACert: "a", CAKey: "b"},
		"rate without API":    {CACert: "a", CAKey: "b", ReservationRate: 1},
		"bad local addresses": {CACert: "a", CAKey: "b", LocalAddrs: "not-an-ip"},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestRegisterFlags(t *testing.T) {
	t.Setenv("MILLRACE_FLEETSIM_NODES", "123")
	t.Setenv("MILLRACE_FLEETSIM_GATEWAYS", "127.0.0.1:1,127.0.0.1:2")
	var c fleetsim.Config
	fs := flag.NewFlagSet("fleet", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	c.RegisterFlags(fs)
	if err := fs.Parse([]string{"-duration", "2m", "-models", "X:10,Y:20", "-seed", "9", "-gateway-pids", "1,2"}); err != nil {
		t.Fatal(err)
	}
	if c.Nodes != 123 || len(c.Gateways) != 2 || c.Duration != 2*time.Minute || len(c.Models) != 2 || c.Models[1].MemoryMiB != 20 ||
		c.Seed != 9 || len(c.GatewayPIDs) != 2 {
		t.Errorf("config %+v", c)
	}
	if err := fs.Parse([]string{"-models", "bad"}); err == nil {
		t.Error("-models bad accepted")
	}
}

// A variable that does not parse, or a negative count, fails Validate
// naming the variable: the run never starts on a default in its place.
func TestRegisterFlagsBadEnvironment(t *testing.T) {
	for env, val := range map[string]string{
		"MILLRACE_FLEETSIM_NODES":    "1k",
		"MILLRACE_FLEETSIM_MODELS":   "A100",
		"MILLRACE_FLEETSIM_DURATION": "60",
		"MILLRACE_FLEETSIM_SEED":     "random",
		"MILLRACE_FLEETSIM_SETTLE":   "-1s",
	} {
		t.Run(env, func(t *testing.T) {
			t.Setenv(env, val)
			c := fleetsim.Config{}
			fs := flag.NewFlagSet("fleet", flag.ContinueOnError)
			c.RegisterFlags(fs)
			if err := fs.Parse([]string{"-ca-cert", "a", "-ca-key", "b"}); err != nil {
				t.Fatal(err)
			}
			if err := c.Validate(); err == nil || !strings.Contains(err.Error(), env) || !strings.Contains(err.Error(), val) {
				t.Fatalf("%s=%s: %v; want an error naming the variable and its value", env, val, err)
			}
		})
	}
}
