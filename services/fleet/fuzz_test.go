package fleet

import (
	"testing"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// FuzzNodeMessage feeds arbitrary bytes through what the gateway does with
// a node's message: decode, check, hash. Nothing may panic, and whatever
// passes the checks must be within the limits.
func FuzzNodeMessage(f *testing.F) {
	for _, m := range []*fleetpb.NodeMessage{
		helloMsg(testHello("node-1", "pool-a")),
		helloMsg(&fleetpb.Hello{NodeId: "n", Pool: "p", Allocations: []string{"a1", "a2"}}),
		statusMsg(7, fleetpb.GpuHealth_GPU_HEALTH_DEGRADED, 0.3),
		allocMsg("a1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND),
		{Body: &fleetpb.NodeMessage_Heartbeat{Heartbeat: &fleetpb.Heartbeat{Seq: 3}}},
	} {
		b, err := proto.Marshal(m)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		m := &fleetpb.NodeMessage{}
		if proto.Unmarshal(data, m) != nil {
			return
		}
		switch b := m.GetBody().(type) {
		case *fleetpb.NodeMessage_Hello:
			h := b.Hello
			if checkHello(h) != nil {
				return
			}
			if CheckID("", h.GetNodeId()) != nil || CheckID("", h.GetPool()) != nil ||
				len(h.GetNodeId()) > MaxIDBytes || !utf8.ValidString(h.GetPool()) {
				t.Fatalf("accepted bad ids %q %q", h.GetNodeId(), h.GetPool())
			}
			if len(h.GetGpus()) > MaxGPUs || len(h.GetLabels()) > MaxLabels || len(h.GetAllocations()) > MaxAllocs {
				t.Fatalf("accepted %d gpus, %d labels, %d allocations", len(h.GetGpus()), len(h.GetLabels()), len(h.GetAllocations()))
			}
			idx := map[uint32]bool{}
			for _, g := range h.GetGpus() {
				if idx[g.GetIndex()] || len(g.GetModel()) > MaxModelLen {
					t.Fatalf("accepted gpu %v", g)
				}
				idx[g.GetIndex()] = true
			}
			// What is accepted can be published.
			if _, err := proto.Marshal(&fleetpb.NodeConnected{Labels: h.GetLabels(), Gpus: h.GetGpus(), Allocations: h.GetAllocations()}); err != nil {
				t.Fatal(err)
			}
		case *fleetpb.NodeMessage_Status:
			if checkStatus(b.Status) != nil {
				return
			}
			h := StatusHash(b.Status)
			again := proto.Clone(b.Status).(*fleetpb.StatusReport)
			again.Gauges = nil
			again.Seq++
			if len(h) != 64 || StatusHash(again) != h {
				t.Fatalf("status hash %q depends on seq or gauges", h)
			}
		case *fleetpb.NodeMessage_Allocation:
			if checkAllocation(b.Allocation) == nil && CheckID("", b.Allocation.GetAllocationId()) != nil {
				t.Fatal("accepted a bad allocation id")
			}
		}
	})
}
