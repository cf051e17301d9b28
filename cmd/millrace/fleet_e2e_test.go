package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/millrace/millrace/agent"
	"github.com/millrace/millrace/internal/testenv"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	"github.com/millrace/millrace/projectors/placer"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/services/fleet"
)

// Fleet timings for the end-to-end tests: ten times faster than the
// defaults, so that a test sees nodes go suspect and unreachable in seconds.
var fleetFastEnv = []string{
	"MILLRACE_FLEET_HEARTBEAT_INTERVAL=1s",
	"MILLRACE_FLEET_FLUSH_INTERVAL=500ms",
	"MILLRACE_FLEET_SUSPECT_AFTER=3s",
	"MILLRACE_FLEET_UNREACHABLE_AFTER=6s",
	"MILLRACE_FLEET_CLOCK_SLACK=2s",
	"MILLRACE_FLEET_PROJECTOR_MAX_WAIT=50ms",
	"MILLRACE_PLACER_BIND_TIMEOUT=5s",
	"MILLRACE_PLACER_SWEEP_EVERY=200ms",
}

// fleetDev starts `millrace dev` with fast fleet timings and waits until
// its CA and development secrets exist, so that more gateways can share
// them.
func fleetDev(t *testing.T, db string, env ...string) *devProcess {
	t.Helper()
	d := newDev(t, db)
	d.env = append(d.env, fleetFastEnv...)
	d.env = append(d.env, env...) // the last value of a variable wins
	d.start()
	waitUntil(t, "the dev CA and secrets", func() bool {
		_, e1 := os.Stat(filepath.Join(d.fleetDir, "ca", "ca.key"))
		_, e2 := os.Stat(filepath.Join(d.fleetDir, "api-keys"))
		return e1 == nil && e2 == nil
	})
	return d
}

// gateway starts `millrace serve fleet` on addr, on dev's backbone and CA.
func gateway(t *testing.T, dev *devProcess, id, addr string) *devProcess {
	t.Helper()
	g := &devProcess{t: t, args: []string{"serve", "fleet"}, besAddr: addr} // start waits for besAddr
	g.env = append(os.Environ(),
		"MILLRACE_NATS_URL="+dev.natsURL,
		"MILLRACE_NATS_NKEY="+dev.natsNKey,
		"MILLRACE_FLEET_LISTEN="+addr,
		"MILLRACE_FLEET_GATEWAY_ID="+id,
		"MILLRACE_FLEET_CA_DIR="+filepath.Join(dev.fleetDir, "ca"),
		"MILLRACE_HTTP_LISTEN=127.0.0.1:0",
	)
	g.env = append(g.env, fleetFastEnv...)
	t.Cleanup(g.kill)
	g.start()
	return g
}

// simNodes are GPU nodes run by real agents in the test process, with
// where each one's session is and how long its re-homes took.
type simNodes struct {
	agents []*agent.Agent
	mu     sync.Mutex
	at     map[string]string // node -> gateway address of its session
	rehome []time.Duration
}

type simObserver struct {
	agent.NopObserver
	s    *simNodes
	node string
}

func (o simObserver) Connected(e agent.ConnectedEvent) {
	o.s.mu.Lock()
	defer o.s.mu.Unlock()
	o.s.at[o.node] = e.Gateway
	if !e.First {
		o.s.rehome = append(o.s.rehome, e.Outage)
	}
}

func (o simObserver) Disconnected(agent.DisconnectedEvent) {
	o.s.mu.Lock()
	defer o.s.mu.Unlock()
	delete(o.s.at, o.node)
}

// startNodes starts count agents (4 A100s each, pool "default") with
// certificates from dev's CA.
func startNodes(t *testing.T, dev *devProcess, count int, gateways ...string) *simNodes {
	t.Helper()
	ca, err := fleet.LoadCA(filepath.Join(dev.fleetDir, "ca", "ca.crt"), filepath.Join(dev.fleetDir, "ca", "ca.key"))
	if err != nil {
		t.Fatal(err)
	}
	settings := &agent.Settings{
		Gateways:   gateways,
		TLS:        &tls.Config{RootCAs: ca.Pool(), ServerName: "localhost"},
		BackoffMin: 100 * time.Millisecond,
		BackoffMax: time.Second,
	}
	s := &simNodes{at: map[string]string{}}
	for i := range count {
		id := fmt.Sprintf("node-%04d", i)
		certPEM, keyPEM, err := ca.NodeCredentials(id, "default")
		if err != nil {
			t.Fatal(err)
		}
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		var gpus []*fleetpb.Gpu
		for g := range 4 {
			gpus = append(gpus, &fleetpb.Gpu{Index: uint32(g), Model: "A100", MemoryMib: 40960, Health: fleetpb.GpuHealth_GPU_HEALTH_OK})
		}
		a, err := agent.New(agent.Config{
			Settings: settings, NodeID: id, Pool: "default", GPUs: gpus,
			Certificate: &cert, Observer: simObserver{s: s, node: id},
		})
		if err != nil {
			t.Fatal(err)
		}
		s.agents = append(s.agents, a)
		a.Start()
	}
	t.Cleanup(func() { s.stop() })
	return s
}

func (s *simNodes) stop() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var wg sync.WaitGroup
	for _, a := range s.agents {
		wg.Go(func() { a.Stop(ctx) })
	}
	wg.Wait()
}

// on counts the nodes whose session is on gateway addr.
func (s *simNodes) on(addr string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for _, g := range s.at {
		if g == addr {
			n++
		}
	}
	return n
}

func testPool(t *testing.T, db string) *pgxpool.Pool {
	t.Helper()
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

func count(t *testing.T, pool *pgxpool.Pool, sql string, args ...any) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		t.Fatalf("%s: %v", sql, err)
	}
	return n
}

// A gateway holding 1,000 nodes is SIGKILLed: every node re-homes through
// the other gateway, and none is ever marked unreachable; nodes that do go
// silent are marked unreachable (so the detector is on).
func TestFleetGatewayKilled(t *testing.T) {
	db := testenv.Database(t)
	// Heartbeats every second, as in the other tests, but the grace of the
	// defaults' proportions to re-homing (60 s against a 15 s target): a
	// thousand TLS handshakes on a loaded CI machine take several seconds.
	const grace = 20 * time.Second
	dev := fleetDev(t, db, "MILLRACE_FLEET_SUSPECT_AFTER=8s", "MILLRACE_FLEET_UNREACHABLE_AFTER="+grace.String())
	pool := testPool(t, db)
	addrA, addrB := freePort(t), freePort(t)
	gwA := gateway(t, dev, "gw-a", addrA)
	const n = 1000
	// B does not listen yet: every node ends up on A.
	nodes := startNodes(t, dev, n, addrA, addrB)
	waitUntil(t, "1000 sessions on gateway A", func() bool { return nodes.on(addrA) == n })
	waitUntil(t, "1000 healthy nodes connected through A", func() bool {
		return count(t, pool, "select count(*) from fleet_nodes where state = 'healthy' and connected and gateway_id = 'gw-a'") == n
	})

	// Watch for any node ever marked unreachable from here on.
	unreachable := watchUnreachable(pool)

	gateway(t, dev, "gw-b", addrB)
	killed := time.Now()
	gwA.kill()
	waitUntil(t, "1000 sessions re-homed to B", func() bool { return nodes.on(addrB) == n })
	rehomed := time.Since(killed)
	waitUntil(t, "1000 nodes connected through B in the projection", func() bool {
		return count(t, pool, "select count(*) from fleet_nodes where connected and gateway_id = 'gw-b'") == n
	})
	// Let the projection's own clock pass the unreachable threshold since
	// the kill, so that a false mark would have had time to happen.
	waitUntil(t, "the liveness clock past the grace since the kill", func() bool {
		var clock time.Time
		pool.QueryRow(context.Background(), "select liveness_time from fleet_clock").Scan(&clock)
		return clock.After(killed.Add(grace + 2*time.Second))
	})
	worst := unreachable()
	nodes.mu.Lock()
	times := slices.Clone(nodes.rehome)
	nodes.mu.Unlock()
	slices.Sort(times)
	if len(times) < n {
		t.Fatalf("%d re-homes observed, want %d", len(times), n)
	}
	t.Logf("all %d nodes re-homed within %s of the kill; re-home p50 %s p99 %s max %s",
		n, rehomed.Round(time.Millisecond), times[len(times)/2], times[len(times)*99/100], times[len(times)-1])
	// A re-home slower than the grace (less the heartbeat and flush
	// intervals a last-seen time may lag) would make marks legitimate:
	// say so rather than blame the liveness projection.
	if slowest := times[len(times)-1]; slowest > grace-2*time.Second {
		t.Fatalf("the slowest node took %s to re-home, too close to the %s grace for this test to tell", slowest, grace)
	}
	if worst > 0 {
		t.Fatalf("%d nodes were marked unreachable although every node re-homed within %s", worst, times[len(times)-1])
	}
	if u := count(t, pool, "select count(*) from fleet_nodes where state <> 'healthy'"); u != 0 {
		t.Fatalf("%d nodes are not healthy after the re-home", u)
	}

	// The control: nodes that really go silent are found.
	for _, a := range nodes.agents[:10] {
		a.Suspend()
	}
	waitUntil(t, "10 silent nodes marked unreachable", func() bool {
		return count(t, pool, "select count(*) from fleet_nodes where state = 'unreachable'") == 10
	})
	if h := count(t, pool, "select count(*) from fleet_nodes where state = 'healthy'"); h != n-10 {
		t.Fatalf("%d healthy nodes, want %d", h, n-10)
	}
}

// reservationsClient calls dev's reservations API with dev's API key.
func reservationsClient(t *testing.T, dev *devProcess) (fleetpb.ReservationsClient, context.Context) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dev.fleetDir, "api-keys"))
	if err != nil {
		t.Fatal(err)
	}
	_, key, _ := strings.Cut(strings.TrimSpace(string(b)), "=")
	conn, err := grpc.NewClient(dev.resvAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+key)
	return fleetpb.NewReservationsClient(conn), ctx
}

func fleetDigest(t *testing.T, pool *pgxpool.Pool) map[string]string {
	t.Helper()
	ctx := context.Background()
	out := map[string]string{}
	d1, err := fleetproj.Digest(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	d2, err := placer.Digest(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	for k, v := range d1 {
		out["fleet."+k] = v
	}
	for k, v := range d2 {
		out["placer."+k] = v
	}
	return out
}

// Reservations through the API are placed, bound by their nodes and become
// active; a cancelled one frees its GPUs; one on a node that goes silent is
// placed again elsewhere; no GPU is ever booked twice; and `millrace replay
// fleet` rebuilds exactly the rows of the live run.
func TestFleetReservationsAndReplay(t *testing.T) {
	db := testenv.Database(t)
	dev := fleetDev(t, db)
	pool := testPool(t, db)
	nodes := startNodes(t, dev, 12, dev.fleetAddr)
	waitUntil(t, "12 healthy nodes", func() bool {
		return count(t, pool, "select count(*) from fleet_nodes where state = 'healthy' and connected") == 12
	})
	api, ctx := reservationsClient(t, dev)

	var ids []string
	for i := range 10 {
		r, err := api.Create(ctx, &fleetpb.CreateReservationRequest{
			Spec:      &fleetpb.ReservationSpec{Pool: "default", Gpus: 2, Model: "A100"},
			RequestId: fmt.Sprintf("req-%d", i),
			Wait:      durationpb.New(20 * time.Second),
		})
		if err != nil {
			t.Fatalf("create %d: %v", i, err)
		}
		if r.State != fleetpb.ReservationState_RESERVATION_STATE_PLACED && r.State != fleetpb.ReservationState_RESERVATION_STATE_ACTIVE {
			t.Fatalf("create %d waited and came back %v (%s)", i, r.State, r.Reason)
		}
		ids = append(ids, r.Id)
	}
	whole, err := api.Create(ctx, &fleetpb.CreateReservationRequest{Spec: &fleetpb.ReservationSpec{Pool: "default", Nodes: 1}, Wait: durationpb.New(20 * time.Second)})
	if err != nil {
		t.Fatal(err)
	}
	ids = append(ids, whole.Id)
	get := func(id string) *fleetpb.Reservation {
		r, err := api.Get(ctx, &fleetpb.GetReservationRequest{Id: id})
		if err != nil {
			t.Fatalf("get %s: %v", id, err)
		}
		return r
	}
	for _, id := range ids {
		waitUntil(t, "reservation "+id+" active", func() bool { return get(id).State == fleetpb.ReservationState_RESERVATION_STATE_ACTIVE })
	}
	if r := get(whole.Id); len(r.Allocations) != 1 || !r.Allocations[0].WholeNode || len(r.Allocations[0].GpuIndices) != 4 {
		t.Fatalf("whole-node reservation holds %v", r.Allocations)
	}

	// Cancel three: they end and their GPUs are free.
	for _, id := range ids[:3] {
		if _, err := api.Cancel(ctx, &fleetpb.CancelReservationRequest{Id: id}); err != nil {
			t.Fatal(err)
		}
		waitUntil(t, "reservation "+id+" cancelled", func() bool { return get(id).State == fleetpb.ReservationState_RESERVATION_STATE_CANCELLED })
	}
	waitUntil(t, "cancelled reservations hold no GPU", func() bool {
		return count(t, pool, "select count(*) from fleet_bookings where reservation_id = any($1)", ids[:3]) == 0
	})

	// The node under one reservation goes silent: the reservation is placed
	// again on another node and becomes active there.
	moved := ids[5]
	first := get(moved).Allocations[0].NodeId
	for _, a := range nodes.agents {
		if a.NodeID() == first {
			a.Suspend()
		}
	}
	waitUntil(t, "reservation "+moved+" active on another node", func() bool {
		r := get(moved)
		return r.State == fleetpb.ReservationState_RESERVATION_STATE_ACTIVE && len(r.Allocations) == 1 && r.Allocations[0].NodeId != first
	})
	if n := count(t, pool, `select count(*) from (select a.node_id, g from fleet_allocations a, unnest(a.gpu_indices) g
		where a.released_at is null group by 1, 2 having count(*) > 1) d`); n != 0 {
		t.Fatalf("%d GPUs booked twice", n)
	}

	// Quiesce: nodes leave cleanly, the projection's clock stops, and the
	// live sweep reaches its last horizon; then replay must agree.
	nodes.stop()
	waitUntil(t, "every node disconnected in the projection", func() bool {
		return count(t, pool, "select count(*) from fleet_nodes where connected") == 0
	})
	waitUntil(t, "the live sweep past the clock's last horizon", func() bool {
		var clock time.Time
		pool.QueryRow(context.Background(), "select liveness_time from fleet_clock").Scan(&clock)
		return time.Since(clock) > 2*time.Second+7*time.Second // slack + the idle sweep period + margin
	})
	dev.stop()
	live := fleetDigest(t, pool)

	cmd := exec.Command(binary(t), "replay", "fleet")
	cmd.Env = append(slices.Clone(dev.env), "MILLRACE_LOG_LEVEL=info")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("replay fleet: %v\n%s", err, out)
	}
	replayed := fleetDigest(t, pool)
	if len(live) == 0 {
		t.Fatal("no tables digested")
	}
	for k, v := range live {
		if replayed[k] != v {
			t.Errorf("table %s differs after replay", k)
		}
	}
}
