package commits

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/status"
)

// Metrics of the commits edge.
type Metrics struct {
	requests       *prometheus.CounterVec
	latency        *prometheus.HistogramVec
	conflicts      prometheus.Counter
	falseConflicts prometheus.Counter
	duplicates     prometheus.Counter
}

// NewMetrics registers the edge's metrics with reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_commits_requests_total",
			Help: "Commits API calls by operation (put, delete, get, history) and gRPC code.",
		}, []string{"op", "code"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "millrace_commits_request_seconds",
			Help:    "Commits API call latency by operation.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}, []string{"op"}),
		conflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_commits_conflicts_total",
			Help: "Writes refused by compare-and-set: the document was at another version.",
		}),
		falseConflicts: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_commits_false_conflicts_total",
			Help: "Writes the backbone refused although their expected version was current (another write to the document in flight, replicated streams), and tried again.",
		}),
		duplicates: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_commits_duplicates_total",
			Help: "Writes whose request id matched an earlier write: answered with its version, nothing stored.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.latency, m.conflicts, m.falseConflicts, m.duplicates)
	}
	return m
}

// track counts and times one call.
func track[T any](s *Server, op string, f func() (T, error)) (T, error) {
	start := time.Now()
	v, err := f()
	s.m.latency.WithLabelValues(op).Observe(time.Since(start).Seconds())
	s.m.requests.WithLabelValues(op, status.Code(err).String()).Inc()
	return v, err
}
