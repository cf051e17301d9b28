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

	retry "github.com/millrace/millrace/internal/backoff"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
)

// ExportConfig tunes an ExportRunner. Zero fields take the defaults;
// negative ones are refused (Validate).
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
	// StandbyEvery is how often an exporter on standby (another process
	// holds the export's lease) tries to take it. Default 2s.
	StandbyEvery time.Duration
	// Metrics, if set, receives the consumer metrics of the export
	// (millrace_consumer_*{consumer=<Durable>,kind="export"}).
	Metrics *Metrics
	Logger  *slog.Logger
}

// ExportConfig's defaults.
const (
	DefaultExportMaxInFlight = 20_000
	DefaultExportAckEvery    = 20 * time.Millisecond
	DefaultExportRetryMin    = time.Second
	DefaultExportRetryMax    = 30 * time.Second
)

func (c ExportConfig) withDefaults() ExportConfig {
	if c.Durable == "" {
		c.Durable = "export-" + strings.ToLower(c.Stream)
	}
	if c.MaxInFlight == 0 {
		c.MaxInFlight = DefaultExportMaxInFlight
	}
	if c.AckEvery == 0 {
		c.AckEvery = DefaultExportAckEvery
	}
	if c.RetryMin == 0 {
		c.RetryMin = DefaultExportRetryMin
	}
	if c.RetryMax == 0 {
		c.RetryMax = DefaultExportRetryMax
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate refuses a negative field: a mistake, which taking the default
// would hide.
func (c ExportConfig) Validate() error {
	return errors.Join(
		knob.NotNegative("export", "MaxInFlight", c.MaxInFlight, DefaultExportMaxInFlight),
		knob.NotNegative("export", "AckEvery", c.AckEvery, DefaultExportAckEvery),
		knob.NotNegative("export", "RetryMin", c.RetryMin, DefaultExportRetryMin),
		knob.NotNegative("export", "RetryMax", c.RetryMax, DefaultExportRetryMax),
		knob.NotNegative("export", "StandbyEvery", c.StandbyEvery, DefaultStandbyEvery),
	)
}

// exportAckWait is how long JetStream waits for the ack of a delivered
// message. A session dedupes redeliveries itself, and a new session starts
// from the ack floor at once, so this only has to be longer than an
// outage is likely to be: a redelivery costs a message read, not a record.
const exportAckWait = 10 * time.Minute

// ExportRunner is the consumer core's user for exports: it copies one
// stream to an Exporter. Its position is a durable consumer's ack floor: a
// message is acked (AckAll, the highest message of the acknowledged
// prefix) only once the exporter reported it and every message before it
// durable, and only while the export holds its lease (Fence before each
// ack). One process leads each durable by a KVLease (key
// export.<durable>); others stand by. A session that fails, and a new
// leader, attach the consumer at its ack floor, so they resume at once
// rather than after the ack wait. Messages sent but not acknowledged when
// a session failed or the process died are sent again: the only
// duplicates, with the same stream sequence.
type ExportRunner struct {
	js   jetstream.JetStream
	exp  projection.Exporter
	cfg  ExportConfig
	m    *ExportMetrics
	cm   ConsumerMetrics
	log  *slog.Logger
	loop Loop
	held Held
	// acked is the highest sequence this process acked: every message up
	// to it is in the other system.
	acked atomic.Uint64
}

// NewExportRunner makes a runner of exp over cfg.Stream; it refuses a cfg
// that does not Validate.
func NewExportRunner(js jetstream.JetStream, exp projection.Exporter, cfg ExportConfig, m *ExportMetrics) (*ExportRunner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	if m == nil {
		m = NewExportMetrics(nil)
	}
	r := &ExportRunner{js: js, exp: exp, cfg: cfg, m: m, cm: cfg.Metrics.Consumer(cfg.Durable, KindExport),
		log: cfg.Logger.With("stream", cfg.Stream, "consumer", cfg.Durable)}
	r.loop = Loop{Name: cfg.Durable, Kind: KindExport, Lease: NewKVLease(js, ExportLeaseKey(cfg.Durable)),
		StandbyEvery: cfg.StandbyEvery, Metrics: r.cm, Logger: r.log,
		Retry: retry.Backoff{Min: cfg.RetryMin, Max: cfg.RetryMax}}
	return r, nil
}

// ExportLeaseKey is the key of durable's lease in LeaseBucket.
func ExportLeaseKey(durable string) string { return "export." + durable }

// Run exports until ctx ends, starting each failed session again.
func (r *ExportRunner) Run(ctx context.Context) error {
	r.loop.Run(ctx, Session{
		Begin:    func(_ context.Context, h Held) error { r.held = h; return nil },
		Step:     r.step,
		Retrying: "export paused; it starts again from the last acknowledged message",
	})
	return nil
}

// step is one session; a failed one counts as a batch in error.
func (r *ExportRunner) step(ctx context.Context) error {
	err := r.session(ctx)
	if err != nil && ctx.Err() == nil {
		r.cm.Batch("error")
	}
	return err
}

// consumer attaches the durable consumer at its ack floor (nothing in
// flight survives a session), or where this process last acked when that
// is later (the consumer was deleted under it), and returns the floor. The
// consumer is never deleted: its floor is the export's position, and the
// compactor reads it.
func (r *ExportRunner) consumer(ctx context.Context) (jetstream.Consumer, uint64, error) {
	cfg := jetstream.ConsumerConfig{
		Durable:       r.cfg.Durable,
		Description:   "millrace export; its ack floor is the export's position",
		AckWait:       exportAckWait,
		MaxAckPending: r.cfg.MaxInFlight,
		MaxDeliver:    -1,
	}
	switch len(r.cfg.Filters) {
	case 0:
	case 1:
		cfg.FilterSubject = r.cfg.Filters[0]
	default:
		cfg.FilterSubjects = r.cfg.Filters
	}
	cons, from, err := Attach(ctx, r.js, r.cfg.Stream, KindExport, cfg, Position{Next: r.acked.Load() + 1, AfterFloor: true}, r.log)
	if err != nil {
		return nil, 0, err
	}
	return cons, from - 1, nil
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
	)
	r.acked.Store(floor)
	wake := make(chan struct{}, 1)
	ackerDone := make(chan struct{})
	a := &acker{r: r, mu: &mu, window: &window, pending: &pending}
	go func() {
		defer close(ackerDone)
		ackLoop(sctx, r.cfg.AckEvery, wake, a.busy, func() { a.ack(sctx) })
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
			if seq <= r.acked.Load() {
				msg.Ack()
			}
			continue
		}
		delivered = seq
		pending.Store(int64(meta.NumPending))
		f := &inFlight{seq: seq, msg: msg, stored: meta.Timestamp}
		mu.Lock()
		first := len(window) == 0
		window = append(window, f)
		mu.Unlock()
		if first { // the acker ticks again, for the lag of what is in flight
			select {
			case wake <- struct{}{}:
			default:
			}
		}
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

// ackLoop calls ack at once on wake (something was acknowledged by the
// other system, or the window was empty and is not), every `every` while
// busy says something is in flight (its lag grows, a fence that could not
// be read is tried again), and once more when ctx ends. An export with
// nothing in flight does not tick: a wakeup every 20 ms per export was
// most of what an idle process with exports did.
func ackLoop(ctx context.Context, every time.Duration, wake <-chan struct{}, busy func() bool, ack func()) {
	t := time.NewTicker(every)
	defer t.Stop()
	for {
		var tick <-chan time.Time // a ticker no one waits on costs nothing
		if busy() {
			tick = t.C
		}
		select {
		case <-tick:
		case <-wake:
		case <-ctx.Done():
		}
		ack()
		if ctx.Err() != nil {
			return
		}
	}
}

// acker acks the acknowledged prefix of a session's window.
type acker struct {
	r       *ExportRunner
	mu      *sync.Mutex
	window  *[]*inFlight // delivered and not yet acked, in stream order
	pending *atomic.Int64
}

// busy says whether anything is in flight.
func (a *acker) busy() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(*a.window) > 0
}

// ack acks the longest prefix of the window the other system has
// acknowledged, if the lease still holds: a process that lost it must not
// move the position (another leads from it now). One ack covers the
// prefix (AckAll); a lost ack is answered by the session's redelivery
// check.
func (a *acker) ack(ctx context.Context) {
	a.mu.Lock()
	w := *a.window
	n := 0
	for n < len(w) && w[n].done.Load() {
		n++
	}
	lag := 0.0
	if n < len(w) {
		lag = time.Since(w[n].stored).Seconds()
	}
	left := len(w) - n
	a.mu.Unlock()
	a.r.cm.Lag(time.Duration(lag*float64(time.Second)), uint64(a.pending.Load()+int64(left)))
	if n == 0 {
		return
	}
	// The last round runs after the session's context ended: on shutdown
	// the lease still holds until it is released, and what the other
	// system acknowledged is acked.
	began := time.Now()
	fctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
	err := a.r.held.Fence(fctx)
	cancel()
	a.r.cm.Step("fence", time.Since(began))
	if err != nil {
		a.r.log.Warn("not acking: the export's lease cannot be confirmed", "err", err)
		return // lost: the session's context ends; unreadable: the next round tries again
	}
	a.mu.Lock()
	last := (*a.window)[n-1]
	clear((*a.window)[:n])
	*a.window = (*a.window)[n:]
	a.mu.Unlock()
	if err := last.msg.Ack(); err != nil {
		a.r.log.Debug("ack", "seq", last.seq, "err", err)
	}
	a.r.acked.Store(last.seq)
	a.r.cm.Position(last.seq)
	a.r.cm.Batch("acked")
}

// ExportMetrics of export runners, by stream: what the other system
// acknowledged, and how long it took. The consumer metrics (lead,
// position, lag, failed sessions) are the core's (ExportConfig.Metrics).
type ExportMetrics struct {
	exported *prometheus.CounterVec
	delay    *prometheus.HistogramVec
}

// NewExportMetrics registers export metrics with reg (nil: unregistered).
func NewExportMetrics(reg prometheus.Registerer) *ExportMetrics {
	m := &ExportMetrics{
		exported: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_export_messages_total",
			Help: "Stream messages the other system acknowledged, by stream.",
		}, []string{"stream"}),
		delay: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "millrace_export_delay_seconds",
			Help:    "Time from a message's storing in JetStream to its acknowledgement by the other system, by stream.",
			Buckets: prometheus.ExponentialBuckets(0.001, 2, 18),
		}, []string{"stream"}),
	}
	if reg != nil {
		reg.MustRegister(m.exported, m.delay)
	}
	return m
}
