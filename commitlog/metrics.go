package commitlog

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// FoldMetrics are the fold runner's own figures (prefix
// millrace_compactor_): passes and what they did, discovery's worlds and
// versions. Whether it leads, its position, lag and errors are the
// consumer core's (FoldRunnerConfig.ConsumerMetrics, kind="fold").
type FoldMetrics struct {
	passes      *prometheus.CounterVec
	folded      prometheus.Counter
	dropped     prometheus.Counter
	swept       prometheus.Counter
	discoveries prometheus.Counter
	seconds     prometheus.Histogram
	worldsDirty prometheus.Gauge
	waiting     prometheus.Gauge
}

// NewFoldMetrics registers the metrics with reg (nil: not registered).
func NewFoldMetrics(reg prometheus.Registerer) *FoldMetrics {
	m := &FoldMetrics{
		passes: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_compactor_passes_total",
			Help: "Fold passes by result: folded (wrote a checkpoint or swept), idle (nothing new), error.",
		}, []string{"result"}),
		folded: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_compactor_versions_folded_total",
			Help: "Document versions folded into checkpoints.",
		}),
		dropped: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_compactor_versions_dropped_total",
			Help: "Versions deleted from COMMITS after their checkpoint (not their document's last).",
		}),
		swept: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_compactor_versions_swept_total",
			Help: "Versions a pass that died during its deletions had left in COMMITS, deleted by a later pass.",
		}),
		discoveries: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_compactor_versions_discovered_total",
			Help: "Versions the discovery consumer delivered that were not folded yet.",
		}),
		seconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "millrace_compactor_pass_seconds",
			Help:    "Time of each fold pass.",
			Buckets: prometheus.ExponentialBuckets(0.005, 2, 16),
		}),
		worldsDirty: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_compactor_worlds_dirty",
			Help: "Worlds with versions waiting to be folded.",
		}),
		waiting: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_compactor_versions_waiting",
			Help: "Versions delivered to the compactor and not folded yet.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.passes, m.folded, m.dropped, m.swept, m.discoveries, m.seconds,
			m.worldsDirty, m.waiting)
	}
	return m
}

func (m *FoldMetrics) pass(result string, took time.Duration, st FoldStats) {
	if m == nil {
		return
	}
	m.passes.WithLabelValues(result).Inc()
	m.seconds.Observe(took.Seconds())
	if result == "error" {
		return
	}
	m.folded.Add(float64(st.Versions))
	m.dropped.Add(float64(st.Dropped))
	m.swept.Add(float64(st.Swept))
}

func (m *FoldMetrics) discovered() {
	if m != nil {
		m.discoveries.Inc()
	}
}
