package bes

import (
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"

	"github.com/millrace/millrace/internal/httpapi"
)

// Metrics of the BES edge.
type Metrics struct {
	events      *prometheus.CounterVec
	bytes       prometheus.Counter
	rejections  *prometheus.CounterVec
	streamsOpen prometheus.Gauge
	ackSeconds  prometheus.Histogram
	redacted    prometheus.Counter
	connRefused *prometheus.CounterVec
}

// NewMetrics registers the edge's metrics with reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		events: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_bes_events_total",
			Help: "Build events accepted and published, by kind (tool, lifecycle).",
		}, []string{"kind"}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_bes_event_bytes_total",
			Help: "Bytes of build tool events published.",
		}),
		rejections: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_bes_rejections_total",
			Help: "Requests or streams refused, by what and the status code returned (google.rpc.Code's name: RESOURCE_EXHAUSTED).",
		}, []string{"what", "code"}),
		streamsOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_bes_streams_open",
			Help: "Build event streams open now.",
		}),
		ackSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "millrace_bes_ack_seconds",
			Help:    "Time from receiving an event to sending its ack (stored by JetStream).",
			Buckets: prometheus.ExponentialBuckets(0.0002, 2, 16),
		}),
		redacted: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_bes_redacted_events_total",
			Help: "Build events in which the edge replaced a secret before storing them.",
		}),
		connRefused: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_bes_connections_refused_total",
			Help: "Client connections closed as soon as accepted, by the cap they met (max, per_addr).",
		}, []string{"reason"}),
	}
	if reg != nil {
		reg.MustRegister(m.events, m.bytes, m.rejections, m.streamsOpen, m.ackSeconds, m.redacted, m.connRefused)
	}
	return m
}

// RefusedConnection counts a connection closed at accept (see
// internal/netlimit), reason being the cap it met.
func (m *Metrics) RefusedConnection(reason string) {
	m.connRefused.WithLabelValues(reason).Inc()
}

// rejected counts a refusal; the code label is spelled as google.rpc.Code
// (and as every millrace series and JSON error spells it).
func (m *Metrics) rejected(what string, code codes.Code) {
	m.rejections.WithLabelValues(what, httpapi.CodeName(code)).Inc()
}
