package agent

import "time"

// Observer receives an agent's events, for metrics and for the fleet
// simulator. Methods are called on the agent's goroutines (its receive
// loop, its heartbeat timer) and must return quickly; one Observer may
// serve many agents, so it must be safe for concurrent use. Embed
// NopObserver to implement only some methods.
type Observer interface {
	// Connected: a gateway welcomed the node.
	Connected(ConnectedEvent)
	// Disconnected: a session ended, or a dial or Hello failed.
	Disconnected(DisconnectedEvent)
	// Refused: a gateway refused the session (before or after Welcome).
	Refused(RefusedEvent)
	// Bound: the node holds an allocation after a Bind and answered
	// BOUND (Reported says whether the answer reached gRPC; if the session
	// broke first, the next Hello names the allocation instead).
	Bound(BoundEvent)
	// Unbound: the node released an allocation after an Unbind and
	// answered UNBOUND.
	Unbound(UnboundEvent)
	// HeartbeatSent: a heartbeat was handed to gRPC.
	HeartbeatSent(seq uint64, at time.Time)
}

// NopObserver ignores every event.
type NopObserver struct{}

func (NopObserver) Connected(ConnectedEvent)        {}
func (NopObserver) Disconnected(DisconnectedEvent)  {}
func (NopObserver) Refused(RefusedEvent)            {}
func (NopObserver) Bound(BoundEvent)                {}
func (NopObserver) Unbound(UnboundEvent)            {}
func (NopObserver) HeartbeatSent(uint64, time.Time) {}

// ConnectedEvent describes a Welcome.
type ConnectedEvent struct {
	// Gateway is the address dialed; GatewayID and SessionID come from
	// the Welcome.
	Gateway, GatewayID, SessionID string
	HeartbeatInterval             time.Duration
	At                            time.Time
	// First is true for the agent's first session.
	First bool
	// Outage is the time from the end of the previous session (the moment
	// the agent noticed it) to this Welcome: the re-home time. For the
	// first session, the time since Start.
	Outage time.Duration
	// Attempts counts the dials since the previous session ended,
	// this one included.
	Attempts int
}

// Causes of a Disconnected event.
const (
	CauseDial         = "dial"          // no connection, or the stream could not start
	CauseHelloTimeout = "hello_timeout" // no Welcome within Settings.HelloTimeout
	CauseRefused      = "refused"       // a Refusal, or a status with RetryInfo
	CauseClosed       = "closed"        // the gateway ended the stream without a refusal
	CauseError        = "error"         // the stream broke (connection lost, gateway gone)
	CauseSilence      = "silence"       // nothing heard for Settings.SilenceTimeout
	CauseDropped      = "dropped"       // Reconnect was called
	CauseStopped      = "stopped"       // Stop was called
)

// DisconnectedEvent describes the end of a session or of an attempt.
type DisconnectedEvent struct {
	Gateway string
	At      time.Time
	// Cause is one of the Cause constants.
	Cause string
	// Welcomed says whether the session had been welcomed.
	Welcomed bool
	Err      error
	// Wait is how long the agent waits before its next dial.
	Wait time.Duration
}

// RefusedEvent describes a Refusal.
type RefusedEvent struct {
	Gateway string
	At      time.Time
	// Code is the Refusal's code ("sessions_full", "handshake_rate", ...)
	// or, when the stream ended with a RetryInfo but no Refusal message,
	// the gRPC status code's name.
	Code   string
	Reason string
	// RetryAfter is the longer of the Refusal's retry_after and the
	// status' RetryInfo.
	RetryAfter time.Duration
	// Welcomed says whether the refusal came after a Welcome (draining,
	// replaced).
	Welcomed bool
}

// BoundEvent describes a BOUND report.
type BoundEvent struct {
	Allocation
	// Received is when the Bind command came off the stream; At is when
	// the BOUND report was handed to gRPC (or failed to be).
	Received, At time.Time
	// Repeat says the node already held the allocation (a resent Bind).
	Repeat bool
	// Reported says the BOUND report was handed to gRPC; false when the
	// session ended first.
	Reported bool
}

// UnboundEvent describes an UNBOUND report.
type UnboundEvent struct {
	AllocationID string
	At           time.Time
	// Held says whether the node held the allocation.
	Held bool
	// Reported says the UNBOUND report was handed to gRPC.
	Reported bool
}
