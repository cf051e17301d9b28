package fleet

import (
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/internal/poll"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams"
)

func allocReport(id string, state fleetpb.AllocationState) *fleetpb.NodeMessage {
	return &fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Allocation{Allocation: &fleetpb.AllocationReport{AllocationId: id, State: state}}}
}

func statusReport(seq uint64, reason string) *fleetpb.NodeMessage {
	return &fleetpb.NodeMessage{Body: &fleetpb.NodeMessage_Status{Status: &fleetpb.StatusReport{Seq: seq,
		Conditions: []*fleetpb.Condition{{Type: "Ready", Status: true, Reason: reason}}}}}
}

// allocationEvents lists the stored allocation reports as
// "<pool>/<node> <allocation> <state>".
func allocationEvents(t testing.TB, b *backbone) []string {
	var out []string
	for _, e := range b.nodeEvents(t) {
		if a := e.ev.GetAllocation(); a != nil {
			out = append(out, fmt.Sprintf("%s/%s %s %s", e.ev.GetPool(), e.ev.GetNodeId(), a.GetAllocationId(), a.GetState()))
		}
	}
	return out
}

// TestForeignAllocationReports: a node can bind, unbind or fail only an
// allocation placed on it. A sibling of its pool, or a node of the same id
// in another pool, is refused "foreign_allocation", nothing of its report
// is published, and a sibling claiming the allocation in its Hello does not
// take the Unbind from the node that holds it.
func TestForeignAllocationReports(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	owner, _ := gw.connect(t, "n1", "prod")
	b.publishDecision(t, placed("d1", "prod", "r1", alloc("a1", "n1", 0)))
	if cmd := owner.nextCommand(); cmd.GetAllocationId() != "a1" || cmd.GetBind() == nil {
		t.Fatalf("owner got %v", cmd)
	}

	for _, try := range []struct {
		node, pool string
		state      fleetpb.AllocationState
	}{
		{"n2", "prod", fleetpb.AllocationState_ALLOCATION_STATE_BOUND},
		{"n3", "prod", fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND},
		{"n1", "sandbox", fleetpb.AllocationState_ALLOCATION_STATE_FAILED},
	} {
		c, _ := gw.connect(t, try.node, try.pool)
		c.send(allocReport("a1", try.state))
		r, err := c.refused()
		checkRefusal(t, r, err, CodeForeignAllocation, codes.PermissionDenied)
	}
	owner.send(allocReport("a1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND))
	b.waitEvents(t, "the owner's BOUND", 1, is(kindAllocation))
	owner.sync()
	if got := allocationEvents(t, b); len(got) != 1 || got[0] != "prod/n1 a1 ALLOCATION_STATE_BOUND" {
		t.Fatalf("allocation events stored: %v; want only the owner's BOUND", got)
	}
	if n := counter(t, gw.reg, "millrace_fleet_reports_refused_total", "foreign"); n != 3 {
		t.Fatalf("foreign reports counted %v, want 3", n)
	}

	// A sibling that claims a1 in its Hello is not its holder: the Unbind
	// goes to the owner, and to nobody else.
	h := testHello("n4", "prod")
	h.Allocations = []string{"a1"}
	claimer := openSession(t, gw.nodeConn(t, nil, "n4", "prod"), helloMsg(h))
	claimer.welcome()
	b.publishDecision(t, released("d2", "prod", "r1", "cancelled", "a1"))
	if cmd := owner.nextCommand(); cmd.GetAllocationId() != "a1" || cmd.GetUnbind() == nil {
		t.Fatalf("owner got %v, want the Unbind of a1", cmd)
	}
	for _, m := range claimer.sync() {
		if m.GetCommand() != nil {
			t.Fatalf("the claimer got %v", m)
		}
	}
}

// TestReportRate: a session's reports go through a token bucket; past it
// the session is closed "report_rate" with a retry_after, and counted.
func TestReportRate(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{ReportRate: 1, ReportBurst: 5})
	c, _ := gw.connect(t, "n1", "p")
	for i := uint64(1); i <= 5; i++ {
		c.send(statusReport(i, fmt.Sprint(i)))
		c.expectAck(i)
	}
	c.send(statusReport(6, "6"))
	r, err := c.refused()
	checkRefusal(t, r, err, CodeReportRate, codes.ResourceExhausted)
	if n := counter(t, gw.reg, "millrace_fleet_reports_refused_total", "rate"); n != 1 {
		t.Fatalf("rate refusals counted %v, want 1", n)
	}
	// Another node's bucket is its own.
	o, _ := gw.connect(t, "n2", "p")
	o.send(statusReport(1, "x"))
	o.expectAck(1)
}

// TestHeldAllocationsBounded: a Hello may list, and a session may hold, at
// most MaxHeldAllocations allocations.
func TestHeldAllocationsBounded(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{MaxHeldAllocations: 2})
	h := testHello("n1", "p")
	h.Allocations = []string{"a1", "a2", "a3"}
	c := openSession(t, gw.nodeConn(t, nil, "n1", "p"), helloMsg(h))
	r, err := c.refused()
	checkRefusal(t, r, err, CodeInvalid, codes.InvalidArgument)

	c, _ = gw.connect(t, "n1", "p")
	c.send(allocReport("a1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND))
	c.send(allocReport("a2", fleetpb.AllocationState_ALLOCATION_STATE_BOUND))
	c.send(allocReport("a1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND)) // held already: no more
	c.send(allocReport("a3", fleetpb.AllocationState_ALLOCATION_STATE_BOUND))
	r, err = c.refused()
	checkRefusal(t, r, err, CodeAllocationsFull, codes.ResourceExhausted)
	for _, e := range allocationEvents(t, b) {
		if e == "p/n1 a3 ALLOCATION_STATE_BOUND" {
			t.Fatalf("the refused BOUND was published: %v", allocationEvents(t, b))
		}
	}
}

// slowPublisher stores one message per delay: a backbone that cannot keep
// up with what the gateway is sent.
type slowPublisher struct {
	Publisher
	delay time.Duration
}

func (p slowPublisher) PublishAsync(m *nats.Msg) (*streams.Future, error) {
	time.Sleep(p.delay)
	return p.Publisher.PublishAsync(m)
}

// TestNoisyNodeLeavesOthersFlowing: one node sends status reports as fast
// as it can to a gateway whose backbone stores a few hundred events a
// second. While it floods, other nodes still open sessions (their
// Connected events need room in the publish queue) and every status change
// they report is stored within a second. The bucket cuts the noisy node
// off ("rate"); with an unlimited bucket, its share of the queue holds it
// back ("share").
func TestNoisyNodeLeavesOthersFlowing(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  Config
	}{
		{"rate", Config{PublishQueue: 128}},
		{"share", Config{PublishQueue: 128, ReportRate: 1e9, ReportBurst: 1 << 30, SessionQueueShare: 32}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := newBackbone(t)
			gw := startGateway(t, b, tc.cfg, withPublisher(slowPublisher{b.pub, 2 * time.Millisecond}))
			noisy, _ := gw.connect(t, "noisy", "p")
			var sent atomic.Int64
			stop := make(chan struct{})
			var wg sync.WaitGroup
			wg.Add(2)
			go func() { // read and drop what the gateway answers
				defer wg.Done()
				for r := range noisy.in {
					if r.err != nil {
						return
					}
				}
			}()
			go func() {
				defer wg.Done()
				for i := uint64(1); ; i++ {
					select {
					case <-stop:
						return
					default:
					}
					if noisy.st.Send(statusReport(i, fmt.Sprint("flood ", i))) != nil {
						return // refused: the stream is over
					}
					sent.Add(1)
				}
			}()
			t.Cleanup(func() { close(stop); noisy.st.CloseSend(); wg.Wait() })
			// The flood is on once it has sent more than the queue holds.
			poll.Until(t, "the flood to start", func() bool { return sent.Load() > 300 })

			const quiet, each = 4, 5
			var clients []*client
			for i := range quiet {
				c := openSession(t, gw.nodeConn(t, nil, fmt.Sprint("quiet-", i), "p"), helloMsg(testHello(fmt.Sprint("quiet-", i), "p")))
				m := c.next()
				if m.GetWelcome() == nil {
					t.Fatalf("quiet-%d was not welcomed while one node floods: %v", i, m)
				}
				clients = append(clients, c)
			}
			// Each quiet status change is timed from its send to its
			// publish on the stream's subject (a plain subscription sees it
			// as JetStream stores it).
			arrived := make(chan string, quiet*each)
			sub, err := b.nc.Subscribe("fleet.node.>", func(m *nats.Msg) {
				ev := &fleetpb.NodeEvent{}
				if proto.Unmarshal(m.Data, ev) == nil && ev.GetNodeId() != "noisy" {
					if cs := ev.GetStatusChanged().GetConditions(); len(cs) == 1 {
						arrived <- cs[0].GetReason()
					}
				}
			})
			if err != nil {
				t.Fatal(err)
			}
			defer sub.Unsubscribe()
			if err := b.nc.Flush(); err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			for j := 1; j <= each; j++ {
				for i, c := range clients {
					c.send(statusReport(uint64(j), fmt.Sprintf("quiet-%d/%d", i, j)))
				}
			}
			var worst time.Duration
			seen := map[string]bool{}
			timeout := time.After(10 * time.Second)
			for len(seen) < quiet*each {
				select {
				case r := <-arrived:
					seen[r] = true
					worst = max(worst, time.Since(start))
				case <-timeout:
					t.Fatalf("after 10 s, %d of %d quiet status changes were stored while one node flooded", len(seen), quiet*each)
				}
			}
			if worst > time.Second {
				t.Errorf("the quiet nodes' status changes took %s to be stored, want under a second", worst)
			}
			t.Logf("%d status changes of %d quiet nodes stored within %s while one node flooded (%d reports sent)",
				quiet*each, quiet, worst, sent.Load())
		})
	}
}
