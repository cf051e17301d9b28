package reservations

import (
	"slices"
	"time"
	"unicode"
	"unicode/utf8"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Limits on requests. Strings are refused when they hold control
// characters (NUL among them, which PostgreSQL text cannot store, and CR/LF,
// which would break a message header).
const (
	// MaxRequestBytes bounds a request: an HTTP body, or a gRPC message's
	// encoded size.
	MaxRequestBytes = 64 << 10
	// MaxPoolBytes bounds a pool name (UTF-8, like a DNS name).
	MaxPoolBytes = 253
	// MaxGPUs is the most GPUs one reservation may ask for on one node;
	// MaxNodes the most whole nodes.
	MaxGPUs  = 64
	MaxNodes = 1024
	// MaxModelBytes bounds spec.model.
	MaxModelBytes = 128
	// MaxLabels bounds spec.labels; each key is 1..MaxLabelKeyBytes, each
	// value at most MaxLabelValueBytes.
	MaxLabels          = 32
	MaxLabelKeyBytes   = 128
	MaxLabelValueBytes = 256
	// MaxGPUMemoryMiB bounds spec.min_gpu_memory_mib (1 PiB).
	MaxGPUMemoryMiB = 1 << 30
	// MaxRequestIDBytes bounds request_id.
	MaxRequestIDBytes = 128
	// MaxIDBytes bounds the reservation id of Get and Cancel.
	MaxIDBytes = 128
	// DefaultPageSize and MaxPageSize bound List; a larger page_size is
	// lowered to MaxPageSize.
	DefaultPageSize = 100
	MaxPageSize     = 1000
	// maxPageTokenBytes bounds page_token (ours are under 100 bytes).
	maxPageTokenBytes = 512
)

func invalid(format string, args ...any) error {
	return status.Errorf(codes.InvalidArgument, "millrace: "+format, args...)
}

// checkText checks one string field.
func checkText(field, s string, max int, required bool) error {
	if s == "" {
		if required {
			return invalid("%s is required", field)
		}
		return nil
	}
	if len(s) > max {
		return invalid("%s is %d bytes long; the limit is %d bytes", field, len(s), max)
	}
	if !utf8.ValidString(s) {
		return invalid("%s is not valid UTF-8", field)
	}
	for i, r := range s {
		if unicode.IsControl(r) {
			return invalid("%s contains a control character (%U at byte %d)", field, r, i)
		}
	}
	return nil
}

func checkPool(field, pool string) error { return checkText(field, pool, MaxPoolBytes, true) }

// checkCreate checks a Create request; every message names the field and
// the limit, so that a person can fix the request.
func checkCreate(req *fleetpb.CreateReservationRequest, maxWait time.Duration) error {
	if size := proto.Size(req); size > MaxRequestBytes {
		return invalid("the request is %d bytes; the limit is %d bytes", size, MaxRequestBytes)
	}
	spec := req.GetSpec()
	if spec == nil {
		return invalid("spec is required: give spec.pool and one of spec.gpus or spec.nodes")
	}
	if err := checkPool("spec.pool", spec.GetPool()); err != nil {
		return err
	}
	switch gpus, nodes := spec.GetGpus(), spec.GetNodes(); {
	case gpus == 0 && nodes == 0:
		return invalid("set one of spec.gpus (1..%d GPUs on one node) or spec.nodes (1..%d whole nodes)", MaxGPUs, MaxNodes)
	case gpus != 0 && nodes != 0:
		return invalid("spec.gpus (%d) and spec.nodes (%d) are both set; set exactly one", gpus, nodes)
	case gpus > MaxGPUs:
		return invalid("spec.gpus is %d; a reservation takes at most %d GPUs on one node (ask for whole nodes with spec.nodes)", gpus, MaxGPUs)
	case nodes > MaxNodes:
		return invalid("spec.nodes is %d; a reservation takes at most %d nodes", nodes, MaxNodes)
	}
	if err := checkText("spec.model", spec.GetModel(), MaxModelBytes, false); err != nil {
		return err
	}
	if n := len(spec.GetLabels()); n > MaxLabels {
		return invalid("spec.labels has %d labels; the limit is %d", n, MaxLabels)
	}
	keys := make([]string, 0, len(spec.GetLabels()))
	for k := range spec.GetLabels() {
		keys = append(keys, k)
	}
	slices.Sort(keys) // the same request gets the same error
	for _, k := range keys {
		if err := checkText("a key of spec.labels", k, MaxLabelKeyBytes, true); err != nil {
			return err
		}
		if err := checkText("spec.labels["+k+"]", spec.GetLabels()[k], MaxLabelValueBytes, false); err != nil {
			return err
		}
	}
	if m := spec.GetMinGpuMemoryMib(); m > MaxGPUMemoryMiB {
		return invalid("spec.min_gpu_memory_mib is %d; the limit is %d (1 PiB)", m, uint64(MaxGPUMemoryMiB))
	}
	if err := checkText("request_id", req.GetRequestId(), MaxRequestIDBytes, false); err != nil {
		return err
	}
	if w := req.GetWait(); w != nil {
		if err := w.CheckValid(); err != nil {
			return invalid("wait is not a valid duration: %v", err)
		}
		switch d := w.AsDuration(); {
		case d < 0:
			return invalid("wait is %s; it must not be negative", d)
		case d > maxWait:
			return invalid("wait is %s; the longest wait is %s (call Create again with the same request_id to wait longer)", d, maxWait)
		}
	}
	return nil
}

func checkID(id string) error { return checkText("id", id, MaxIDBytes, true) }

// checkList checks a List request but its page token.
func checkList(req *fleetpb.ListReservationsRequest) error {
	if req.GetPool() != "" {
		if err := checkPool("pool", req.GetPool()); err != nil {
			return err
		}
	}
	if _, ok := fleetpb.ReservationState_name[int32(req.GetState())]; !ok {
		return invalid("state %d is not a reservation state (PENDING, PLACED, ACTIVE, CANCELLED or FAILED)", int32(req.GetState()))
	}
	if len(req.GetPageToken()) > maxPageTokenBytes {
		return invalid("page_token is not one this server issued; start again without it")
	}
	return nil
}
