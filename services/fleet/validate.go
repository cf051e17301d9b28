package fleet

import (
	"fmt"
	"unicode"
	"unicode/utf8"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Limits on what a node may send. A message over Config.MaxMessageBytes is
// refused by gRPC before it is decoded; these bound what fits inside.
const (
	// MaxIDBytes bounds node ids, pools, allocation and gateway ids: they
	// become subject tokens and headers (a DNS name's limit).
	MaxIDBytes   = 253
	MaxLabels    = 64
	MaxLabelLen  = 256
	MaxGPUs      = 64
	MaxModelLen  = 128
	MaxAllocs    = 1024
	maxShortText = 128  // agent version, GPU uuid, condition type
	maxLongText  = 1024 // condition reason, allocation error
	maxCondition = 64
)

// CheckID reports whether s can name a node, pool, allocation or gateway:
// non-empty UTF-8 of at most MaxIDBytes bytes without control characters.
// what names the field in the error.
func CheckID(what, s string) error {
	switch {
	case s == "":
		return fmt.Errorf("%s is empty", what)
	case len(s) > MaxIDBytes:
		return fmt.Errorf("%s is %d bytes, over the limit of %d", what, len(s), MaxIDBytes)
	case !utf8.ValidString(s):
		return fmt.Errorf("%s is not valid UTF-8", what)
	}
	for _, r := range s {
		if unicode.IsControl(r) {
			return fmt.Errorf("%s %q contains a control character", what, s)
		}
	}
	return nil
}

func checkText(what, s string, limit int) error {
	if len(s) > limit {
		return fmt.Errorf("%s is %d bytes, over the limit of %d", what, len(s), limit)
	}
	if !utf8.ValidString(s) {
		return fmt.Errorf("%s is not valid UTF-8", what)
	}
	return nil
}

// checkHello checks everything in a Hello but its match with the node's
// certificate.
func checkHello(h *fleetpb.Hello) error {
	if err := CheckID("node_id", h.GetNodeId()); err != nil {
		return err
	}
	if err := CheckID("pool", h.GetPool()); err != nil {
		return err
	}
	if n := len(h.GetLabels()); n > MaxLabels {
		return fmt.Errorf("%d labels, over the limit of %d", n, MaxLabels)
	}
	for k, v := range h.GetLabels() {
		if k == "" {
			return fmt.Errorf("a label has an empty key")
		}
		if err := checkText("label key", k, MaxLabelLen); err != nil {
			return err
		}
		if err := checkText("label "+k, v, MaxLabelLen); err != nil {
			return err
		}
	}
	if err := checkText("agent_version", h.GetAgentVersion(), maxShortText); err != nil {
		return err
	}
	if n := len(h.GetGpus()); n > MaxGPUs {
		return fmt.Errorf("%d GPUs, over the limit of %d", n, MaxGPUs)
	}
	seen := make(map[uint32]bool, len(h.GetGpus()))
	for _, g := range h.GetGpus() {
		if seen[g.GetIndex()] {
			return fmt.Errorf("GPU index %d appears twice", g.GetIndex())
		}
		seen[g.GetIndex()] = true
		if err := checkText("GPU model", g.GetModel(), MaxModelLen); err != nil {
			return err
		}
		if err := checkText("GPU uuid", g.GetUuid(), maxShortText); err != nil {
			return err
		}
	}
	if n := len(h.GetAllocations()); n > MaxAllocs {
		return fmt.Errorf("%d allocations, over the limit of %d", n, MaxAllocs)
	}
	for _, a := range h.GetAllocations() {
		if err := CheckID("allocation id", a); err != nil {
			return err
		}
	}
	return nil
}

func checkStatus(r *fleetpb.StatusReport) error {
	if n := len(r.GetGpus()); n > MaxGPUs {
		return fmt.Errorf("status of %d GPUs, over the limit of %d", n, MaxGPUs)
	}
	if n := len(r.GetGauges()); n > MaxGPUs {
		return fmt.Errorf("gauges of %d GPUs, over the limit of %d", n, MaxGPUs)
	}
	if n := len(r.GetConditions()); n > maxCondition {
		return fmt.Errorf("%d conditions, over the limit of %d", n, maxCondition)
	}
	for _, c := range r.GetConditions() {
		if err := checkText("condition type", c.GetType(), maxShortText); err != nil {
			return err
		}
		if err := checkText("condition reason", c.GetReason(), maxLongText); err != nil {
			return err
		}
	}
	return nil
}

func checkAllocation(r *fleetpb.AllocationReport) error {
	if err := CheckID("allocation_id", r.GetAllocationId()); err != nil {
		return err
	}
	switch r.GetState() {
	case fleetpb.AllocationState_ALLOCATION_STATE_BOUND,
		fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND,
		fleetpb.AllocationState_ALLOCATION_STATE_FAILED:
	default:
		return fmt.Errorf("allocation %s: a node reports BOUND, UNBOUND or FAILED, not %s", r.GetAllocationId(), r.GetState())
	}
	return checkText("allocation error", r.GetError(), maxLongText)
}
