package placer

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams/projection"
)

// maxCount bounds gpus and nodes of a spec: more can never be placed and
// would not fit the int columns.
const maxCount = 1 << 20

// spec is a reservation's ReservationSpec, as stored in fleet_reservations.
type spec struct {
	gpus   int
	nodes  int
	model  string
	labels map[string]string
	minMem uint64
}

// invalid says why a spec can never be placed whatever the fleet, or "".
func (s *spec) invalid() string {
	switch {
	case s.gpus < 0 || s.nodes < 0 || s.gpus > maxCount || s.nodes > maxCount:
		return fmt.Sprintf("gpus %d and nodes %d out of range", s.gpus, s.nodes)
	case s.gpus == 0 && s.nodes == 0:
		return "neither gpus nor nodes set"
	case s.gpus > 0 && s.nodes > 0:
		return "both gpus and nodes set"
	case s.minMem > 1<<62:
		return fmt.Sprintf("min_gpu_memory_mib %d out of range", s.minMem)
	}
	return ""
}

// constraintKey identifies the constraints (not the amount) of a spec.
func (s *spec) constraintKey() string {
	var b strings.Builder
	b.WriteString(s.model)
	fmt.Fprintf(&b, "\x00%d", s.minMem)
	for _, k := range slices.Sorted(maps.Keys(s.labels)) {
		b.WriteString("\x00")
		b.WriteString(k)
		b.WriteString("=")
		b.WriteString(s.labels[k])
	}
	return b.String()
}

// describe renders the spec for reasons a person reads.
func (s *spec) describe() string {
	var parts []string
	if s.nodes > 0 {
		parts = append(parts, fmt.Sprintf("%d whole nodes", s.nodes))
	} else {
		parts = append(parts, fmt.Sprintf("%d GPUs on one node", s.gpus))
	}
	if s.model != "" {
		parts = append(parts, "model "+s.model)
	}
	if s.minMem > 0 {
		parts = append(parts, fmt.Sprintf("at least %d MiB each", s.minMem))
	}
	for _, k := range slices.Sorted(maps.Keys(s.labels)) {
		parts = append(parts, k+"="+s.labels[k])
	}
	return strings.Join(parts, ", ")
}

func specFrom(ps *fleetpb.ReservationSpec) spec {
	return spec{
		gpus:   int(ps.GetGpus()),
		nodes:  int(ps.GetNodes()),
		model:  ps.GetModel(),
		labels: ps.GetLabels(),
		minMem: ps.GetMinGpuMemoryMib(),
	}
}

// resvEvent is one decoded FLEET_RESV message.
type resvEvent struct {
	msg       projection.Message
	id        string
	pool      string
	owner     string
	at        time.Time
	requested bool // else cancelled
	spec      spec
	requestID string
}

var (
	errNoReservationID = errors.New("reservation event without reservation_id")
	errNoBody          = errors.New("reservation event is neither requested nor cancelled")
)

// decodeReservation decodes one FLEET_RESV message. Any error makes the
// message poison.
func decodeReservation(m projection.Message) (resvEvent, error) {
	ev := resvEvent{msg: m}
	if s := m.Header(envelope.Schema); s != envelope.SchemaFleetV1 {
		return ev, fmt.Errorf("unknown schema %q in header %s (want %q)", s, envelope.Schema, envelope.SchemaFleetV1)
	}
	if k := m.Header(envelope.Kind); k != envelope.KindReservation {
		return ev, fmt.Errorf("unknown kind %q in header %s (want %q)", k, envelope.Kind, envelope.KindReservation)
	}
	var pb fleetpb.ReservationEvent
	if err := proto.Unmarshal(m.Data(), &pb); err != nil {
		return ev, fmt.Errorf("decode ReservationEvent: %w", err)
	}
	ev.id = pb.GetReservationId()
	if ev.id == "" {
		return ev, errNoReservationID
	}
	if h := m.Header(envelope.Reservation); h != "" && h != ev.id {
		return ev, fmt.Errorf("header %s %q differs from the event's reservation id %q", envelope.Reservation, h, ev.id)
	}
	ev.owner = pb.GetOwner()
	ev.pool = m.Header(envelope.Pool)
	switch body := pb.GetBody().(type) {
	case *fleetpb.ReservationEvent_Requested:
		ev.requested = true
		ev.spec = specFrom(body.Requested.GetSpec())
		ev.requestID = body.Requested.GetRequestId()
		if p := body.Requested.GetSpec().GetPool(); p != "" {
			if ev.pool != "" && ev.pool != p {
				return ev, fmt.Errorf("header %s %q differs from the spec's pool %q", envelope.Pool, ev.pool, p)
			}
			ev.pool = p
		}
	case *fleetpb.ReservationEvent_Cancelled:
	default:
		return ev, errNoBody
	}
	// The stream's storage time, as the builds projector does: a replay
	// reads the same times, and they are monotonic per stream.
	ev.at = m.Time()
	if ev.at.IsZero() && pb.GetAt() != nil {
		ev.at = pb.GetAt().AsTime()
	}
	if ev.at.IsZero() {
		ev.at = time.Unix(0, 0)
	}
	ev.at = ev.at.UTC().Truncate(time.Microsecond)
	return ev, nil
}

// decodeDecision decodes one FLEET_PLACE message.
func decodeDecision(m projection.Message) (*fleetpb.PlacementDecision, error) {
	if s := m.Header(envelope.Schema); s != envelope.SchemaFleetV1 {
		return nil, fmt.Errorf("unknown schema %q in header %s (want %q)", s, envelope.Schema, envelope.SchemaFleetV1)
	}
	if k := m.Header(envelope.Kind); k != envelope.KindDecision {
		return nil, fmt.Errorf("unknown kind %q in header %s (want %q)", k, envelope.Kind, envelope.KindDecision)
	}
	d := new(fleetpb.PlacementDecision)
	if err := proto.Unmarshal(m.Data(), d); err != nil {
		return nil, fmt.Errorf("decode PlacementDecision: %w", err)
	}
	if err := checkDecision(d); err != nil {
		return nil, err
	}
	return d, nil
}

// checkDecision rejects a decision that cannot be turned into rows.
func checkDecision(d *fleetpb.PlacementDecision) error {
	if d.GetDecisionId() == "" || d.GetReservationId() == "" {
		return errors.New("decision without decision_id or reservation_id")
	}
	if d.GetAt() == nil {
		return fmt.Errorf("decision %s has no time", d.GetDecisionId())
	}
	switch body := d.GetBody().(type) {
	case *fleetpb.PlacementDecision_Placed:
		if len(body.Placed.GetAllocations()) == 0 {
			return fmt.Errorf("placed decision %s has no allocations", d.GetDecisionId())
		}
		for _, a := range body.Placed.GetAllocations() {
			if a.GetId() == "" || a.GetNodeId() == "" || len(a.GetGpuIndices()) == 0 {
				return fmt.Errorf("placed decision %s has an allocation without id, node or GPUs", d.GetDecisionId())
			}
			for _, g := range a.GetGpuIndices() {
				if g > 1<<31-1 {
					return fmt.Errorf("placed decision %s: GPU index %d out of range", d.GetDecisionId(), g)
				}
			}
		}
	case *fleetpb.PlacementDecision_Released:
		for _, id := range body.Released.GetAllocationIds() {
			if id == "" {
				return fmt.Errorf("released decision %s names an empty allocation id", d.GetDecisionId())
			}
		}
	case *fleetpb.PlacementDecision_Failed:
	case *fleetpb.PlacementDecision_Freed:
		ids := body.Freed.GetAllocationIds()
		if len(ids) == 0 {
			return fmt.Errorf("freed decision %s has no allocations", d.GetDecisionId())
		}
		for _, id := range append(ids[:len(ids):len(ids)], body.Freed.GetFenced()...) {
			if id == "" {
				return fmt.Errorf("freed decision %s names an empty allocation id", d.GetDecisionId())
			}
		}
		for _, id := range body.Freed.GetFenced() {
			if !slices.Contains(ids, id) {
				return fmt.Errorf("freed decision %s fences allocation %s that it does not free", d.GetDecisionId(), id)
			}
		}
	case *fleetpb.PlacementDecision_UnbindAgain:
		for _, a := range body.UnbindAgain.GetAllocations() {
			if a.GetId() == "" || a.GetNodeId() == "" {
				return fmt.Errorf("unbind-again decision %s has an allocation without id or node", d.GetDecisionId())
			}
		}
	case *fleetpb.PlacementDecision_Unfenced:
		if body.Unfenced.GetNodeId() == "" || len(body.Unfenced.GetAllocationIds()) == 0 {
			return fmt.Errorf("unfenced decision %s names no node or no allocation", d.GetDecisionId())
		}
	default:
		return fmt.Errorf("decision %s is neither placed, released, freed, unbind-again, unfenced nor failed", d.GetDecisionId())
	}
	return nil
}
