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

// OutboxConfig tunes the outbox relay. Zero fields take the defaults.
type OutboxConfig struct {
	// Batch is the most rows read, published and deleted at a time.
	// Default 500.
	Batch int
	// PollEvery is how often an idle relay looks at the table when no
	// notification (NOTIFY on OutboxChannel, or Notify) wakes it.
	// Default 50ms.
	PollEvery time.Duration
	// RetryMin and RetryMax bound the backoff after a failed publish or
	// database error. Defaults 100ms and 5s.
	RetryMin, RetryMax time.Duration
	// StandbyEvery is how often a relay on standby tries to take the lead.
	// Default 2s.
	StandbyEvery time.Duration
	// Registerer, if set, receives the relay's metrics.
	Registerer prometheus.Registerer
	Logger     *slog.Logger
}

func (c OutboxConfig) withDefaults() OutboxConfig {
	if c.Batch <= 0 {
		c.Batch = 500
	}
	if c.PollEvery <= 0 {
		c.PollEvery = 50 * time.Millisecond
	}
	if c.RetryMin <= 0 {
		c.RetryMin = 100 * time.Millisecond
	}
	if c.RetryMax <= 0 {
		c.RetryMax = 5 * time.Second
	}
	if c.StandbyEvery <= 0 {
		c.StandbyEvery = 2 * time.Second
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate reports a configuration that cannot work.
func (c OutboxConfig) Validate() error {
	if c.Batch < 0 || c.PollEvery < 0 || c.RetryMin < 0 || c.RetryMax < 0 || c.StandbyEvery < 0 {
		return errors.New("outbox: batch and durations must not be negative")
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
//   - Order: one relay publishes at a time (a PostgreSQL advisory lock on
//     its connection, as the consumer runner holds), in id order,
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
// Waking: the relay LISTENs on OutboxChannel and polls every PollEvery;
// Notify wakes it from inside the process.
type Outbox struct {
	pool *pgxpool.Pool
	pub  OutboxPublisher
	cfg  OutboxConfig
	m    *outboxMetrics
	log  *slog.Logger
	wake chan struct{}

	conn *pgx.Conn // Run's own connection while it leads

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

// NewOutbox makes a relay of the outbox table in pool's database.
func NewOutbox(pool *pgxpool.Pool, pub OutboxPublisher, cfg OutboxConfig) *Outbox {
	cfg = cfg.withDefaults()
	return &Outbox{pool: pool, pub: pub, cfg: cfg, m: newOutboxMetrics(cfg.Registerer),
		log: cfg.Logger.With("component", "outbox"), wake: make(chan struct{}, 1), streams: map[string]string{}}
}

// Notify wakes the relay to look at the table now. It never blocks.
func (o *Outbox) Notify() {
	select {
	case o.wake <- struct{}{}:
	default:
	}
}

const outboxLockKey = "millrace.outbox"

// Run relays until ctx ends. A relay that cannot take the lead (another
// relay has it) waits on standby.
func (o *Outbox) Run(ctx context.Context) error {
	defer func() {
		o.closeConn(o.conn)
		o.conn = nil
	}()
	backoff := o.cfg.RetryMin
	standby := false
	last := newChain()
	for ctx.Err() == nil {
		if o.conn == nil {
			last.reset()
			conn, err := o.lead(ctx)
			if err != nil {
				if ctx.Err() != nil {
					break
				}
				if !errors.Is(err, ErrLocked) {
					o.log.Warn("cannot take the lead; retrying", "err", err)
				} else if !standby {
					o.log.Info("another relay publishes the outbox; standing by")
				}
				standby = true
				sleep(ctx, o.cfg.StandbyEvery)
				continue
			}
			if _, err := conn.Exec(ctx, "listen "+OutboxChannel); err != nil {
				o.closeConn(conn)
				o.log.Warn("listen failed; retrying", "err", err)
				sleep(ctx, o.cfg.RetryMin)
				continue
			}
			standby = false
			o.conn = conn
			o.m.active.Set(1)
			o.log.Info("relaying the outbox")
		}
		n, err := o.relay(ctx, o.conn, 0, last)
		if err != nil {
			if ctx.Err() != nil {
				break
			}
			last.reset()
			o.m.errors.Inc()
			o.log.Warn("outbox relay failed; retrying", "err", err, "backoff", backoff)
			if o.broken(o.conn) {
				o.closeConn(o.conn)
				o.conn = nil
			}
			sleep(ctx, backoff)
			backoff = min(2*backoff, o.cfg.RetryMax)
			continue
		}
		backoff = o.cfg.RetryMin
		if n < o.cfg.Batch {
			o.wait(ctx, o.conn)
		}
	}
	return nil
}

// lead takes a connection out of the pool and the relay's advisory lock on
// it; ErrLocked when another relay holds it. Closing the connection gives
// the lock (and LISTEN) up.
func (o *Outbox) lead(ctx context.Context) (*pgx.Conn, error) {
	pc, err := o.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("acquire connection: %w", err)
	}
	conn := pc.Hijack()
	var ok bool
	if err := conn.QueryRow(ctx, "select pg_try_advisory_lock(hashtextextended($1, 0))", outboxLockKey).Scan(&ok); err != nil {
		o.closeConn(conn)
		return nil, fmt.Errorf("take lock: %w", err)
	}
	if !ok {
		o.closeConn(conn)
		return nil, ErrLocked
	}
	return conn, nil
}

func (o *Outbox) closeConn(conn *pgx.Conn) {
	if conn == nil {
		return
	}
	if conn == o.conn {
		o.m.active.Set(0)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	conn.Close(ctx)
}

func (o *Outbox) broken(conn *pgx.Conn) bool {
	if conn.IsClosed() {
		return true
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	return conn.Ping(ctx) != nil
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
	stored, err := o.publish(ctx, conn, batch, last)
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
		if _, derr := conn.Exec(ctx, sqlOutboxDelete, ids); derr != nil {
			return 0, fmt.Errorf("delete published outbox rows: %w", derr)
		}
		o.m.lag.Set(time.Since(batch[stored-1].created).Seconds())
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
			o.m.published.WithLabelValues("skipped").Inc()
			continue
		}
		dup, err := f.Wait(ctx)
		switch {
		case err != nil && ctx.Err() != nil:
			return 0, ctx.Err()
		case err != nil:
			o.m.published.WithLabelValues("error").Inc()
			if stored < 0 {
				stored = i
				firstErr = fmt.Errorf("outbox row %d (%s): %w", batch[i].id, batch[i].msgID, err)
			}
		case dup:
			o.m.published.WithLabelValues("duplicate").Inc()
		default:
			o.m.published.WithLabelValues("stored").Inc()
			if stored >= 0 && sameStream(o, batch[i].subject, batch[stored].subject) {
				// The chain should have made this impossible.
				o.m.reordered.Inc()
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
	backoff := o.cfg.RetryMin
	for {
		var left bool
		if err := o.pool.QueryRow(ctx, "select exists (select 1 from outbox where id <= $1)", upTo).Scan(&left); err != nil {
			return fmt.Errorf("outbox flush: %w", err)
		}
		if !left {
			return nil
		}
		conn, err := o.lead(ctx)
		switch {
		case errors.Is(err, ErrLocked):
			if !sleep(ctx, o.cfg.PollEvery) {
				return ctx.Err()
			}
			continue
		case err != nil:
			return fmt.Errorf("outbox flush: %w", err)
		}
		last := newChain()
		for {
			n, err := o.relay(ctx, conn, upTo, last)
			if err == nil && n == 0 {
				break
			}
			if err != nil {
				last.reset()
				if ctx.Err() != nil {
					o.closeConn(conn)
					return ctx.Err()
				}
				o.m.errors.Inc()
				o.log.Warn("outbox flush failed; retrying", "err", err, "backoff", backoff)
				if o.broken(conn) {
					break
				}
				if !sleep(ctx, backoff) {
					o.closeConn(conn)
					return ctx.Err()
				}
				backoff = min(2*backoff, o.cfg.RetryMax)
			}
		}
		o.closeConn(conn)
	}
}

type outboxMetrics struct {
	published *prometheus.CounterVec
	errors    prometheus.Counter
	reordered prometheus.Counter
	lag       prometheus.Gauge
	active    prometheus.Gauge
}

func newOutboxMetrics(reg prometheus.Registerer) *outboxMetrics {
	m := &outboxMetrics{
		published: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "millrace_outbox_published_total",
			Help: "Outbox rows published, by outcome (stored, duplicate, error; skipped: found already stored after a restart, not sent).",
		}, []string{"outcome"}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_outbox_errors_total",
			Help: "Relay attempts that failed (backbone or database) and were retried.",
		}),
		reordered: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "millrace_outbox_reordered_total",
			Help: "Messages stored after an earlier message of their stream and batch failed (out of order; the expected-last-msg-id chain should make it 0).",
		}),
		lag: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_outbox_lag_seconds",
			Help: "Age of the newest outbox row when it was published and deleted.",
		}),
		active: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "millrace_outbox_active",
			Help: "1 while this process holds the outbox lock and relays, 0 on standby.",
		}),
	}
	if reg != nil {
		reg.MustRegister(m.published, m.errors, m.reordered, m.lag, m.active)
	}
	return m
}
