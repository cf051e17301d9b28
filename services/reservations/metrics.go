package reservations

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/codes"

	"github.com/millrace/millrace/internal/httpapi"
)

// Metrics of the reservations API.
type Metrics struct {
	requests  *prometheus.CounterVec
	seconds   *prometheus.HistogramVec
	waits     *prometheus.HistogramVec
	waiting   prometheus.Gauge
	decisions *prometheus.CounterVec
}

// NewMetrics registers the API's metrics with reg (nil: unregistered, as
// in tests that make many).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_reservations_requests_total",
			Help: "Reservation API calls, by method (Create, Get, List, Cancel), transport (grpc, http) and the status code answered (google.rpc.Code's name: OK, RESOURCE_EXHAUSTED).",
		}, []string{"method", "transport", "code"}),
		seconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "millrace_reservations_request_seconds",
			Help:    "Time to answer a reservation API call, waits included.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 18),
		}, []string{"method"}),
		waits: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "millrace_reservations_wait_seconds",
			Help:    "Time a Create with wait held the call, by outcome (decided, timeout, shutdown, abandoned).",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 17),
		}, []string{"outcome"}),
		waiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_reservations_waiting",
			Help: "Create calls waiting for a placement decision now.",
		}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_reservations_decisions_total",
			Help: "Placement decisions the wait subscription received, by outcome (woke, ignored, malformed).",
		}, []string{"outcome"}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.seconds, m.waits, m.waiting, m.decisions)
	}
	return m
}

func (m *Metrics) request(method, transport string, code codes.Code, d time.Duration) {
	m.requests.WithLabelValues(method, transport, httpapi.CodeName(code)).Inc()
	m.seconds.WithLabelValues(method).Observe(d.Seconds())
}

func (m *Metrics) waited(outcome string, d time.Duration) {
	m.waits.WithLabelValues(outcome).Observe(d.Seconds())
}
