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
			Help: "Messages a consumer handled, by outcome (a projection: applied, skipped, dead).",
		}, []string{"consumer", "kind", "outcome"}),
		batches: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_consumer_batches_total",
			Help: "Batches or attempts of a consumer, by result (a projection: committed, transient_error, rewound, naked; the export: acked, a prefix acknowledged on the stream, and error, a session that failed; the outbox: published, a batch stored, and error, a relay attempt that failed; the fold: error, a pass that failed, pull_error, a pull that failed, and attach_error, an attach that failed).",
		}, []string{"consumer", "kind", "result"}),
		stepSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "millrace_consumer_step_seconds",
			Help:    "Time of each step of a consumer (a projection: fetch, apply_commit, ack; the outbox: publish, delete; the export: fence).",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16),
		}, []string{"consumer", "kind", "step"}),
		position: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_consumer_position",
			Help: "Where the consumer is: the highest stream sequence committed (projection), acknowledged by the other system with every one before it (export), folded with every one before it (fold), or the last outbox row id stored (outbox).",
		}, []string{"consumer", "kind"}),
		pending: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_consumer_pending",
			Help: "Messages behind the position: in the stream and not yet delivered (projection), in flight plus not yet read (export), delivered and not yet folded plus not yet delivered (fold), outbox rows not yet published, by id (outbox).",
		}, []string{"consumer", "kind"}),
		lagSeconds: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_consumer_lag_seconds",
			Help: "How far behind the consumer is: the age of the newest message when its batch committed (projection), of the oldest message in flight (export, 0: none), of the oldest version waiting to be folded (fold, 0: none), of the newest row published (outbox).",
		}, []string{"consumer", "kind"}),
		retries: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_consumer_retries_total",
			Help: "Attempts that failed and were retried after a backoff while the consumer kept the lead.",
		}, []string{"consumer", "kind"}),
		deadLetters: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_consumer_dead_letters_total",
			Help: "Messages parked in the dead-letter stream.",
		}, []string{"consumer", "kind"}),
		leaderStatus: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_consumer_active",
			Help: "1 while this process holds the consumer's lease and leads it, 0 on standby.",
		}, []string{"consumer", "kind"}),
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

// Consumer binds the metrics of one consumer; a nil Metrics records
// nothing.
func (m *Metrics) Consumer(name string, kind Kind) ConsumerMetrics {
	return ConsumerMetrics{m: m, name: name, kind: string(kind)}
}

// ConsumerMetrics are the millrace_consumer_* series of one consumer,
// labelled by consumer and kind. The zero value records nothing.
type ConsumerMetrics struct {
	m    *Metrics
	name string
	kind string
}

// Active records whether this process leads the consumer.
func (c ConsumerMetrics) Active(leading bool) {
	if c.m != nil {
		v := 0.0
		if leading {
			v = 1
		}
		c.m.leaderStatus.WithLabelValues(c.name, c.kind).Set(v)
	}
}

// Step records the time of one step.
func (c ConsumerMetrics) Step(step string, d time.Duration) {
	if c.m != nil {
		c.m.stepSeconds.WithLabelValues(c.name, c.kind, step).Observe(d.Seconds())
	}
}

// Batch counts a batch or an attempt by its result.
func (c ConsumerMetrics) Batch(result string) {
	if c.m != nil {
		c.m.batches.WithLabelValues(c.name, c.kind, result).Inc()
	}
}

// Messages counts n messages by outcome.
func (c ConsumerMetrics) Messages(outcome string, n int) {
	if c.m != nil && n > 0 {
		c.m.messages.WithLabelValues(c.name, c.kind, outcome).Add(float64(n))
	}
}

// Retry counts an attempt retried after a backoff.
func (c ConsumerMetrics) Retry() {
	if c.m != nil {
		c.m.retries.WithLabelValues(c.name, c.kind).Inc()
	}
}

// DeadLetter counts a message parked in DEAD.
func (c ConsumerMetrics) DeadLetter() {
	if c.m != nil {
		c.m.deadLetters.WithLabelValues(c.name, c.kind).Inc()
	}
}

// Position records where the consumer is.
func (c ConsumerMetrics) Position(pos uint64) {
	if c.m != nil {
		c.m.position.WithLabelValues(c.name, c.kind).Set(float64(pos))
	}
}

// Lag records how far behind the consumer is, in time and in messages.
func (c ConsumerMetrics) Lag(age time.Duration, pending uint64) {
	if c.m != nil {
		c.m.lagSeconds.WithLabelValues(c.name, c.kind).Set(age.Seconds())
		c.m.pending.WithLabelValues(c.name, c.kind).Set(float64(pending))
	}
}
