package fleet

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// kind is what one stream message says.
type kind uint8

const (
	kindConnected kind = iota + 1
	kindDisconnected
	kindStatus
	kindAllocation
	kindLiveness
)

// event is one decoded stream message.
type event struct {
	seq  uint64
	at   time.Time // JetStream's stored time, to the microsecond
	kind kind
	node *fleetpb.NodeEvent     // kinds connected .. allocation
	live *fleetpb.LivenessBatch // kindLiveness
}

// decodeMessage checks a message's headers and subject and decodes its body.
// Every error it returns makes the message poison.
func decodeMessage(m projection.Message) (event, error) {
	ev := event{seq: m.Seq()}
	if s := m.Header(envelope.Schema); s != envelope.SchemaFleetV1 {
		return ev, fmt.Errorf("unknown schema %q in header %s (want %q)", s, envelope.Schema, envelope.SchemaFleetV1)
	}
	k := m.Header(envelope.Kind)
	if k != envelope.KindNode && k != envelope.KindLiveness {
		return ev, fmt.Errorf("unknown kind %q in header %s (want %q or %q)", k, envelope.Kind, envelope.KindNode, envelope.KindLiveness)
	}
	if err := checkSubject(m.Subject(), k); err != nil {
		return ev, err
	}
	ev.at = validTime(m.Time())
	if ev.at.IsZero() {
		return ev, fmt.Errorf("stored time %v out of range", m.Time())
	}
	var err error
	if k == envelope.KindNode {
		ev.kind, ev.node, err = decodeNodeEvent(m.Data())
		if err == nil {
			err = sameAsHeaders(m, ev.node.GetPool(), ev.node.GetNodeId())
		}
	} else {
		ev.kind = kindLiveness
		ev.live, err = decodeLiveness(m.Data())
		if err == nil {
			err = sameAsHeaders(m, ev.live.GetPool(), "")
		}
	}
	return ev, err
}

// checkSubject checks that subject is one of FLEET_NODES and of kind k's
// shape: fleet.node.<pool>.<node> holds node events, fleet.node.<pool>
// liveness batches. The tokens are encoded ids (the body carries them as
// given): a subject is taken only as subjects.FleetNode or FleetLiveness
// writes it.
func checkSubject(subject, k string) error {
	pool, node, ok := subjects.ParseFleet(subject)
	live := ok && subject == subjects.FleetLiveness(pool)
	if !ok || !live && subject != subjects.FleetNode(pool, node) {
		return fmt.Errorf("subject %q is not a fleet.node subject", subject)
	}
	if live != (k == envelope.KindLiveness) {
		return fmt.Errorf("kind %q on subject %q (want fleet.node.<pool>.<node> for %q, fleet.node.<pool> for %q)",
			k, subject, envelope.KindNode, envelope.KindLiveness)
	}
	return nil
}

// sameAsHeaders checks the body's ids against the Millrace-Pool and
// Millrace-Node headers where the publisher set them.
func sameAsHeaders(m projection.Message, pool, node string) error {
	if h := m.Header(envelope.Pool); h != "" && pool != "" && h != pool {
		return fmt.Errorf("header %s %q differs from the body's pool %q", envelope.Pool, h, pool)
	}
	if h := m.Header(envelope.Node); h != "" && node != "" && h != node {
		return fmt.Errorf("header %s %q differs from the body's node %q", envelope.Node, h, node)
	}
	return nil
}

var errNoBody = errors.New("node event has no body (connected, disconnected, status_changed or allocation)")

// decodeNodeEvent decodes and checks a NodeEvent body.
func decodeNodeEvent(data []byte) (kind, *fleetpb.NodeEvent, error) {
	ev := &fleetpb.NodeEvent{}
	if err := proto.Unmarshal(data, ev); err != nil {
		return 0, nil, fmt.Errorf("decode NodeEvent: %w", err)
	}
	if ev.NodeId == "" {
		return 0, nil, errors.New("node event has no node_id")
	}
	// A node is (pool, node id): without its pool an event could name a
	// node of any pool.
	if ev.Pool == "" {
		return 0, nil, errors.New("node event has no pool")
	}
	if err := ids("node event", ev.NodeId, ev.Pool, ev.GatewayId, ev.SessionId); err != nil {
		return 0, nil, err
	}
	switch b := ev.Body.(type) {
	case *fleetpb.NodeEvent_Connected:
		seen := make(map[uint32]bool, len(b.Connected.GetGpus()))
		for _, g := range b.Connected.GetGpus() {
			if seen[g.GetIndex()] {
				return 0, nil, fmt.Errorf("connected event lists GPU index %d twice", g.GetIndex())
			}
			seen[g.GetIndex()] = true
			if g.GetIndex() > math.MaxInt32 || g.GetMemoryMib() > math.MaxInt64 {
				return 0, nil, fmt.Errorf("connected event: GPU index %d or memory %d MiB out of range", g.GetIndex(), g.GetMemoryMib())
			}
		}
		return kindConnected, ev, nil
	case *fleetpb.NodeEvent_Disconnected:
		return kindDisconnected, ev, nil
	case *fleetpb.NodeEvent_StatusChanged:
		for _, g := range b.StatusChanged.GetGpus() {
			if g.GetIndex() > math.MaxInt32 {
				return 0, nil, fmt.Errorf("status change: GPU index %d out of range", g.GetIndex())
			}
		}
		return kindStatus, ev, nil
	case *fleetpb.NodeEvent_Allocation:
		a := b.Allocation
		if a.GetAllocationId() == "" {
			return 0, nil, errors.New("allocation report has no allocation_id")
		}
		if err := ids("allocation report", a.GetAllocationId()); err != nil {
			return 0, nil, err
		}
		if allocationState(a.GetState()) == "" {
			return 0, nil, fmt.Errorf("allocation report %s has state %v", a.GetAllocationId(), a.GetState())
		}
		return kindAllocation, ev, nil
	default:
		return 0, nil, errNoBody
	}
}

// decodeLiveness decodes a LivenessBatch body. Entries whose node id could
// never be stored (empty, or holding NUL) are left for the fold to count
// as unknown nodes.
func decodeLiveness(data []byte) (*fleetpb.LivenessBatch, error) {
	b := &fleetpb.LivenessBatch{}
	if err := proto.Unmarshal(data, b); err != nil {
		return nil, fmt.Errorf("decode LivenessBatch: %w", err)
	}
	if b.Pool == "" {
		return nil, errors.New("liveness batch has no pool")
	}
	if err := ids("liveness batch", b.Pool); err != nil {
		return nil, err
	}
	return b, nil
}

// ids rejects identifiers PostgreSQL cannot store as text (NUL); the
// protobuf runtime already refused invalid UTF-8 in proto3 strings.
func ids(what string, ss ...string) error {
	for _, s := range ss {
		if strings.IndexByte(s, 0) >= 0 {
			return fmt.Errorf("%s: id %q holds a NUL byte", what, s)
		}
	}
	return nil
}

// storableID reports whether s can be a node id in fleet_nodes.
func storableID(s string) bool { return s != "" && strings.IndexByte(s, 0) < 0 }

// clean makes free text storable as PostgreSQL text and jsonb: valid UTF-8
// without NUL.
func clean(s string) string {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == 0 || c >= utf8.RuneSelf {
			return cleanSlow(s)
		}
	}
	return s
}

func cleanSlow(s string) string {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	return strings.ReplaceAll(s, "\x00", "\uFFFD")
}

// gpuHealth is a GpuHealth as fleet_devices.health spells it; values a
// newer schema may add read as "unspecified". The spellings are the
// column's (its check constraint, migrations/003_fleet.sql), not derived
// from the enum's generated names: renaming an enum value must not change
// what is stored or what queries match.
func gpuHealth(h fleetpb.GpuHealth) string {
	switch h {
	case fleetpb.GpuHealth_GPU_HEALTH_OK:
		return "ok"
	case fleetpb.GpuHealth_GPU_HEALTH_DEGRADED:
		return "degraded"
	case fleetpb.GpuHealth_GPU_HEALTH_FAILED:
		return "failed"
	default:
		return "unspecified"
	}
}

// allocationState is an AllocationState as fleet_allocation_reports.state
// spells it, or "" for one that a report cannot carry. Written out for the
// same reason as gpuHealth's: they are the column's values.
func allocationState(s fleetpb.AllocationState) string {
	switch s {
	case fleetpb.AllocationState_ALLOCATION_STATE_PENDING:
		return "pending"
	case fleetpb.AllocationState_ALLOCATION_STATE_BOUND:
		return "bound"
	case fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND:
		return "unbound"
	case fleetpb.AllocationState_ALLOCATION_STATE_FAILED:
		return "failed"
	default:
		return ""
	}
}

// PostgreSQL's timestamptz has microseconds and reaches from 4713 BC to
// 294276 AD. Times are cut to microseconds on the way in so that the
// comparisons made in Go (fold.go) and in SQL (Sweep) agree to the last
// digit.
var (
	minTime = time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC)
	maxTime = time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)
)

func validTime(t time.Time) time.Time {
	if t.Before(minTime) || t.After(maxTime) {
		return time.Time{}
	}
	return t.UTC().Truncate(time.Microsecond)
}
