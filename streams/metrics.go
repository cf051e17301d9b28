package streams

import (
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Metrics of the publisher and the consumer runners. One Metrics is made per
// process and shared by every component in it.
type Metrics struct {
	publishTotal   *prometheus.CounterVec
	publishSeconds *prometheus.HistogramVec

	messages     *prometheus.CounterVec
	batches      *prometheus.CounterVec
	stepSeconds  *prometheus.HistogramVec
	position     *prometheus.GaugeVec
	pending      *prometheus.GaugeVec
	lagSeconds   *prometheus.GaugeVec
	retries      *prometheus.CounterVec
	deadLetters  *prometheus.CounterVec
	leaderStatus *prometheus.GaugeVec
}

// NewMetrics registers the metrics with reg (nil: not registered, as in
// tests that make many).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		publishTotal: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_publish_total",
			Help: "Messages published to JetStream, by subject family and outcome (stored, duplicate, error).",
		}, []string{"family", "outcome"}),
		publishSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "millrace_publish_seconds",
			Help:    "Time from publish to JetStream's store acknowledgement.",
			Buckets: prometheus.ExponentialBuckets(0.0002, 2, 16),
		}, []string{"family"}),
		messages: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_consumer_messages_total",
			Help: "Messages handled by a projector's consumer, by outcome (applied, skipped, dead).",
		}, []string{"consumer", "outcome"}),
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_consumer_batches_total",
			Help: "Batches handled by a consumer, by result (committed, transient_error, naked).",
		}, []string{"consumer", "result"}),
		stepSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "millrace_consumer_step_seconds",
			Help:    "Time of each step of the consumer loop (fetch, apply, commit, ack).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}, []string{"consumer", "step"}),
		position: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_consumer_position",
			Help: "Highest stream sequence the consumer has applied and committed.",
		}, []string{"consumer"}),
		pending: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_consumer_pending",
			Help: "Messages in the stream not yet delivered to the consumer.",
		}, []string{"consumer"}),
		lagSeconds: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_consumer_lag_seconds",
			Help: "Age of the newest applied message when its batch committed.",
		}, []string{"consumer"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_consumer_retries_total",
			Help: "Batch attempts that failed with a transient error and were retried.",
		}, []string{"consumer"}),
		deadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_consumer_dead_letters_total",
			Help: "Messages parked in the dead-letter stream.",
		}, []string{"consumer"}),
		leaderStatus: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_consumer_active",
			Help: "1 while this process holds the consumer's lock and applies batches, 0 on standby.",
		}, []string{"consumer"}),
	}
	if reg != nil {
		reg.MustRegister(m.publishTotal, m.publishSeconds, m.messages, m.batches, m.stepSeconds,
			m.position, m.pending, m.lagSeconds, m.retries, m.deadLetters, m.leaderStatus)
	}
	return m
}

func family(subject string) string {
	if i := strings.IndexByte(subject, '.'); i > 0 {
		return subject[:i]
	}
	return subject
}

func (m *Metrics) published(subject, outcome string, d time.Duration) {
	if m == nil {
		return
	}
	f := family(subject)
	m.publishTotal.WithLabelValues(f, outcome).Inc()
	if outcome != "error" {
		m.publishSeconds.WithLabelValues(f).Observe(d.Seconds())
	}
}

func (m *Metrics) active(consumer string, v float64) {
	if m != nil {
		m.leaderStatus.WithLabelValues(consumer).Set(v)
	}
}

func (m *Metrics) step(consumer, step string, d time.Duration) {
	if m != nil {
		m.stepSeconds.WithLabelValues(consumer, step).Observe(d.Seconds())
	}
}

func (m *Metrics) batch(consumer, result string) {
	if m != nil {
		m.batches.WithLabelValues(consumer, result).Inc()
	}
}

func (m *Metrics) count(consumer, outcome string, n int) {
	if m != nil && n > 0 {
		m.messages.WithLabelValues(consumer, outcome).Add(float64(n))
	}
}

func (m *Metrics) retry(consumer string) {
	if m != nil {
		m.retries.WithLabelValues(consumer).Inc()
	}
}

func (m *Metrics) dead(consumer string) {
	if m != nil {
		m.deadLetters.WithLabelValues(consumer).Inc()
	}
}

func (m *Metrics) positionAt(consumer string, pos uint64) {
	if m != nil {
		m.position.WithLabelValues(consumer).Set(float64(pos))
	}
}

func (m *Metrics) lag(consumer string, age time.Duration, pending uint64) {
	if m != nil {
		m.lagSeconds.WithLabelValues(consumer).Set(age.Seconds())
		m.pending.WithLabelValues(consumer).Set(float64(pending))
	}
}
