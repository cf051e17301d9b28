package placer

import (
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

func fleetHeaders(kind string) map[string]string {
	return map[string]string{envelope.Schema: envelope.SchemaFleetV1, envelope.Kind: kind}
}

func FuzzDecodeReservation(f *testing.F) {
	for _, ev := range []*fleetpb.ReservationEvent{
		{ReservationId: "r1", Owner: "o", At: timestamppb.Now(), Body: &fleetpb.ReservationEvent_Requested{Requested: &fleetpb.ReservationRequested{
			Spec: &fleetpb.ReservationSpec{Pool: "p", Gpus: 4, Model: "H100", Labels: map[string]string{"zone": "a"}, MinGpuMemoryMib: 80000}, RequestId: "q"}}},
		{ReservationId: "r1", Body: &fleetpb.ReservationEvent_Requested{Requested: &fleetpb.ReservationRequested{Spec: &fleetpb.ReservationSpec{Nodes: 2}}}},
		{ReservationId: "r1", Body: &fleetpb.ReservationEvent_Cancelled{Cancelled: &fleetpb.ReservationCancelled{}}},
	} {
		b, _ := proto.Marshal(ev)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		m := &msg{data: data, hdr: fleetHeaders(envelope.KindReservation), seq: 1, at: time.Unix(1e9, 0)}
		evs, err := decodeBatch(asMessages([]*msg{m}))
		if err != nil {
			return
		}
		ev := evs[0]
		if ev.id == "" || ev.at.IsZero() {
			t.Fatalf("decoded %+v", ev)
		}
		if ev.requested {
			ev.spec.invalid()
			ev.spec.constraintKey()
			ev.spec.describe()
		}
	})
}

func FuzzDecodeDecision(f *testing.F) {
	at := timestamppb.Now()
	for _, d := range []*fleetpb.PlacementDecision{
		{DecisionId: "r/place/1", ReservationId: "r", Pool: "p", At: at, Body: &fleetpb.PlacementDecision_Placed{Placed: &fleetpb.Placed{
			Allocations: []*fleetpb.Allocation{{Id: "r/1/0", NodeId: "n", GpuIndices: []uint32{0, 1}}}}}},
		{DecisionId: "r/release/1", ReservationId: "r", Pool: "p", At: at, Body: &fleetpb.PlacementDecision_Released{Released: &fleetpb.Released{
			AllocationIds: []string{"r/1/0"}, Reason: "cancelled"}}},
		{DecisionId: "r/fail", ReservationId: "r", Pool: "p", At: at, Body: &fleetpb.PlacementDecision_Failed{Failed: &fleetpb.Failed{Reason: "x"}}},
	} {
		b, _ := proto.Marshal(d)
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		m := &msg{data: data, hdr: fleetHeaders(envelope.KindDecision), seq: 1}
		d, err := decodeDecision(m)
		if err != nil {
			return
		}
		if kindOf(d) == kindNone || d.GetDecisionId() == "" {
			t.Fatalf("accepted %v", d)
		}
	})
}
