package fleet

import (
	"fmt"
	"math/rand/v2"
	"sync"
	"time"

	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Refusal codes (Refusal.code in fleet.proto). CodeUnavailable is the one
// code not listed in the proto's comment: the backbone did not store the
// session's Connected event in time.
const (
	CodeSessionsFull    = "sessions_full"
	CodeHandshakeRate   = "handshake_rate"
	CodeHellosInFlight  = "hellos_in_flight"
	CodeDraining        = "draining"
	CodeReplaced        = "replaced"
	CodeUnauthenticated = "unauthenticated"
	CodeInvalid         = "invalid"
	CodeUnavailable     = "unavailable"
	// CodeReportRate: the session sent reports faster than its
	// Config.ReportRate allows.
	CodeReportRate = "report_rate"
	// CodeAllocationsFull: the session reported BOUND more allocations
	// than Config.MaxHeldAllocations.
	CodeAllocationsFull = "allocations_full"
	// CodeForeignAllocation: the session reported on an allocation placed
	// on another node.
	CodeForeignAllocation = "foreign_allocation"
	// CodeRevoked: the node's certificate (or the node) is on the deny
	// list; the session is closed and new ones refused.
	CodeRevoked = "revoked"
	// CodeJoinRate: too many Joins from the client's address, or from all
	// clients (Join's status; Join sends no Refusal message).
	CodeJoinRate = "join_rate"
)

// refusalBase is each code's base retry_after; the gateway sends base x
// [1, 2) plus a share of the current overload (see retryAfter).
var refusalBase = map[string]time.Duration{
	CodeSessionsFull:    30 * time.Second,
	CodeHandshakeRate:   time.Second,
	CodeHellosInFlight:  time.Second,
	CodeUnavailable:     2 * time.Second,
	CodeReplaced:        10 * time.Second,
	CodeUnauthenticated: time.Minute,
	CodeInvalid:         time.Minute,
	// A node over its report rate comes back once its bucket has refilled
	// a good part: ReportBurst/ReportRate is 13 s at the defaults.
	CodeReportRate:        10 * time.Second,
	CodeAllocationsFull:   time.Minute,
	CodeForeignAllocation: time.Minute,
	CodeRevoked:           5 * time.Minute,
	CodeJoinRate:          time.Second,
}

// maxDrainRetry is the spread of a draining refusal's retry_after: nodes
// re-home at once, but not all in the same millisecond.
const maxDrainRetry = 2 * time.Second

// refusal is a Refusal about to be sent, and the status that ends the
// stream after it.
type refusal struct {
	code   string
	grpc   codes.Code
	reason string
	retry  time.Duration
}

func (r *refusal) message() *fleetpb.GatewayMessage {
	return &fleetpb.GatewayMessage{Body: &fleetpb.GatewayMessage_Refusal{Refusal: &fleetpb.Refusal{
		Code:       r.code,
		Reason:     r.reason,
		RetryAfter: durationpb.New(r.retry),
	}}}
}

// err is the stream's final status: its details carry google.rpc.RetryInfo
// with the Refusal's retry_after, so a client that missed the message (or
// reads only statuses) still knows when to come back.
func (r *refusal) err() error {
	st := status.New(r.grpc, fmt.Sprintf("millrace fleet: %s: %s (retry after %s)", r.code, r.reason, r.retry.Round(time.Millisecond)))
	if withRetry, err := st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(r.retry)}); err == nil {
		st = withRetry
	}
	return st.Err()
}

// RetryAfter reads the google.rpc.RetryInfo a gateway put in a status: how
// long a node must wait before it dials any gateway again. ok is false when
// err carries none (then the node uses its own backoff).
func RetryAfter(err error) (time.Duration, bool) {
	st, ok := status.FromError(err)
	if !ok || st == nil {
		return 0, false
	}
	for _, d := range st.Details() {
		if ri, ok := d.(*errdetails.RetryInfo); ok && ri.GetRetryDelay() != nil {
			return ri.GetRetryDelay().AsDuration(), true
		}
	}
	return 0, false
}

// newRefusal makes a refusal with a jittered retry_after.
func (s *Server) newRefusal(code string, grpcCode codes.Code, format string, args ...any) *refusal {
	return &refusal{code: code, grpc: grpcCode, reason: fmt.Sprintf(format, args...), retry: s.retryAfter(code)}
}

// retryAfter is base x [1, 2), plus, for refusals caused by load, a uniform
// share of the overload: the refusals of the last second divided by the
// handshake rate is how many seconds the refused nodes need to come back at
// a pace the gateway accepts, so each is sent somewhere in that span.
// A reconnect storm thus spreads out instead of returning in step.
func (s *Server) retryAfter(code string) time.Duration {
	if code == CodeDraining {
		return rand.N(maxDrainRetry)
	}
	base := refusalBase[code]
	if base <= 0 {
		base = time.Second
	}
	d := base + rand.N(base)
	switch code {
	case CodeSessionsFull, CodeHandshakeRate, CodeHellosInFlight, CodeUnavailable:
		perSecond := s.pressure.add(time.Now())
		if spread := time.Duration(perSecond / s.cfg.HandshakeRate * float64(time.Second)); spread > 0 {
			d += rand.N(min(spread, s.cfg.MaxRetryAfter))
		}
	}
	return min(d, s.cfg.MaxRetryAfter)
}

// pressure estimates load refusals per second over a sliding second.
type pressure struct {
	mu        sync.Mutex
	sec       int64
	cur, prev float64
}

// add counts one refusal and returns the rate of the last second.
func (p *pressure) add(now time.Time) float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	sec := now.Unix()
	switch {
	case sec == p.sec:
	case sec == p.sec+1:
		p.prev, p.cur, p.sec = p.cur, 0, sec
	default:
		p.prev, p.cur, p.sec = 0, 0, sec
	}
	p.cur++
	// The previous second counts for the part of it still in the window.
	frac := float64(now.Nanosecond()) / 1e9
	return p.cur + p.prev*(1-frac)
}
