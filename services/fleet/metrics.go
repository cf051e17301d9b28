package fleet

import (
	"github.com/prometheus/client_golang/prometheus"
)

// Metrics of a fleet gateway.
type Metrics struct {
	sessionsOpen    prometheus.Gauge
	handshakes      *prometheus.CounterVec
	closed          *prometheus.CounterVec
	messages        *prometheus.CounterVec
	heartbeats      prometheus.Counter // messages{kind="heartbeat"}, resolved once: it is on every heartbeat's path
	events          *prometheus.CounterVec
	publishErrors   *prometheus.CounterVec
	livenessBatches prometheus.Counter
	livenessNodes   prometheus.Histogram
	binds           *prometheus.CounterVec
	decisions       *prometheus.CounterVec
	pendingBinds    prometheus.Gauge
	reconciled      *prometheus.CounterVec
	joins           *prometheus.CounterVec
	handshakeShed   prometheus.Counter
	tlsHandshakes   *prometheus.CounterVec
	reportsRefused  *prometheus.CounterVec
	revoked         *prometheus.CounterVec
	denyReloads     *prometheus.CounterVec
	denyEntries     prometheus.Gauge
}

// NewMetrics registers the gateway's metrics with reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		sessionsOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_fleet_sessions_open",
			Help: "Node sessions open now (including those still in their handshake).",
		}),
		handshakes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_handshakes_total",
			Help: "Session handshakes by result: accepted, or the refusal code (sessions_full, handshake_rate, hellos_in_flight, draining, unauthenticated, invalid, unavailable).",
		}, []string{"result"}),
		closed: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_sessions_closed_total",
			Help: "Established sessions closed, by reason (closed, heartbeat_timeout, replaced, draining, invalid, error).",
		}, []string{"reason"}),
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_messages_total",
			Help: "Messages received from nodes, by kind (hello, heartbeat, status, allocation).",
		}, []string{"kind"}),
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_events_published_total",
			Help: "Node events stored in JetStream, by kind (connected, resync, disconnected, status_changed, allocation, liveness).",
		}, []string{"kind"}),
		publishErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_publish_errors_total",
			Help: "Node events not stored, by kind: the backbone refused or timed out, or the publish queue stayed full.",
		}, []string{"kind"}),
		livenessBatches: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_fleet_liveness_batches_total",
			Help: "Liveness batches published (one per pool per flush, chunked at 10,000 nodes).",
		}),
		livenessNodes: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "millrace_fleet_liveness_batch_nodes",
			Help:    "Nodes per liveness batch.",
			Buckets: prometheus.ExponentialBuckets(1, 4, 8),
		}),
		binds: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_commands_sent_total",
			Help: "Commands sent to nodes, by action (bind, unbind).",
		}, []string{"action"}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_decisions_total",
			Help: "Placement decisions read from FLEET_PLACE, by kind (placed, released, unbind_again, freed, unfenced, failed, invalid).",
		}, []string{"kind"}),
		pendingBinds: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_fleet_pending_binds",
			Help: "Binds kept for the bind window (for nodes that may connect here, or reconnect without them), until released.",
		}),
		reconciled: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_reconciled_total",
			Help: "Commands sent when a node's Hello was reconciled with the decisions, by action (unbind: it holds a released allocation; bind: it lacks one placed on it).",
		}, []string{"action"}),
		joins: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_joins_total",
			Help: "Join calls by result (issued, unauthenticated, invalid, rate_limited, revoked).",
		}, []string{"result"}),
		handshakeShed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_fleet_tls_handshakes_shed_total",
			Help: "Connections closed before their TLS handshake because too many handshakes were waiting (a reconnect storm); the nodes dial again with backoff.",
		}),
		tlsHandshakes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_tls_handshakes_total",
			Help: "TLS handshakes, by mode: full, or resumed from a session ticket (a node re-homing from another gateway of the fleet), or timeout (dropped at the handshake deadline: a client that said nothing or stalled).",
		}, []string{"mode"}),
		reportsRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_reports_refused_total",
			Help: "Node reports refused, by reason: foreign (an allocation report from a node the allocation is not placed on), rate (over the session's report rate), allocations_full (a BOUND beyond the session's held allocations), queue_share (the session's share of the publish queue stayed full).",
		}, []string{"reason"}),
		revoked: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_revoked_total",
			Help: "Revocations carried out, by action: session_closed (a live session of a revoked certificate), handshake_refused, join_refused.",
		}, []string{"action"}),
		denyReloads: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_fleet_deny_list_reloads_total",
			Help: "Deny list file reloads by result: ok, or error (the file did not parse or could not be read; the previous list stays in force).",
		}, []string{"result"}),
		denyEntries: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_fleet_deny_list_entries",
			Help: "Entries (certificate serials and node identities) of the deny list in force.",
		}),
	}
	m.heartbeats = m.messages.WithLabelValues("heartbeat")
	if reg != nil {
		reg.MustRegister(m.sessionsOpen, m.handshakes, m.closed, m.messages, m.events, m.publishErrors,
			m.livenessBatches, m.livenessNodes, m.binds, m.decisions, m.pendingBinds, m.reconciled, m.joins, m.handshakeShed, m.tlsHandshakes,
			m.reportsRefused, m.revoked, m.denyReloads, m.denyEntries)
	}
	return m
}
