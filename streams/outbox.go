package streams

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	retry "github.com/millrace/millrace/internal/backoff"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/schemas/envelope"
)

// OutboxChannel is the PostgreSQL NOTIFY channel that writers of the outbox
// table signal in the transaction that writes rows, which PostgreSQL
// delivers when it commits:
//
//	select pg_notify('millrace_outbox', '')
//
// The relay LISTENs on it and publishes at once instead of at its next
// poll.
const OutboxChannel = "millrace_outbox"

// OutboxConfig tunes the outbox relay. Zero fields take the defaults;
// negative ones are refused (Validate).
type OutboxConfig struct {
	// Batch is the most rows read, published and deleted at a time.
	// Default 500.
	Batch int
	// PollEvery is how often an idle relay looks at the table when no
	// notification (NOTIFY on OutboxChannel, or Notify) wakes it: a
	// safety net, not how rows are found. Writers notify in the
	// transaction that writes rows, and the relay receives every
	// notification while it leads: it LISTENs on the connection that holds
	// its lease, and reads the table after it LISTENs, so a relay that lost
	// the connection lost the lead, and the next to lead reads what it
	// missed. Default 5s.
	PollEvery time.Duration
	// RetryMin and RetryMax bound the backoff after a failed publish or
	// database error. Defaults 100ms and 5s.
	RetryMin, RetryMax time.Duration
	// StandbyEvery is how often a relay on standby tries to take the lead.
	// Default 2s.
	StandbyEvery time.Duration
	// Registerer, if set, receives the relay's own metrics
	// (millrace_outbox_published_total, millrace_outbox_reordered_total).
	Registerer prometheus.Registerer
	// Metrics, if set, receives the consumer metrics of the relay
	// (millrace_consumer_*{consumer="outbox",kind="outbox"}).
	Metrics *Metrics
	Logger  *slog.Logger
}

// OutboxConfig's defaults.
const (
	DefaultOutboxBatch     = 500
	DefaultOutboxPollEvery = 5 * time.Second
	DefaultOutboxRetryMin  = 100 * time.Millisecond
	DefaultOutboxRetryMax  = 5 * time.Second
)

func (c OutboxConfig) withDefaults() OutboxConfig {
	if c.Batch == 0 {
		c.Batch = DefaultOutboxBatch
	}
	if c.PollEvery == 0 {
		c.PollEvery = DefaultOutboxPollEvery
	}
	if c.RetryMin == 0 {
		c.RetryMin = DefaultOutboxRetryMin
	}
	if c.RetryMax == 0 {
		c.RetryMax = DefaultOutboxRetryMax
	}
	if c.StandbyEvery == 0 {
		c.StandbyEvery = DefaultStandbyEvery
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports a configuration that cannot work: a negative field (a
// mistake, which taking the default would hide), or RetryMax below
// RetryMin.
func (c OutboxConfig) Validate() error {
	if err := errors.Join(
		knob.NotNegative("outbox", "Batch", c.Batch, DefaultOutboxBatch),
		knob.NotNegative("outbox", "PollEvery", c.PollEvery, DefaultOutboxPollEvery),
		knob.NotNegative("outbox", "RetryMin", c.RetryMin, DefaultOutboxRetryMin),
		knob.NotNegative("outbox", "RetryMax", c.RetryMax, DefaultOutboxRetryMax),
		knob.NotNegative("outbox", "StandbyEvery", c.StandbyEvery, DefaultStandbyEvery),
	); err != nil {
		return err
	}
	if c.RetryMin > 0 && c.RetryMax > 0 && c.RetryMax < c.RetryMin {
		return fmt.Errorf("outbox: RetryMax %v is below RetryMin %v", c.RetryMax, c.RetryMin)
	}
	return nil
}

// OutboxPublisher is what the relay needs of a *Publisher.
type OutboxPublisher interface {
	PublishAsync(msg *nats.Msg) (*Future, error)
	LastMsgID(ctx context.Context, subject string) (stream, msgID string, err error)
}

// LastMsgID names the stream that stores subject and returns the
// Nats-Msg-Id of its last message ("" when it is empty or the last message
// has none).
func (p *Publisher) LastMsgID(ctx context.Context, subject string) (stream, msgID string, err error) {
	stream, err = p.js.StreamNameBySubject(ctx, subject)
	if err != nil {
		return "", "", fmt.Errorf("%w: stream of %s: %v", ErrBackbone, subject, err)
	}
	s, err := p.js.Stream(ctx, stream)
	if err != nil {
		return "", "", fmt.Errorf("%w: stream %s: %v", ErrBackbone, stream, err)
	}
	st := s.CachedInfo().State
	if st.Msgs == 0 {
		return stream, "", nil
	}
	m, err := s.GetMsg(ctx, st.LastSeq)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return stream, "", nil
	}
	if err != nil {
		return "", "", fmt.Errorf("%w: last message of %s: %v", ErrBackbone, stream, err)
	}
	return stream, m.Header.Get(envelope.MsgID), nil
}

// Outbox relays the rows of the outbox table (migrations/003_fleet.sql) to
// JetStream: the transactional outbox. A writer inserts rows in the
// transaction whose effects they describe; the relay publishes them after
// that transaction committed, in id order, each with its msg_id as
// Nats-Msg-Id, and deletes them once JetStream has stored them.
//
// Guarantees:
//   - Nothing is lost: a row is deleted only after its publish was
//     acknowledged; a failed publish is retried with backoff, from the
//     first row not stored, for as long as it takes.
//   - At most one copy is stored: a crash between publish and delete
//     publishes again with the same Nats-Msg-Id, which JetStream drops
//     inside the stream's duplicate window (2 min by default).
//   - Order: one relay publishes at a time (a PGLease, an advisory lock on
//     the connection it reads and deletes on, as the runner's), in id order,
//     pipelined a batch at a time. Each message carries
//     Nats-Expected-Last-Msg-Id naming the message before it in its stream,
//     so when JetStream refuses one (a full stream, a leader change) it
//     refuses every later one of the batch too, instead of storing them
//     ahead of it; the batch is deleted up to the first refusal and
//     published again from there. JetStream checks duplicates first, so a
//     message published again is still a duplicate, not a refusal. The
//     relay must be the only writer of the streams it publishes to (a
//     foreign message costs one failed attempt). Rows are published in id
//     order, so writers must commit in id order: the placer writes from
//     one process (its consumer's lock), one transaction at a time.
//
// Waking: the relay LISTENs on OutboxChannel, and Notify wakes it from
// inside the process; it also looks every PollEvery, in case a writer
// does not notify.
type Outbox struct {
	pool  *pgxpool.Pool
	pub   OutboxPublisher
	cfg   OutboxConfig
	om    *outboxMetrics
	m     ConsumerMetrics
	log   *slog.Logger
	wake  chan struct{}
	lease *PGLease
	loop  Loop

	conn *pgx.Conn // Run's lease's connection while it leads
	last chain

	mu      sync.Mutex
	streams map[string]string // subject → stream
}

// chain is what the relay knows of the streams it publishes to; it is
// forgotten after any failure and read from the streams again.
type chain struct {
	// last is the msg id of the last message known stored, per stream.
	last map[string]string
	// through is, per stream, the id of the outbox row whose msg id was
	// the stream's last message when the chain was read: that row and
	// every row of the stream before it are stored already.
	through map[string]int64
}

func newChain() chain { return chain{last: map[string]string{}, through: map[string]int64{}} }

func (c chain) reset() {
	clear(c.last)
	clear(c.through)
}

// NewOutbox makes a relay of the outbox table in pool's database; it
// refuses a cfg that does not Validate.
func NewOutbox(pool *pgxpool.Pool, pub OutboxPublisher, cfg OutboxConfig) (*Outbox, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	o := &Outbox{pool: pool, pub: pub, cfg: cfg, om: newOutboxMetrics(cfg.Registerer), m: cfg.Metrics.Consumer(outboxName, KindOutbox),
		log: cfg.Logger.With("component", "outbox"), wake: make(chan struct{}, 1), streams: map[string]string{},
		lease: NewPGLease(pool, outboxLockKey), last: newChain()}
	o.loop = Loop{Name: outboxName, Kind: KindOutbox, Lease: o.lease, StandbyEvery: cfg.StandbyEvery, Metrics: o.m, Logger: o.log,
		Retry: retry.Backoff{Min: cfg.RetryMin, Max: cfg.RetryMax}}
	return o, nil
}

// Notify wakes the relay to look at the table now. It never blocks.
func (o *Outbox) Notify() {
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

const (
	outboxLockKey = "millrace.outbox"
	outboxName    = "outbox" // its consumer label
)

// Run relays until ctx ends. A relay that cannot take the lead (another
// relay has it) waits on standby.
func (o *Outbox) Run(ctx context.Context) error {
	o.loop.Run(ctx, Session{Begin: o.begin, Step: o.step, Retrying: "outbox relay failed; retrying"})
	return nil
}

// begin starts to lead: LISTEN on the lock's connection, and read the
// streams' chains afresh.
func (o *Outbox) begin(ctx context.Context, h Held) error {
	o.conn = h.(*PGHeld).Conn() // the outbox's lease is a PGLease
	o.last.reset()
	if _, err := o.conn.Exec(ctx, "listen "+OutboxChannel); err != nil {
		return fmt.Errorf("listen: %w", err)
	}
	o.log.Info("relaying the outbox")
	return nil
}

// step relays one batch, then waits for more when it was not full.
func (o *Outbox) step(ctx context.Context) error {
	n, err := o.relay(ctx, o.conn, 0, o.last)
	if err != nil {
		o.last.reset()
		o.m.Batch("error")
		return err
	}
	if n == 0 {
		o.m.Lag(0, 0) // caught up
	}
	if n < o.cfg.Batch {
		o.wait(ctx, o.conn)
	}
	return nil
}

// wait returns after PollEvery, or earlier on a notification or Notify.
func (o *Outbox) wait(ctx context.Context, conn *pgx.Conn) {
	wctx, cancel := context.WithTimeout(ctx, o.cfg.PollEvery)
	defer cancel()
	select {
	case <-o.wake:
		return
	default:
	}
	done := make(chan struct{})
	defer close(done)
	go func() {
		select {
		case <-o.wake:
			cancel()
		case <-done:
		}
	}()
	// A timeout leaves the connection usable (pgconn keeps it open on a
	// read deadline); any other error shows at the next query.
	conn.WaitForNotification(wctx)
}

type outboxRow struct {
	id      int64
	subject string
	msgID   string
	headers []byte
	body    []byte
	created time.Time
}

const (
	sqlOutboxBatch  = `select id, subject, msg_id, headers::text, body, created_at from outbox where id <= $2 order by id limit $1`
	sqlOutboxDelete = `delete from outbox o using unnest($1::bigint[]) as u(id) where o.id = u.id`
)

// relay publishes one batch (rows with id <= upTo, when upTo > 0) and
// deletes what was stored. It returns how many rows it read.
func (o *Outbox) relay(ctx context.Context, conn *pgx.Conn, upTo int64, last chain) (int, error) {
	if upTo <= 0 {
		upTo = 1<<63 - 1
	}
	rows, err := conn.Query(ctx, sqlOutboxBatch, o.cfg.Batch, upTo)
	if err != nil {
		return 0, fmt.Errorf("read outbox: %w", err)
	}
	var batch []outboxRow
	var r outboxRow
	var headers string
	if _, err := pgx.ForEachRow(rows, []any{&r.id, &r.subject, &r.msgID, &headers, &r.body, &r.created}, func() error {
		r.headers = []byte(headers)
		batch = append(batch, r)
		r.body = nil
		return nil
	}); err != nil {
		return 0, fmt.Errorf("read outbox: %w", err)
	}
	if len(batch) == 0 {
		return 0, nil
	}
	began := time.Now()
	stored, err := o.publish(ctx, conn, batch, last)
	o.m.Step("publish", time.Since(began))
	if ctx.Err() != nil {
		// Published perhaps, not deleted: the next relay publishes these
		// again and JetStream drops the duplicates.
		return 0, ctx.Err()
	}
	if stored > 0 {
		ids := make([]int64, stored)
		for i := range ids {
			ids[i] = batch[i].id
		}
		began := time.Now()
		if _, derr := conn.Exec(ctx, sqlOutboxDelete, ids); derr != nil {
			return 0, fmt.Errorf("delete published outbox rows: %w", derr)
		}
		o.m.Step("delete", time.Since(began))
		o.m.Batch("published")
		o.published(ctx, conn, batch[stored-1], len(batch) == o.cfg.Batch)
	}
	if err != nil {
		return 0, err
	}
	return len(batch), nil
}

// publish sends the batch pipelined, each message chained to the one
// before it in its stream, and waits for every acknowledgement. It returns
// how many rows from the start were stored (or were duplicates of stored
// messages, or known stored and skipped) and the first error.
func (o *Outbox) publish(ctx context.Context, conn *pgx.Conn, batch []outboxRow, last chain) (int, error) {
	futures := make([]*Future, 0, len(batch)) // nil: known stored, not sent
	var sendErr error
	for i := range batch {
		r := &batch[i]
		msg, err := r.message()
		if err != nil {
			sendErr = fmt.Errorf("outbox row %d: %w", r.id, err)
			break
		}
		stream, ok := o.streamOf(r.subject)
		if _, known := last.last[stream]; !ok || !known {
			var lastID string
			if stream, lastID, err = o.pub.LastMsgID(ctx, r.subject); err != nil {
				sendErr = fmt.Errorf("outbox row %d: %w", r.id, err)
				break
			}
			o.mu.Lock()
			o.streams[r.subject] = stream
			o.mu.Unlock()
			if _, known := last.last[stream]; !known {
				through, err := storedThrough(ctx, conn, lastID)
				if err != nil {
					sendErr = fmt.Errorf("outbox row %d: %w", r.id, err)
					break
				}
				last.last[stream], last.through[stream] = lastID, through
			}
		}
		if r.id <= last.through[stream] {
			// Stored already: a relay that stopped between publish and
			// delete for longer than the stream's duplicate window would
			// otherwise store these again, since JetStream no longer knows
			// their msg ids and the chain names the stream's last message.
			futures = append(futures, nil)
			continue
		}
		if prev := last.last[stream]; prev != "" {
			msg.Header.Set(jetstream.ExpectedLastMsgIDHeader, prev)
		}
		f, err := o.pub.PublishAsync(msg)
		if err != nil {
			sendErr = fmt.Errorf("outbox row %d: %w", r.id, err)
			break
		}
		last.last[stream] = r.msgID
		futures = append(futures, f)
	}
	stored := -1
	var firstErr error
	for i, f := range futures {
		if f == nil {
			o.om.published.WithLabelValues("skipped").Inc()
			continue
		}
		dup, err := f.Wait(ctx)
		switch {
		case err != nil && ctx.Err() != nil:
			return 0, ctx.Err()
		case err != nil:
			o.om.published.WithLabelValues("error").Inc()
			if stored < 0 {
				stored = i
				firstErr = fmt.Errorf("outbox row %d (%s): %w", batch[i].id, batch[i].msgID, err)
			}
		case dup:
			o.om.published.WithLabelValues("duplicate").Inc()
		default:
			o.om.published.WithLabelValues("stored").Inc()
			if stored >= 0 && sameStream(o, batch[i].subject, batch[stored].subject) {
				// The chain should have made this impossible.
				o.om.reordered.Inc()
				o.log.Error("outbox message stored after an earlier one of its stream failed: the stream holds them out of order",
					"row", batch[i].id, "msg_id", batch[i].msgID, "failed_row", batch[stored].id)
			}
		}
	}
	if stored >= 0 {
		return stored, firstErr
	}
	if sendErr != nil {
		last.reset()
	}
	return len(futures), sendErr
}

// storedThrough returns the id of the outbox row whose msg id is lastID, the
// last message of a stream the relay publishes to, or 0. The relay is the
// only writer of its streams and publishes in id order, so that row and
// every row of its stream before it are stored. The lookup scans the table
// (no index on msg_id), which holds only rows not yet deleted; it runs
// once per stream each time the relay reads its chain (taking the lead,
// after a failure).
func storedThrough(ctx context.Context, conn *pgx.Conn, lastID string) (int64, error) {
	if lastID == "" {
		return 0, nil
	}
	var id int64
	err := conn.QueryRow(ctx, "select coalesce(max(id), 0) from outbox where msg_id = $1", lastID).Scan(&id)
	if err != nil {
		return 0, fmt.Errorf("find the stream's last message in the outbox: %w", err)
	}
	return id, nil
}

func (o *Outbox) streamOf(subject string) (string, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	s, ok := o.streams[subject]
	return s, ok
}

func sameStream(o *Outbox, a, b string) bool {
	sa, _ := o.streamOf(a)
	sb, _ := o.streamOf(b)
	return sa == sb
}

// message builds the NATS message of a row.
func (r *outboxRow) message() (*nats.Msg, error) {
	msg := nats.NewMsg(r.subject)
	if len(r.headers) > 0 {
		var h map[string]any
		if err := json.Unmarshal(r.headers, &h); err != nil {
			return nil, fmt.Errorf("headers: %w", err)
		}
		for k, v := range h {
			switch v := v.(type) {
			case string:
				msg.Header.Set(k, v)
			case []any:
				for _, x := range v {
					msg.Header.Add(k, fmt.Sprint(x))
				}
			default:
				msg.Header.Set(k, fmt.Sprint(v))
			}
		}
	}
	msg.Header.Set(envelope.MsgID, r.msgID)
	msg.Data = r.body
	return msg, nil
}

// published records where the relay is after it deleted the rows up to
// last: its id, its age, and (after a full batch, when more may wait) how
// many ids are left above it.
func (o *Outbox) published(ctx context.Context, conn *pgx.Conn, last outboxRow, full bool) {
	o.m.Position(uint64(last.id))
	var left int64
	if full {
		var top int64
		if err := conn.QueryRow(ctx, "select coalesce(max(id), 0) from outbox").Scan(&top); err == nil && top > last.id {
			left = top - last.id
		}
	}
	o.m.Lag(time.Since(last.created), uint64(left))
}

// flushEvery is how often Flush looks whether the relay that leads has
// drained the rows: a replay waits on it, so it is short, unlike the
// relay's own PollEvery, which notifications make a safety net.
const flushEvery = 50 * time.Millisecond

// Flush publishes every row in the outbox when it is called and returns
// once they are all stored (replay calls it before it resets the tables
// the rows describe). When another relay leads, Flush waits for it to
// drain them; otherwise it takes the lead for the time it needs.
func (o *Outbox) Flush(ctx context.Context) error {
	var upTo int64
	if err := o.pool.QueryRow(ctx, "select coalesce(max(id), 0) from outbox").Scan(&upTo); err != nil {
		return fmt.Errorf("outbox flush: %w", err)
	}
	if upTo == 0 {
		return nil
	}
	for {
		var left bool
		if err := o.pool.QueryRow(ctx, "select exists (select 1 from outbox where id <= $1)", upTo).Scan(&left); err != nil {
			return fmt.Errorf("outbox flush: %w", err)
		}
		if !left {
			return nil
		}
		h, err := o.lease.AcquirePG(ctx)
		switch {
		case errors.Is(err, ErrLocked):
			if !retry.Sleep(ctx, flushEvery) {
				return ctx.Err()
			}
			continue
		case err != nil:
			return fmt.Errorf("outbox flush: %w", err)
		}
		err = o.flushHeld(ctx, h, upTo)
		releaseHeld(h)
		if err != nil {
			return err
		}
	}
}

// flushHeld relays rows up to upTo while it holds h; it returns nil when
// none is left or the lease is lost (Flush then leads again).
func (o *Outbox) flushHeld(ctx context.Context, h *PGHeld, upTo int64) error {
	wait := retry.Backoff{Min: o.cfg.RetryMin, Max: o.cfg.RetryMax}
	last := newChain()
	for {
		n, err := o.relay(ctx, h.Conn(), upTo, last)
		if err == nil && n == 0 {
			return nil
		}
		if err == nil {
			wait.Reset()
			continue
		}
		last.reset()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		o.m.Batch("error")
		if h.Fence(ctx) != nil {
			return nil
		}
		d := wait.Next()
		o.log.Warn("outbox flush failed; retrying", "err", err, "retry_in", d)
		if !retry.Sleep(ctx, d) {
			return ctx.Err()
		}
	}
}

// outboxMetrics are the relay's own: what became of each row. The
// consumer metrics (lead, position, lag, errors) are the core's.
type outboxMetrics struct {
	published *prometheus.CounterVec
	reordered prometheus.Counter
}

func newOutboxMetrics(reg prometheus.Registerer) *outboxMetrics {
	m := &outboxMetrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_outbox_published_total",
			Help: "Outbox rows published, by outcome (stored, duplicate, error; skipped: found already stored after a restart, not sent).",
		}, []string{"outcome"}),
		reordered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_outbox_reordered_total",
			Help: "Messages stored after an earlier message of their stream and batch failed (out of order; the expected-last-msg-id chain should make it 0).",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.published, m.reordered)
	}
	return m
}
