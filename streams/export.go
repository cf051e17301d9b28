package streams

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
)

// ExportConfig tunes an ExportRunner. Zero fields take the defaults.
type ExportConfig struct {
	// Stream is the stream exported; Filters the subjects of it that are
	// (empty: all of them).
	Stream  string
	Filters []string
	// Durable names the consumer whose ack floor is the export's position.
	// Default "export-<stream>" in lower case.
	Durable string
	// MaxInFlight bounds the messages sent and not yet acknowledged by the
	// other system (the consumer's MaxAckPending). Default 20,000.
	MaxInFlight int
	// AckEvery is how often the acknowledged prefix is acked on the
	// stream (one ack covers it all). Default 20ms.
	AckEvery time.Duration
	// RetryMin and RetryMax bound the pause before a failed session
	// starts again from the ack floor. Defaults 1s and 30s.
	RetryMin, RetryMax time.Duration
	Logger             *slog.Logger
}

func (c ExportConfig) withDefaults() ExportConfig {
	if c.Durable == "" {
		c.Durable = "export-" + strings.ToLower(c.Stream)
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = 20_000
	}
	if c.AckEvery <= 0 {
		c.AckEvery = 20 * time.Millisecond
	}
	if c.RetryMin <= 0 {
		c.RetryMin = time.Second
	}
	if c.RetryMax <= 0 {
		c.RetryMax = 30 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// exportAckWait is how long JetStream waits for the ack of a delivered
// message. A session dedupes redeliveries itself, and a new session starts
// from the ack floor at once, so this only has to be longer than an
// outage is likely to be: a redelivery costs a message read, not a record.
const exportAckWait = 10 * time.Minute

// ExportRunner copies one stream to an Exporter. Its position is a durable
// consumer's ack floor: a message is acked (AckAll, the highest message of
// the acknowledged prefix) only once the exporter reported it and every
// message before it durable. A session that fails, and a new process,
// reset the consumer to its ack floor, so they resume at once rather than
// after the ack wait. Messages sent but not
// acknowledged when a session failed or the process died are sent again:
// the only duplicates, with the same stream sequence.
//
// Run one exporter per stream and durable name: a second would take the
// consumer away from the first.
type ExportRunner struct {
	js  jetstream.JetStream
	exp projection.Exporter
	cfg ExportConfig
	m   *ExportMetrics
	log *slog.Logger
}

// NewExportRunner makes a runner of exp over cfg.Stream.
func NewExportRunner(js jetstream.JetStream, exp projection.Exporter, cfg ExportConfig, m *ExportMetrics) *ExportRunner {
	cfg = cfg.withDefaults()
	if m == nil {
		m = NewExportMetrics(nil)
	}
	return &ExportRunner{js: js, exp: exp, cfg: cfg, m: m, log: cfg.Logger.With("stream", cfg.Stream, "consumer", cfg.Durable)}
}

// Run exports until ctx ends, starting each failed session again.
func (r *ExportRunner) Run(ctx context.Context) error {
	backoff := r.cfg.RetryMin
	for {
		start := time.Now()
		err := r.session(ctx)
		if ctx.Err() != nil {
			return nil
		}
		r.m.errors.WithLabelValues(r.cfg.Stream).Inc()
		if time.Since(start) > 2*r.cfg.RetryMax {
			backoff = r.cfg.RetryMin // it ran for a while: a new failure
		}
		r.log.Warn("export paused; it starts again from the last acknowledged message", "err", err, "retry_in", backoff)
		if !sleep(ctx, backoff) {
			return nil
		}
		backoff = min(2*backoff, r.cfg.RetryMax)
	}
}

// consumer creates the durable consumer, or resets the existing one to
// deliver again from its ack floor (nothing in flight survives a session),
// and returns the floor. The consumer is never deleted: its floor is the
// export's position, and the compactor reads it.
func (r *ExportRunner) consumer(ctx context.Context) (jetstream.Consumer, uint64, error) {
	stream, err := r.js.Stream(ctx, r.cfg.Stream)
	if err != nil {
		return nil, 0, fmt.Errorf("the %s stream: %w", r.cfg.Stream, err)
	}
	cfg := jetstream.ConsumerConfig{
		Durable:       r.cfg.Durable,
		Description:   "millrace export; its ack floor is the export's position",
		AckPolicy:     jetstream.AckAllPolicy,
		AckWait:       exportAckWait,
		MaxAckPending: r.cfg.MaxInFlight,
		MaxDeliver:    -1,
		DeliverPolicy: jetstream.DeliverAllPolicy,
	}
	switch len(r.cfg.Filters) {
	case 0:
	case 1:
		cfg.FilterSubject = r.cfg.Filters[0]
	default:
		cfg.FilterSubjects = r.cfg.Filters
	}
	old, err := stream.Consumer(ctx, r.cfg.Durable)
	switch {
	case errors.Is(err, jetstream.ErrConsumerNotFound):
		cons, err := stream.CreateConsumer(ctx, cfg)
		if err != nil {
			return nil, 0, fmt.Errorf("create consumer: %w", err)
		}
		return cons, 0, nil
	case err != nil:
		return nil, 0, fmt.Errorf("consumer: %w", err)
	}
	// Where it starts cannot change; the rest (filters, limits) can.
	was := old.CachedInfo().Config
	cfg.DeliverPolicy, cfg.OptStartSeq, cfg.OptStartTime = was.DeliverPolicy, was.OptStartSeq, was.OptStartTime
	if _, err := stream.UpdateConsumer(ctx, cfg); err != nil {
		return nil, 0, fmt.Errorf("update consumer: %w", err)
	}
	reset, err := r.js.ResetConsumer(ctx, r.cfg.Stream, r.cfg.Durable)
	if err != nil {
		return nil, 0, fmt.Errorf("reset consumer to its ack floor: %w", err)
	}
	cons, err := stream.Consumer(ctx, r.cfg.Durable)
	if err != nil {
		return nil, 0, fmt.Errorf("consumer: %w", err)
	}
	floor := uint64(0)
	if reset.ConsumerInfo != nil {
		floor = reset.ConsumerInfo.AckFloor.Stream
	}
	return cons, floor, nil
}

// inFlight is one message sent and not yet acked on the stream.
type inFlight struct {
	seq    uint64
	msg    jetstream.Msg
	stored time.Time
	done   atomic.Bool
}

// session exports from the ack floor until something fails.
func (r *ExportRunner) session(ctx context.Context) error {
	cons, floor, err := r.consumer(ctx)
	if err != nil {
		return err
	}
	it, err := cons.Messages(jetstream.PullMaxMessages(min(r.cfg.MaxInFlight, 1000)))
	if err != nil {
		return fmt.Errorf("messages: %w", err)
	}
	r.log.Info("exporting", "from", floor+1)

	sctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	var (
		mu      sync.Mutex
		window  []*inFlight // delivered and not yet acked, in stream order
		pending atomic.Int64
		sent    sync.WaitGroup
		acked   atomic.Uint64
	)
	acked.Store(floor)
	wake := make(chan struct{}, 1)
	ackerDone := make(chan struct{})
	go func() {
		defer close(ackerDone)
		t := time.NewTicker(r.cfg.AckEvery)
		defer t.Stop()
		for {
			select {
			case <-t.C:
			case <-wake:
			case <-sctx.Done():
			}
			mu.Lock()
			n := 0
			for n < len(window) && window[n].done.Load() {
				n++
			}
			var last *inFlight
			if n > 0 {
				last = window[n-1]
				clear(window[:n])
				window = window[n:]
			}
			lag := 0.0
			if len(window) > 0 {
				lag = time.Since(window[0].stored).Seconds()
			}
			inWindow := len(window)
			mu.Unlock()
			if last != nil {
				// One ack covers the prefix (AckAll). A lost ack is
				// answered by the redelivery check below.
				if err := last.msg.Ack(); err != nil && sctx.Err() == nil {
					r.log.Debug("ack", "seq", last.seq, "err", err)
				}
				acked.Store(last.seq)
				r.m.position.WithLabelValues(r.cfg.Stream).Set(float64(last.seq))
			}
			r.m.lagSeconds.WithLabelValues(r.cfg.Stream).Set(lag)
			r.m.lagMessages.WithLabelValues(r.cfg.Stream).Set(float64(pending.Load() + int64(inWindow)))
			if sctx.Err() != nil {
				return
			}
		}
	}()
	defer func() {
		it.Stop()
		// After a failure, whatever is in flight finishes (acknowledged or
		// failed) before the next session sends it again: its records stay
		// ahead of the resends in their partitions. On shutdown nothing
		// waits (Kafka may be away): what is not acknowledged is sent again
		// by the next process, as after a crash.
		if ctx.Err() == nil {
			sent.Wait()
		}
		cancel(nil)
		<-ackerDone
	}()

	var delivered uint64 = floor
	for {
		msg, err := it.Next(jetstream.NextContext(sctx))
		if err != nil {
			if cause := context.Cause(sctx); cause != nil && !errors.Is(cause, context.Canceled) {
				return cause
			}
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("next message: %w", err)
		}
		meta, err := msg.Metadata()
		if err != nil {
			return fmt.Errorf("message metadata: %w", err)
		}
		seq := meta.Sequence.Stream
		if seq <= delivered {
			// A redelivery (the ack wait passed during an outage, or an
			// ack was lost): in flight already, or acknowledged.
			if seq <= acked.Load() {
				msg.Ack()
			}
			continue
		}
		delivered = seq
		pending.Store(int64(meta.NumPending))
		f := &inFlight{seq: seq, msg: msg, stored: meta.Timestamp}
		mu.Lock()
		window = append(window, f)
		mu.Unlock()
		hdr := msg.Headers()
		rec := &projection.Record{Stream: r.cfg.Stream, Subject: msg.Subject(), Seq: seq, Time: meta.Timestamp,
			MsgID: hdr.Get(envelope.MsgID), Headers: hdr, Data: msg.Data()}
		sent.Add(1)
		stored := meta.Timestamp
		err = r.exp.Send(sctx, rec, func(err error) {
			defer sent.Done()
			if err != nil {
				cancel(fmt.Errorf("message %d (%s): %w", seq, rec.Subject, err))
				return
			}
			r.m.delay.WithLabelValues(r.cfg.Stream).Observe(time.Since(stored).Seconds())
			r.m.exported.WithLabelValues(r.cfg.Stream).Inc()
			f.done.Store(true)
			select {
			case wake <- struct{}{}:
			default:
			}
		})
		if err != nil {
			sent.Done()
			return fmt.Errorf("message %d (%s): %w", seq, rec.Subject, err)
		}
	}
}

// ExportMetrics of export runners, by stream.
type ExportMetrics struct {
	exported    *prometheus.CounterVec
	errors      *prometheus.CounterVec
	delay       *prometheus.HistogramVec
	lagSeconds  *prometheus.GaugeVec
	lagMessages *prometheus.GaugeVec
	position    *prometheus.GaugeVec
}

// NewExportMetrics registers export metrics with reg (nil: unregistered).
func NewExportMetrics(reg prometheus.Registerer) *ExportMetrics {
	m := &ExportMetrics{
		exported: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_export_messages_total",
			Help: "Stream messages the other system acknowledged, by stream.",
		}, []string{"stream"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_export_errors_total",
			Help: "Export sessions that failed and started again from the ack floor, by stream.",
		}, []string{"stream"}),
		delay: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "millrace_export_delay_seconds",
			Help:    "Time from a message's storing in JetStream to its acknowledgement by the other system, by stream.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 18),
		}, []string{"stream"}),
		lagSeconds: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_export_lag_seconds",
			Help: "Age of the oldest message sent and not yet acknowledged (0: none), by stream.",
		}, []string{"stream"}),
		lagMessages: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_export_lag_messages",
			Help: "Messages of the stream not yet acknowledged by the other system: in flight plus not yet read, by stream.",
		}, []string{"stream"}),
		position: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "millrace_export_position",
			Help: "The stream sequence up to which every message is exported, by stream.",
		}, []string{"stream"}),
	}
	if reg != nil {
		reg.MustRegister(m.exported, m.errors, m.delay, m.lagSeconds, m.lagMessages, m.position)
	}
	return m
}
