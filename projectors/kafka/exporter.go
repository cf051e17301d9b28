package kafka

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/sasl"
	"github.com/twmb/franz-go/pkg/sasl/plain"
	"github.com/twmb/franz-go/pkg/sasl/scram"

	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/streams/projection"
)

// Headers every exported record carries, beside the message's own headers
// (Millrace-Schema, Millrace-Kind, Nats-Msg-Id, ...). A consumer
// deduplicates by (Millrace-Stream, Millrace-Seq): a record is sent again
// only after a failure or a crash, and then with the same sequence.
const (
	HeaderSubject = "Millrace-Subject"
	HeaderStream  = "Millrace-Stream"
	HeaderSeq     = "Millrace-Seq"
)

// Config of an exporter. A zero field takes its default; a negative one is
// refused by New, unless its comment gives negative a meaning.
type Config struct {
	// Brokers are the seed brokers (host:port); required.
	Brokers []string
	// Routes say which subjects go to which topic; required.
	Routes []Route
	// ClientID names the producer to the brokers. Default "millrace-export".
	ClientID string
	// Linger is how long a partition's batch waits for more records
	// before it is sent; with a backlog batches fill before it passes.
	// Default 10ms: at most that much lag for fewer, larger requests.
	Linger time.Duration
	// BatchMaxBytes caps one partition's batch, and so the largest record
	// (a larger one fails for good). Default 1 MiB: brokers accept about
	// 1 MiB by default (message.max.bytes). Topics the exporter creates get
	// max.message.bytes = BatchMaxBytes; BES events may be up to 4 MiB, so
	// a site that sends those raises both.
	BatchMaxBytes int32
	// MaxBufferedRecords bounds the records waiting for Kafka's ack; Send
	// blocks beyond it, which is what pauses export while the brokers are
	// away. Default 50,000.
	MaxBufferedRecords int
	// Compression: none, gzip, snappy, lz4 (default) or zstd.
	Compression string
	// Partitions and ReplicationFactor of the topics created when
	// CreateTopics is set. Zero: 12 partitions, and the brokers' default
	// replication factor; -1: the brokers' defaults; below -1 is refused.
	Partitions        int32
	ReplicationFactor int16
	// CreateTopics creates missing topics; otherwise EnsureTopics only
	// checks that they exist.
	CreateTopics bool
	// TLS, when set, is used for every broker connection.
	TLS *tls.Config
	// SASL: mechanism plain, scram-sha-256 or scram-sha-512 ("" none).
	SASLMechanism, SASLUser, SASLPassword string
	// Logger receives topic checks and creations. Nil: slog.Default().
	Logger *slog.Logger
}

// Validate reports what is wrong with c.
func (c Config) Validate() error {
	errs := []error{
		knob.NotNegative("kafka", "Linger", c.Linger, defaultLinger),
		knob.NotNegative("kafka", "BatchMaxBytes", c.BatchMaxBytes, defaultBatchMaxBytes),
		knob.NotNegative("kafka", "MaxBufferedRecords", c.MaxBufferedRecords, defaultMaxBufferedRecords),
	}
	if len(c.Brokers) == 0 {
		errs = append(errs, errors.New("kafka: no brokers"))
	}
	if len(c.Routes) == 0 {
		errs = append(errs, errors.New("kafka: no routes"))
	}
	if c.Partitions < -1 {
		errs = append(errs, fmt.Errorf("kafka: Partitions %d is below -1; set 0 for the default (%d), -1 for the brokers' default or a positive number", c.Partitions, defaultPartitions))
	}
	if c.ReplicationFactor < -1 {
		errs = append(errs, fmt.Errorf("kafka: ReplicationFactor %d is below -1; set 0 or -1 for the brokers' default, or a positive number", c.ReplicationFactor))
	}
	if _, err := compression(c.withDefaults().Compression); err != nil {
		errs = append(errs, err)
	}
	if _, err := mechanism(c); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// Defaults.
const (
	defaultLinger             = 10 * time.Millisecond
	defaultBatchMaxBytes      = 1 << 20
	defaultMaxBufferedRecords = 50_000
	defaultPartitions         = 12
)

func (c Config) withDefaults() Config {
	if c.ClientID == "" {
		c.ClientID = "millrace-export"
	}
	if c.Linger == 0 {
		c.Linger = defaultLinger
	}
	if c.BatchMaxBytes == 0 {
		c.BatchMaxBytes = defaultBatchMaxBytes
	}
	if c.MaxBufferedRecords == 0 {
		c.MaxBufferedRecords = defaultMaxBufferedRecords
	}
	if c.Compression == "" {
		c.Compression = "lz4"
	}
	if c.Partitions == 0 {
		c.Partitions = defaultPartitions
	}
	if c.ReplicationFactor == 0 {
		c.ReplicationFactor = -1
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func compression(name string) (kgo.CompressionCodec, error) {
	switch name {
	case "none":
		return kgo.NoCompression(), nil
	case "gzip":
		return kgo.GzipCompression(), nil
	case "snappy":
		return kgo.SnappyCompression(), nil
	case "lz4":
		return kgo.Lz4Compression(), nil
	case "zstd":
		return kgo.ZstdCompression(), nil
	}
	return kgo.CompressionCodec{}, fmt.Errorf("kafka: compression %q is not none, gzip, snappy, lz4 or zstd", name)
}

func mechanism(c Config) (sasl.Mechanism, error) {
	if c.SASLMechanism == "" {
		return nil, nil
	}
	if c.SASLUser == "" {
		return nil, fmt.Errorf("kafka: SASL %s needs a user", c.SASLMechanism)
	}
	switch strings.ToLower(c.SASLMechanism) {
	case "plain":
		return plain.Auth{User: c.SASLUser, Pass: c.SASLPassword}.AsMechanism(), nil
	case "scram-sha-256":
		return scram.Auth{User: c.SASLUser, Pass: c.SASLPassword}.AsSha256Mechanism(), nil
	case "scram-sha-512":
		return scram.Auth{User: c.SASLUser, Pass: c.SASLPassword}.AsSha512Mechanism(), nil
	}
	return nil, fmt.Errorf("kafka: SASL mechanism %q is not plain, scram-sha-256 or scram-sha-512", c.SASLMechanism)
}

// Exporter produces records to Kafka: idempotently, acknowledged by every
// in-sync replica, each message's subject as its key. Kafka's default
// partitioner hashes the key (murmur2, as Java clients do), so the messages
// of one subject — one invocation, node, pool or document — land on one
// partition in the order sent, and the idempotent producer keeps that
// order through retries.
type Exporter struct {
	cfg Config
	cl  *kgo.Client
	m   *Metrics
}

var _ projection.Exporter = (*Exporter)(nil)

// New connects an exporter (the brokers are dialled lazily: an outage at
// start is an outage like any other).
func New(cfg Config, m *Metrics) (*Exporter, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	codec, err := compression(cfg.Compression)
	if err != nil {
		return nil, err
	}
	mech, err := mechanism(cfg)
	if err != nil {
		return nil, err
	}
	if m == nil {
		m = NewMetrics(nil)
	}
	opts := []kgo.Opt{
		kgo.SeedBrokers(cfg.Brokers...),
		kgo.ClientID(cfg.ClientID),
		kgo.RequiredAcks(kgo.AllISRAcks()),
		kgo.ProducerLinger(cfg.Linger),
		kgo.ProducerBatchMaxBytes(cfg.BatchMaxBytes),
		kgo.MaxBufferedRecords(cfg.MaxBufferedRecords),
		kgo.ProducerBatchCompression(codec),
		kgo.RecordPartitioner(kgo.StickyKeyPartitioner(nil)),
		// Records are retried without end (franz-go's default): an outage
		// pauses export (Send blocks once the buffer is full) instead of
		// failing records. A record fails only for good (too large, not
		// authorized, its topic gone); the runner then stops and starts
		// again from the last acknowledged message.
	}
	if cfg.TLS != nil {
		opts = append(opts, kgo.DialTLSConfig(cfg.TLS))
	}
	if mech != nil {
		opts = append(opts, kgo.SASL(mech))
	}
	cl, err := kgo.NewClient(opts...)
	if err != nil {
		return nil, fmt.Errorf("kafka: %w", err)
	}
	return &Exporter{cfg: cfg, cl: cl, m: m}, nil
}

// Close flushes nothing: records not acknowledged are not acknowledged on
// the stream either, and are sent again by the next exporter.
func (e *Exporter) Close() { e.cl.Close() }

// Client is the exporter's franz-go client (tests read topics with it).
func (e *Exporter) Client() *kgo.Client { return e.cl }

// Topics are the distinct topics of the routes.
func (e *Exporter) Topics() []string {
	var out []string
	seen := map[string]bool{}
	for _, r := range e.cfg.Routes {
		if !seen[r.Topic] {
			seen[r.Topic] = true
			out = append(out, r.Topic)
		}
	}
	return out
}

// EnsureTopics creates the routes' missing topics (CreateTopics) or checks
// that they exist, and warns about an existing topic with fewer partitions
// than configured.
func (e *Exporter) EnsureTopics(ctx context.Context) error {
	adm := kadm.NewClient(e.cl)
	topics := e.Topics()
	details, err := adm.ListTopics(ctx, topics...)
	if err != nil {
		return fmt.Errorf("kafka: list topics: %w", err)
	}
	var missing []string
	for _, t := range topics {
		d, ok := details[t]
		if !ok || d.Err != nil {
			missing = append(missing, t)
			continue
		}
		if n := int32(len(d.Partitions)); e.cfg.Partitions > 0 && n < e.cfg.Partitions {
			e.cfg.Logger.Warn("topic has fewer partitions than configured", "topic", t, "partitions", n, "partitions_configured", e.cfg.Partitions)
		}
	}
	if len(missing) == 0 {
		return nil
	}
	if !e.cfg.CreateTopics {
		return fmt.Errorf("kafka: topics %s do not exist (create them, or turn topic creation on)", strings.Join(missing, ", "))
	}
	// A topic takes batches as large as the producer makes them: a BES
	// event may be up to 4 MiB, and raising BatchMaxBytes is then all it
	// takes for the topics the exporter creates.
	configs := map[string]*string{"max.message.bytes": kadm.StringPtr(strconv.Itoa(int(e.cfg.BatchMaxBytes)))}
	resp, err := adm.CreateTopics(ctx, e.cfg.Partitions, e.cfg.ReplicationFactor, configs, missing...)
	if err != nil {
		return fmt.Errorf("kafka: create topics: %w", err)
	}
	for _, t := range missing {
		r := resp[t]
		if r.Err != nil && !strings.Contains(r.Err.Error(), "TOPIC_ALREADY_EXISTS") {
			return fmt.Errorf("kafka: create topic %s: %w %s", t, r.Err, r.ErrMessage)
		}
		e.cfg.Logger.Info("topic created", "topic", t, "partitions", e.cfg.Partitions, "replication_factor", e.cfg.ReplicationFactor)
	}
	return nil
}

// Send produces r to its route's topic; done runs when Kafka acknowledged
// it (or the client gave up on it).
func (e *Exporter) Send(ctx context.Context, r *projection.Record, done func(error)) error {
	topic := topicFor(e.cfg.Routes, r.Subject)
	if topic == "" {
		return fmt.Errorf("kafka: no route takes subject %q", r.Subject)
	}
	rec := &kgo.Record{Topic: topic, Key: []byte(r.Subject), Value: r.Data, Timestamp: r.Time}
	rec.Headers = make([]kgo.RecordHeader, 0, len(r.Headers)+3)
	rec.Headers = append(rec.Headers,
		kgo.RecordHeader{Key: HeaderSubject, Value: []byte(r.Subject)},
		kgo.RecordHeader{Key: HeaderStream, Value: []byte(r.Stream)},
		kgo.RecordHeader{Key: HeaderSeq, Value: strconv.AppendUint(nil, r.Seq, 10)})
	for k, vs := range r.Headers {
		for _, v := range vs {
			rec.Headers = append(rec.Headers, kgo.RecordHeader{Key: k, Value: []byte(v)})
		}
	}
	start := time.Now()
	e.cl.Produce(ctx, rec, func(_ *kgo.Record, err error) {
		e.m.produced(topic, time.Since(start), err)
		done(err)
	})
	return nil
}

// Metrics of the exporter's producing.
type Metrics struct {
	records *prometheus.CounterVec
	latency *prometheus.HistogramVec
}

// NewMetrics registers the exporter's metrics with reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		records: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_kafka_records_total",
			Help: "Records produced to Kafka by topic and result (ok, error).",
		}, []string{"topic", "result"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "millrace_kafka_produce_seconds",
			Help:    "Time from handing a record to the producer to Kafka's acknowledgement (all in-sync replicas), by topic.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 16),
		}, []string{"topic"}),
	}
	if reg != nil {
		reg.MustRegister(m.records, m.latency)
	}
	return m
}

func (m *Metrics) produced(topic string, d time.Duration, err error) {
	if err != nil {
		m.records.WithLabelValues(topic, "error").Inc()
		return
	}
	m.records.WithLabelValues(topic, "ok").Inc()
	m.latency.WithLabelValues(topic).Observe(d.Seconds())
}
