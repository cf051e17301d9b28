package fleet

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The test files may use the projectors: the dependency rule (services do
// not import projectors) is about what the package itself imports.

// TestNodeIdentityThroughProjection: from Join to the projected rows, a
// node is (pool, node id). A node that joined with pool sandbox's token
// holds a sandbox certificate; its Hello cannot claim pool prod; as
// sandbox/n1 it gets a row, devices, liveness and reports of its own, and
// nothing it sends (inventory, status, heartbeats, a report on prod/n1's
// allocation) changes prod/n1's.
func TestNodeIdentityThroughProjection(t *testing.T) {
	ctx := context.Background()
	b := newBackbone(t)
	tokens, err := ParseJoinTokens("prod=tok-prod-0123456789ab, sandbox=tok-sandbox-0123456789")
	if err != nil {
		t.Fatal(err)
	}
	gw := startGateway(t, b, Config{JoinTokens: tokens})
	db, _ := testenv.Pool(t)

	// The liveness projector follows FLEET_NODES into db.
	proj, err := fleetproj.New(fleetproj.Config{})
	if err != nil {
		t.Fatal(err)
	}
	runCtx, cancel := context.WithCancel(ctx)
	runner, err := streams.NewRunner(b.js, db, proj, streams.RunnerConfig{
		Stream: subjects.StreamFleetNodes, Filter: subjects.FleetNodeFilter, Batch: 100,
		MaxWait: 20 * time.Millisecond, SweepEvery: time.Hour,
	}, streams.NewMetrics(nil))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); runner.Run(runCtx) }()
	t.Cleanup(func() { cancel(); wg.Wait() })

	// prod/n1 has a certificate of pool prod.
	prod, _ := gw.connect(t, "n1", "prod")

	// n1 of sandbox joins with sandbox's token: its certificate says
	// sandbox, whatever it asks for.
	noCert, err := NodeTLS(testCA().CertPEM(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	csr, key, err := NewNodeCSR("n1")
	if err != nil {
		t.Fatal(err)
	}
	res, err := fleetpb.NewGatewayClient(gw.dial(t, noCert)).Join(ctx, &fleetpb.JoinRequest{Token: "tok-sandbox-0123456789", NodeId: "n1", Csr: csr})
	if err != nil || res.GetPool() != "sandbox" {
		t.Fatalf("join: pool %q, %v", res.GetPool(), err)
	}
	tc, err := NodeTLS(res.GetCa(), res.GetCertificate(), key)
	if err != nil {
		t.Fatal(err)
	}
	// Its Hello cannot claim to be prod/n1.
	c := openSession(t, gw.dial(t, tc), helloMsg(testHello("n1", "prod")))
	r, err := c.refused()
	checkRefusal(t, r, err, CodeUnauthenticated, codes.PermissionDenied)
	// As sandbox/n1, with other hardware, it is welcome.
	h := testHello("n1", "sandbox")
	h.Labels = map[string]string{"tier": "sandbox"}
	h.Gpus = []*fleetpb.Gpu{{Index: 0, Model: "T4", MemoryMib: 16384, Health: fleetpb.GpuHealth_GPU_HEALTH_OK, Uuid: "GPU-T4"}}
	sandbox := openSession(t, gw.dial(t, tc), helloMsg(h))
	sandbox.welcome()

	// An allocation placed on prod/n1, which binds it.
	b.publishDecision(t, placed("d1", "prod", "r1", alloc("a1", "n1", 0, 1)))
	if cmd := prod.nextCommand(); cmd.GetAllocationId() != "a1" {
		t.Fatalf("prod/n1 got %v", cmd)
	}
	prod.send(allocReport("a1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND))
	prod.sync()
	gw.srv.flushLiveness(ctx) // prod/n1's own heartbeats, before sandbox/n1 speaks
	waitRows(t, db, "prod/n1 bound a1", `select count(*) from fleet_allocation_reports
		where allocation_id = 'a1' and pool = 'prod' and node_id = 'n1' and state = 'bound'`, 1)
	waitProjected(t, b, db)
	prodBefore := projected(t, db, "prod")

	// sandbox/n1 reports its GPUs failed, heartbeats, and tries to unbind
	// prod's allocation (refused at the gateway, which knows the placement).
	sandbox.send(&fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Status{Status: &fleetpb.StatusReport{Seq: 1,
		Gpus: []*fleetpb.GpuState{{Index: 0, Health: fleetpb.GpuHealth_GPU_HEALTH_FAILED}, {Index: 1, Health: fleetpb.GpuHealth_GPU_HEALTH_FAILED}}}}})
	sandbox.expectAck(1)
	sandbox.heartbeat()
	sandbox.expectAck(sandbox.seq)
	gw.srv.flushLiveness(ctx)
	sandbox.send(allocReport("a1", fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND))
	r, err = sandbox.refused()
	checkRefusal(t, r, err, CodeForeignAllocation, codes.PermissionDenied)
	// Everything sandbox/n1's session published, through its disconnect,
	// is projected.
	waitRows(t, db, "sandbox/n1's session projected", `select count(*) from fleet_nodes
		where pool = 'sandbox' and node_id = 'n1' and not connected`, 1)
	waitProjected(t, b, db)

	if got := projected(t, db, "prod"); got != prodBefore {
		t.Fatalf("sandbox/n1 changed prod/n1:\nbefore %s\nafter  %s", prodBefore, got)
	}
	if got, want := projected(t, db, "sandbox"), "n1 tier=sandbox connected=false devices=[0:T4:failed] reports=[]"; got != want {
		t.Fatalf("sandbox/n1 projected as %s, want %s", got, want)
	}
}

// waitProjected waits until the projector has applied everything stored
// in FLEET_NODES.
func waitProjected(t testing.TB, b *backbone, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}) {
	t.Helper()
	st, err := b.js.Stream(context.Background(), subjects.StreamFleetNodes)
	if err != nil {
		t.Fatal(err)
	}
	info, err := st.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	waitRows(t, db, "the projection to catch up", fmt.Sprintf(
		"select count(*) from consumer_positions where consumer = '%s' and stream_seq >= %d", fleetproj.ConsumerName, info.State.LastSeq), 1)
}

// waitRows polls until the count query returns n.
func waitRows(t testing.TB, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, what, sql string, n int) {
	t.Helper()
	poll.Until(t, what, func() bool {
		var got int
		return db.QueryRow(context.Background(), sql).Scan(&got) == nil && got == n
	})
}

// projected renders the projection of a pool's node n1: labels, liveness
// and session, devices and the reports it sent.
func projected(t testing.TB, db interface {
	QueryRow(context.Context, string, ...any) pgx.Row
}, pool string) string {
	t.Helper()
	var (
		tier      string
		connected bool
		lastSeen  time.Time
		devices   []string
		reports   []string
	)
	err := db.QueryRow(context.Background(), `select coalesce(n.labels->>'tier', ''), n.connected, n.last_seen,
		coalesce((select array_agg(d.gpu_index || ':' || d.model || ':' || d.health order by d.gpu_index)
			from fleet_devices d where d.pool = n.pool and d.node_id = n.node_id), '{}'),
		coalesce((select array_agg(r.allocation_id || ':' || r.state order by r.allocation_id)
			from fleet_allocation_reports r where r.pool = n.pool and r.node_id = n.node_id), '{}')
		from fleet_nodes n where n.pool = $1 and n.node_id = 'n1'`, pool).Scan(&tier, &connected, &lastSeen, &devices, &reports)
	if err != nil {
		t.Fatalf("projection of %s/n1: %v", pool, err)
	}
	s := fmt.Sprintf("n1 tier=%s connected=%t devices=%v reports=%v", tier, connected, devices, reports)
	if pool == "prod" {
		s += " last_seen=" + lastSeen.String()
	}
	return s
}
