package fleet

import (
	"testing"

	"github.com/millrace/millrace/internal/poll"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// TestHelloReconciled: a node reconnecting is reconciled with the
// decisions: an allocation its Hello lists that was released is unbound
// before anything is bound; one placed on it that it lacks (pending, or
// bound and then lost) is bound; one it holds and that is live is left.
func TestHelloReconciled(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	c, _ := gw.connect(t, "n1", "p")
	b.publishDecision(t, placed("d1", "p", "r1", alloc("gone", "n1", 0)))
	b.publishDecision(t, placed("d2", "p", "r2", alloc("lost", "n1", 1)))
	b.publishDecision(t, placed("d3", "p", "r3", alloc("kept", "n1", 2)))
	for range 3 {
		c.send(allocMsg(c.nextCommand().GetAllocationId(), fleetpb.AllocationState_ALLOCATION_STATE_BOUND))
	}
	b.waitEvents(t, "three BOUND", 3, is(kindAllocation))
	if err := c.st.CloseSend(); err != nil {
		t.Fatal(err)
	}
	// Released while the node was away: the Unbind had no session to go to.
	poll.Until(t, "the session gone", func() bool {
		gw.srv.mu.Lock()
		defer gw.srv.mu.Unlock()
		return gw.srv.sessions[nodeKey{pool: "p", node: "n1"}] == nil
	})
	b.publishDecision(t, released("d4", "p", "r1", "cancelled", "gone"))
	b.publishDecision(t, placed("d5", "p", "r5", alloc("new", "n1", 0)))
	poll.Until(t, "the release read", func() bool {
		gw.srv.mu.Lock()
		defer gw.srv.mu.Unlock()
		_, ok := gw.srv.binds.released["gone"]
		return ok && gw.srv.binds.pendingNode["new"] == (nodeKey{pool: "p", node: "n1"})
	})

	hello := testHello("n1", "p")
	hello.Allocations = []string{"gone", "kept"}
	c = openSession(t, gw.nodeConn(t, nil, "n1", "p"), helloMsg(hello))
	c.welcome()
	first := c.nextCommand()
	if first.GetAllocationId() != "gone" || first.GetUnbind() == nil {
		t.Fatalf("first command %v, want the Unbind of the released allocation it holds", first)
	}
	var binds []string
	for range 2 {
		cmd := c.nextCommand()
		if cmd.GetBind() == nil {
			t.Fatalf("command %v, want a Bind", cmd)
		}
		binds = append(binds, cmd.GetAllocationId())
	}
	if binds[0] != "lost" || binds[1] != "new" {
		t.Errorf("binds %v, want [lost new] (kept is held; gone is released)", binds)
	}
	if extra := c.sync(); len(extra) != 0 {
		t.Fatalf("more messages: %v", extra)
	}
	if n := counter(t, gw.reg, "millrace_fleet_reconciled_total", "unbind"); n != 1 {
		t.Errorf("%v reconciled unbinds, want 1", n)
	}
}

// TestUnbindAgainReachesTheNode: an UnbindAgain decision is sent to the
// node named in it whether or not the node claims the allocation.
func TestUnbindAgainReachesTheNode(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{})
	c, _ := gw.connect(t, "n1", "p")
	b.publishDecision(t, &fleetpb.PlacementDecision{
		DecisionId: "r1/unbind-again/1", ReservationId: "r1", Pool: "p", At: placed("x", "p", "r1").GetAt(),
		Body: &fleetpb.PlacementDecision_UnbindAgain{UnbindAgain: &fleetpb.UnbindAgain{
			Allocations: []*fleetpb.Allocation{{Id: "a1", NodeId: "n1"}}, Reason: "unconfirmed",
		}},
	})
	if cmd := c.nextCommand(); cmd.GetAllocationId() != "a1" || cmd.GetUnbind() == nil {
		t.Fatalf("command %v, want the Unbind of a1", cmd)
	}
}

// TestBindsWaitForTheHead: a gateway that starts reads the window's
// decisions in order, Placed before its Released. A node that connects
// meanwhile is not sent the bind of an allocation whose release is still
// to be read (its GPUs may have been freed and booked again): binds wait
// until the reader has reached the stream's head as of the start.
func TestBindsWaitForTheHead(t *testing.T) {
	b := newBackbone(t)
	b.publishDecision(t, placed("d1", "p", "r1", alloc("gone", "n1", 0)))
	b.publishDecision(t, released("d2", "p", "r1", "cancelled", "gone"))
	b.publishDecision(t, placed("d3", "p", "r3", alloc("live", "n1", 0)))

	atRelease, resume := make(chan struct{}), make(chan struct{})
	hook := func(s *Server) {
		s.decisionHook = func(d *fleetpb.PlacementDecision) {
			if d.GetReleased() != nil {
				close(atRelease)
				<-resume
			}
		}
	}
	gw := startGateway(t, b, Config{}, hook)
	<-atRelease // "gone" is read as placed on n1, its release not yet
	c := openSession(t, gw.nodeConn(t, nil, "n1", "p"), helloMsg(testHello("n1", "p")))
	c.welcome()
	poll.Until(t, "the session established", func() bool {
		gw.srv.mu.Lock()
		defer gw.srv.mu.Unlock()
		sess := gw.srv.sessions[nodeKey{pool: "p", node: "n1"}]
		return sess != nil && sess.established
	})
	close(resume)
	// The Unbind of gone may come (it was pending for n1 when its release
	// was read: the node answers UNBOUND); its Bind must not.
	for {
		cmd := c.nextCommand()
		if cmd.GetBind() != nil {
			if cmd.GetAllocationId() != "live" {
				t.Fatalf("bind %v, want only the Bind of live (gone was released before the node connected)", cmd)
			}
			break
		}
	}
	if extra := c.sync(); len(extra) != 0 {
		t.Fatalf("more messages: %v", extra)
	}
}
