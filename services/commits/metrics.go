package commits

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/httpapi"
)

// Metrics of the commits edge.
type Metrics struct {
	requests       *prometheus.CounterVec
	latency        *prometheus.HistogramVec
	conflicts      prometheus.Counter
	falseConflicts prometheus.Counter
	duplicates     prometheus.Counter
	folded         *prometheus.CounterVec
	worldsOpen     prometheus.Gauge
	worldOpen      prometheus.Histogram
}

// NewMetrics registers the edge's metrics with reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_commits_requests_total",
			Help: "Commits API calls by operation (put, delete, get, history, list) and status code (google.rpc.Code's name: OK, UNAVAILABLE).",
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
		folded: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_commits_folded_reads_total",
			Help: "Reads answered from the bucket because the compactor had moved the version out of the stream, by what was read (version, latest, history).",
		}, []string{"what"}),
		worldsOpen: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_commits_worlds_open",
			Help: "Worlds whose index (every document and its latest version, for List) this edge holds in memory.",
		}),
		worldOpen: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "millrace_commits_world_open_seconds",
			Help:    "Time to open a world's index: its latest checkpoint from the bucket, then the stream tail after it.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}),
	}
	if reg != nil {
		reg.MustRegister(m.requests, m.latency, m.conflicts, m.falseConflicts, m.duplicates, m.folded, m.worldsOpen, m.worldOpen)
	}
	return m
}

// track counts and times one call.
func track[T any](s *Server, op string, f func() (T, error)) (T, error) {
	start := time.Now()
	v, err := f()
	s.m.latency.WithLabelValues(op).Observe(time.Since(start).Seconds())
	s.m.requests.WithLabelValues(op, httpapi.CodeName(status.Code(err))).Inc()
	return v, err
}
