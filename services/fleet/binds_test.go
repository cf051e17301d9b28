package fleet

import (
	"slices"
	"testing"
	"time"

	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/subjects"
)

func placed(id, pool, reservation string, allocs ...*fleetpb.Allocation) *fleetpb.PlacementDecision {
	return &fleetpb.PlacementDecision{
		DecisionId:    id,
		ReservationId: reservation,
		Pool:          pool,
		At:            timestamppb.Now(),
		Body:          &fleetpb.PlacementDecision_Placed{Placed: &fleetpb.Placed{Allocations: allocs}},
	}
}

func released(id, pool, reservation, reason string, allocs ...string) *fleetpb.PlacementDecision {
	return &fleetpb.PlacementDecision{
		DecisionId:    id,
		ReservationId: reservation,
		Pool:          pool,
		At:            timestamppb.Now(),
		Body:          &fleetpb.PlacementDecision_Released{Released: &fleetpb.Released{AllocationIds: allocs, Reason: reason}},
	}
}

func alloc(id, node string, gpus ...uint32) *fleetpb.Allocation {
	return &fleetpb.Allocation{Id: id, NodeId: node, GpuIndices: gpus, State: fleetpb.AllocationState_ALLOCATION_STATE_PENDING}
}

// nextCommand waits for the next Command, skipping acks.
func (c *client) nextCommand() *fleetpb.Command {
	c.t.Helper()
	for {
		m := c.next()
		if cmd := m.GetCommand(); cmd != nil {
			return cmd
		}
		if m.GetAck() == nil {
			c.t.Fatalf("expected a Command, got %v", m)
		}
	}
}

// A decision published to FLEET_PLACE reaches the connected node as a Bind;
// its BOUND report is stored (once, however often it is sent); a Released
// decision unbinds it.
func TestBindDelivery(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	c, w := gw.connect(t, "n1", "p")

	b.publishDecision(t, placed("d1", "p", "r1", alloc("a1", "n1", 0, 1), alloc("a2", "elsewhere", 3)))
	cmd := c.nextCommand()
	if cmd.GetAllocationId() != "a1" || cmd.GetReservationId() != "r1" || !slices.Equal(cmd.GetBind().GetGpuIndices(), []uint32{0, 1}) {
		t.Fatalf("command %v", cmd)
	}
	c.send(allocMsg("a1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND))
	c.send(allocMsg("a1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND)) // a repeated report
	got := b.waitEvents(t, "allocation event", 1, is(kindAllocation))
	m := got[0].msg
	if want := "p/n1/alloc/a1/ALLOCATION_STATE_BOUND"; m.Header.Get(envelope.MsgID) != want {
		t.Errorf("msg id %q, want %q", m.Header.Get(envelope.MsgID), want)
	}
	if m.Subject != subjects.FleetNode("p", "n1") || got[0].ev.GetSessionId() != w.GetSessionId() ||
		got[0].ev.GetAllocation().GetState() != fleetpb.AllocationState_ALLOCATION_STATE_BOUND {
		t.Errorf("allocation event %v", got[0].ev)
	}

	b.publishDecision(t, released("d2", "p", "r1", "cancelled", "a1"))
	cmd = c.nextCommand()
	if cmd.GetAllocationId() != "a1" || cmd.GetUnbind().GetReason() != "cancelled" {
		t.Fatalf("command %v", cmd)
	}
	c.send(allocMsg("a1", fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND))
	got = b.waitEvents(t, "two allocation events", 2, is(kindAllocation))
	if len(got) != 2 || got[1].ev.GetAllocation().GetState() != fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND {
		t.Fatalf("%d allocation events (the repeated BOUND must be stored once)", len(got))
	}
	if n := counter(t, gw.reg, "millrace_fleet_commands_sent_total", "bind"); n != 1 {
		t.Errorf("%v binds counted, want 1", n)
	}
	if n := counter(t, gw.reg, "millrace_fleet_commands_sent_total", "unbind"); n != 1 {
		t.Errorf("%v unbinds counted, want 1", n)
	}
}

// A node that connects after a decision gets its pending binds after
// Welcome, except those its Hello says it holds.
func TestPendingBindSentOnConnect(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	b.publishDecision(t, placed("d1", "p", "r1", alloc("a1", "n1", 0), alloc("a2", "n1", 1), alloc("a3", "n2", 0)))
	poll.Until(t, "pending binds", func() bool {
		gw.srv.mu.Lock()
		defer gw.srv.mu.Unlock()
		return gw.srv.binds.count == 3
	})
	hello := testHello("n1", "p")
	hello.Allocations = []string{"a1"}
	c := openSession(t, gw.nodeConn(t, nil, "n1", "p"), helloMsg(hello))
	c.welcome()
	cmd := c.nextCommand()
	if cmd.GetAllocationId() != "a2" || cmd.GetBind() == nil {
		t.Fatalf("command %v, want the bind of a2", cmd)
	}
	if extra := c.sync(); len(extra) != 0 {
		t.Fatalf("more messages: %v (a1 is held already)", extra)
	}
}

// A gateway that starts after a decision still knows it (it reads
// BindWindow back), and an expired decision is not delivered.
func TestDecisionsBeforeStart(t *testing.T) {
	b := newBackbone(t)
	b.publishDecision(t, placed("d1", "p", "r1", alloc("a1", "n1", 0)))
	gw := startGateway(t, b, Config{BindWindow: time.Minute})
	c, _ := gw.connect(t, "n1", "p")
	if cmd := c.nextCommand(); cmd.GetAllocationId() != "a1" {
		t.Fatalf("command %v", cmd)
	}

	// Old decisions are kept for the window only.
	s := gw.srv
	s.applyDecision(placed("d0", "p", "r0", alloc("old", "n9", 0)), time.Now().Add(-2*time.Minute))
	s.mu.Lock()
	_, kept := s.binds.pendingNode["old"]
	s.mu.Unlock()
	if kept {
		t.Fatal("a decision older than the bind window was kept")
	}
	s.expireBinds(time.Now().Add(2 * time.Minute))
	s.mu.Lock()
	n := s.binds.count
	s.mu.Unlock()
	if n != 0 {
		t.Fatalf("%d pending binds after the window", n)
	}
}
