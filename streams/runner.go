package streams

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	retry "github.com/millrace/millrace/internal/backoff"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// RunnerConfig tunes one consumer loop. Zero fields take the defaults;
// negative ones are refused (Validate).
type RunnerConfig struct {
	// Stream and Filter name what the projector reads; Filter must equal
	// the stream's subjects (docs/design.md, "Measured facts").
	Stream string
	Filter string
	// Batch is the most messages fetched and applied in one transaction.
	// Default 1000.
	Batch int
	// MaxWait is how long messages may gather before the runner takes
	// them, when the stream is not backlogged: the most a batch adds to
	// the projection's lag. Default 250ms.
	MaxWait time.Duration
	// AckWait is how long JetStream waits for an ack before redelivering.
	// Default 60s; the runner extends it while it retries a batch.
	AckWait time.Duration
	// RetryMin and RetryMax bound the backoff between attempts of a batch
	// that failed with a transient error. Defaults 100ms and 5s.
	RetryMin, RetryMax time.Duration
	// SweepEvery is how often a runner that has caught up with its stream
	// (idle, or fetching less than a full batch) calls the projector's
	// Sweep. Default 30s.
	SweepEvery time.Duration
	// IdleSweepEvery replaces SweepEvery, when it is longer, while the
	// projector says its sweeps have nothing to do (projection.Idler):
	// a safety net, since the next batch applied ends that. Default 30s.
	IdleSweepEvery time.Duration
	// StandbyEvery is how often a runner on standby (another process
	// holds the projector's lock) tries to take the lead. Default 2s.
	StandbyEvery time.Duration
	// Progress, if set, is called after each committed batch.
	Progress func(Progress)
	Logger   *slog.Logger
}

// Progress is what the runner reports after each batch.
type Progress struct {
	Applied  uint64 // messages applied since Run started
	Position uint64 // highest stream sequence committed
	Pending  uint64 // messages in the stream after the position
}

// RunnerConfig's defaults.
const (
	DefaultRunnerBatch          = 1000
	DefaultRunnerMaxWait        = 250 * time.Millisecond
	DefaultRunnerAckWait        = 60 * time.Second
	DefaultRunnerRetryMin       = 100 * time.Millisecond
	DefaultRunnerRetryMax       = 5 * time.Second
	DefaultRunnerSweepEvery     = 30 * time.Second
	DefaultRunnerIdleSweepEvery = 30 * time.Second
)

func (c RunnerConfig) withDefaults() RunnerConfig {
	if c.Batch == 0 {
		c.Batch = DefaultRunnerBatch
	}
	if c.MaxWait == 0 {
		c.MaxWait = DefaultRunnerMaxWait
	}
	if c.AckWait == 0 {
		c.AckWait = DefaultRunnerAckWait
	}
	if c.RetryMin == 0 {
		c.RetryMin = DefaultRunnerRetryMin
	}
	if c.RetryMax == 0 {
		c.RetryMax = DefaultRunnerRetryMax
	}
	if c.SweepEvery == 0 {
		c.SweepEvery = DefaultRunnerSweepEvery
	}
	if c.IdleSweepEvery == 0 {
		c.IdleSweepEvery = DefaultRunnerIdleSweepEvery
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// Validate refuses a negative field: a mistake, which taking the default
// would hide.
func (c RunnerConfig) Validate() error {
	return errors.Join(
		knob.NotNegative("runner", "Batch", c.Batch, DefaultRunnerBatch),
		knob.NotNegative("runner", "MaxWait", c.MaxWait, DefaultRunnerMaxWait),
		knob.NotNegative("runner", "AckWait", c.AckWait, DefaultRunnerAckWait),
		knob.NotNegative("runner", "RetryMin", c.RetryMin, DefaultRunnerRetryMin),
		knob.NotNegative("runner", "RetryMax", c.RetryMax, DefaultRunnerRetryMax),
		knob.NotNegative("runner", "SweepEvery", c.SweepEvery, DefaultRunnerSweepEvery),
		knob.NotNegative("runner", "IdleSweepEvery", c.IdleSweepEvery, DefaultRunnerIdleSweepEvery),
		knob.NotNegative("runner", "StandbyEvery", c.StandbyEvery, DefaultStandbyEvery),
	)
}

// Runner is the consumer core's user for projections: fetch a batch, apply
// it in a PostgreSQL transaction that also records the consumer position,
// commit, then ack (consumer.go has what every consumer shares).
//
// Exactly-once effect rests on two rules. Only one process applies a given
// projection at a time: the runner leads by a PGLease, an advisory lock on
// the very connection its transactions run on, so a runner that lost its
// connection has lost its lock and cannot commit. And messages are applied
// in stream order: whenever the runner takes the lead it attaches the
// durable consumer right after the committed position, and a batch that
// fails with a transient error is retried in place (its messages kept in
// progress) rather than handed back, since a handed-back message would
// come again after newer ones had moved the position past it.
type Runner struct {
	js    jetstream.JetStream
	pool  *pgxpool.Pool
	p     projection.Projector
	cfg   RunnerConfig
	mset  *Metrics
	m     ConsumerMetrics
	log   *slog.Logger
	name  string
	lease *PGLease
	loop  Loop

	held      *PGHeld
	conn      *pgx.Conn // held's: the lock and the transactions
	cons      jetstream.Consumer
	delivered uint64 // the last delivery sequence fetched (0: none since point)
	position  uint64
	applied   uint64
	lastSweep time.Time
	// backlogged: the last fetch came back full, so more is waiting.
	backlogged bool
	// idle: the last fetch came back empty, so the next waits for a
	// message at the server (await).
	idle bool
	// skip, during a replay with a plan, names the stream messages the
	// replay does not apply (ReplayPlan.Skip).
	skip func(projection.Message) bool
}

// NewRunner makes a runner of projector p; it refuses a cfg that does not
// Validate.
func NewRunner(js jetstream.JetStream, pool *pgxpool.Pool, p projection.Projector, cfg RunnerConfig, m *Metrics) (*Runner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	name := p.Name() // a partition's projector names the partition's consumer (subjects.BESLayout.Durable)
	r := &Runner{js: js, pool: pool, p: p, cfg: cfg, mset: m, m: m.Consumer(name, KindProjection), name: name,
		log: cfg.Logger.With("consumer", name), lease: ConsumerLease(pool, name)}
	r.loop = Loop{Name: r.name, Kind: KindProjection, Lease: r.lease, StandbyEvery: cfg.StandbyEvery, Metrics: r.m, Logger: r.log,
		Retry: retry.Backoff{Min: cfg.RetryMin, Max: cfg.RetryMax}}
	return r, nil
}

// Run applies batches until ctx ends. A runner that cannot take the lock
// waits on standby.
func (r *Runner) Run(ctx context.Context) error {
	r.loop.Run(ctx, Session{Begin: r.begin, Step: r.step})
	return nil
}

// begin starts to lead: a projector's cache forgets what it held, and the
// durable consumer is pointed right after the committed position.
func (r *Runner) begin(ctx context.Context, h Held) error {
	r.held = h.(*PGHeld) // the runner's lease is a PGLease
	r.conn = r.held.Conn()
	r.settle(false)
	pos, err := r.readPosition(ctx)
	if err != nil {
		return err
	}
	if err := r.point(ctx, pos); err != nil {
		return err
	}
	r.position = pos
	r.log.Info("applying", "position", pos)
	return nil
}

// rewind re-points the consumer at the committed position after a batch
// failed part-way (a dead letter that could not be published, a projector
// naming a message that is not in its batch, a failed isolation), so that
// the next delivery is the first message not applied. Without it the next
// fetch returns later messages, their commit moves the position past the
// failed batch and their AckAll acknowledges it: lost without a trace.
// When the consumer cannot be re-pointed the runner gives up the lead
// instead (the error wraps ErrLeaseLost), and whoever leads next points it
// (begin). Messages of the batch already parked are parked again on
// redelivery, a no-op inside the DEAD stream's duplicate window (their
// Nats-Msg-Id names consumer and sequence).
func (r *Runner) rewind(ctx context.Context) error {
	r.m.Batch("rewound")
	pos, err := r.readPosition(ctx)
	if err == nil {
		err = r.point(ctx, pos)
	}
	if err != nil {
		return fmt.Errorf("%w: cannot re-point the consumer after a failed batch, so the runner gives the lead up: %w", ErrLeaseLost, err)
	}
	r.position = pos
	r.backlogged = true // what was handed back is waiting
	return nil
}

func (r *Runner) readPosition(ctx context.Context) (uint64, error) {
	var pos int64
	err := r.conn.QueryRow(ctx, "select stream_seq from consumer_positions where consumer = $1", r.name).Scan(&pos)
	if errors.Is(err, pgx.ErrNoRows) {
		return 0, nil
	}
	if err != nil {
		return 0, fmt.Errorf("read position: %w", err)
	}
	return uint64(pos), nil
}

// point attaches the durable consumer to deliver from pos+1; deliveries
// left unacknowledged by a previous holder or a failed batch are dropped.
func (r *Runner) point(ctx context.Context, pos uint64) error {
	spec := ConsumerSpec(r.name, r.cfg.Filter, r.cfg.Batch, r.cfg.AckWait)
	cons, _, err := Attach(ctx, r.js, r.cfg.Stream, KindProjection, spec, Position{Next: pos + 1}, r.log)
	if err != nil {
		return err
	}
	r.cons, r.delivered, r.idle = cons, 0, false
	return nil
}

// step fetches and applies one batch, or sweeps when there is none.
func (r *Runner) step(ctx context.Context) error {
	msgs, err := r.gather(ctx)
	if err != nil {
		// What a failed fetch had delivered may still be pending at the
		// server, and would come after later messages: re-point first.
		return r.refetch(ctx, err)
	}
	r.backlogged = len(msgs) == r.cfg.Batch
	r.idle = len(msgs) == 0
	if len(msgs) > 0 {
		if err := r.handle(ctx, msgs); err != nil {
			return r.refetch(ctx, err)
		}
	}
	// Sweep once the projection has caught up (this fetch did not fill a
	// batch), not only when the stream is idle: a stream with a steady
	// trickle, such as reservation requests, is never idle, and its
	// projector's timeouts must still fire. A backlogged runner does not
	// sweep: its tables are behind the stream, and time-based decisions
	// taken on them (a node unheard, a bind unconfirmed) would be wrong.
	if !r.backlogged && !time.Now().Before(r.sweepDue()) {
		return r.sweep(ctx)
	}
	return nil
}

// gather returns the next batch, empty when nothing came before a sweep
// was due.
//
// A fetch that waits for its batch to fill receives live messages one at
// a time as they arrive, a wakeup per message (measured: about 2 context
// switches and 4x the CPU per event of a drained backlog). So the runner
// takes whole batches without waiting while it is behind, and otherwise
// lets messages gather for MaxWait and takes them in one pull. Once a
// pull found nothing, the runner does not poll every MaxWait, a request
// and its answer on both sides for each of the runners of a process that
// has nothing to do: it leaves one pull for a single message waiting at
// the server until a sweep is due (await), and when that message comes
// gathers the rest for MaxWait as before. A busy stream never finds
// nothing, so it is fetched as before; an idle one costs a pending pull
// and the server's heartbeats on it.
func (r *Runner) gather(ctx context.Context) ([]*message, error) {
	if r.backlogged {
		return r.fetch(r.cfg.Batch)
	}
	var first []*message
	if r.idle {
		waited, msgs, err := r.await(ctx)
		if err != nil || (waited && len(msgs) == 0) {
			return nil, err
		}
		first = msgs
	}
	if len(first) == r.cfg.Batch {
		return first, nil
	}
	// Should ctx end now, first stays delivered and unacknowledged:
	// whoever leads next re-points the consumer (begin), which drops it.
	if !retry.Sleep(ctx, r.cfg.MaxWait) {
		return nil, ctx.Err()
	}
	rest, err := r.fetch(r.cfg.Batch - len(first))
	if err != nil {
		return nil, err
	}
	return append(first, rest...), nil
}

// sweepDue is when the runner sweeps next, once it has caught up.
func (r *Runner) sweepDue() time.Time {
	every := r.cfg.SweepEvery
	if i, ok := r.p.(projection.Idler); ok && i.Idle() {
		every = max(every, r.cfg.IdleSweepEvery)
	}
	return r.lastSweep.Add(every)
}

// await waits at the server for one message, until a sweep is due (MaxWait
// at the least), ctx ends, or the connection to the server drops. It says
// whether it waited: it does not while the connection is down, and the
// runner then polls as before.
//
// A pull cannot be taken back from the server, so the wait ends on the
// server's side, not the runner's: the pull expires a little before
// wctx's deadline (FetchContext), and a message delivered to a pull the
// runner stopped waiting for would be lost in transit, which the delivery
// sequence check of the next fetch turns into a re-point. The one pull a
// runner cannot wait out is one its connection lost: the server forgot it
// with the connection, and the runner would otherwise sit until the
// missing heartbeats (2 x 5s) told it so, while new messages wait.
func (r *Runner) await(ctx context.Context) (bool, []*message, error) {
	nc := r.js.Conn()
	lost := nc.StatusChanged(nats.DISCONNECTED, nats.RECONNECTING, nats.CLOSED)
	defer nc.RemoveStatusListener(lost)
	if nc.Status() != nats.CONNECTED {
		return false, nil, nil
	}
	wctx, cancel := context.WithTimeout(ctx, max(time.Until(r.sweepDue()), r.cfg.MaxWait))
	defer cancel()
	go func() {
		if _, ok := <-lost; ok { // closed by RemoveStatusListener otherwise
			cancel()
		}
	}()
	batch, err := r.cons.Fetch(1, jetstream.FetchContext(wctx))
	if err != nil {
		return true, nil, fmt.Errorf("fetch: %w", err)
	}
	msgs, err := r.take(batch)
	switch {
	case ctx.Err() != nil:
		return true, nil, ctx.Err()
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, context.Canceled):
		// The runner's deadline came before the server's expiry reached
		// it, or the connection dropped: nothing more is on its way.
		return true, msgs, nil
	}
	return true, msgs, err
}

// fetch takes what is waiting, up to n messages.
func (r *Runner) fetch(n int) ([]*message, error) {
	start := time.Now()
	batch, err := r.cons.FetchNoWait(n)
	if err != nil {
		return nil, fmt.Errorf("fetch: %w", err)
	}
	msgs, err := r.take(batch)
	if err != nil {
		return nil, err
	}
	r.m.Step("fetch", time.Since(start))
	return msgs, nil
}

// take reads a fetch's messages. A delivery sequence that skips one means
// deliveries were lost in transit (a connection dropped with a fetch's
// answer, a pull that was given up): they are pending at the server and
// would come after the messages that follow, so take fails rather than
// hand those over.
func (r *Runner) take(batch jetstream.MessageBatch) ([]*message, error) {
	var msgs []*message
	var gap error
	for jm := range batch.Messages() {
		md, err := jm.Metadata()
		if err != nil {
			r.log.Warn("message without metadata; terminated", "err", err)
			jm.Term()
			continue
		}
		if r.delivered != 0 && md.Sequence.Consumer != r.delivered+1 && gap == nil {
			gap = fmt.Errorf("fetch: delivery %d follows %d: deliveries were lost in transit", md.Sequence.Consumer, r.delivered)
		}
		r.delivered = md.Sequence.Consumer
		msgs = append(msgs, &message{Msg: jm, seq: md.Sequence.Stream, stored: md.Timestamp, pending: md.NumPending})
	}
	if gap != nil {
		return nil, gap
	}
	if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && len(msgs) == 0 {
		return nil, fmt.Errorf("fetch: %w", err)
	}
	return msgs, nil
}

// refetch re-points the consumer after a failed fetch (or gives the lead
// up when it cannot) and returns err.
func (r *Runner) refetch(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return err
	}
	if rerr := r.rewind(ctx); rerr != nil {
		return errors.Join(err, rerr)
	}
	return err
}

// sweep lets a projector act on the passage of time (see projection.Sweeper).
func (r *Runner) sweep(ctx context.Context) error {
	s, ok := r.p.(projection.Sweeper)
	if !ok {
		r.lastSweep = time.Now() // nothing to sweep: await waits a whole SweepEvery
		return nil
	}
	err := r.inTx(ctx, func(tx pgx.Tx) error { return s.Sweep(ctx, tx, time.Now()) })
	r.settle(err == nil)
	if err != nil {
		return fmt.Errorf("sweep: %w", err)
	}
	r.lastSweep = time.Now()
	return nil
}

// handle applies msgs until they commit, parking poison messages on the
// way, then acks.
func (r *Runner) handle(ctx context.Context, msgs []*message) error {
	upTo := msgs[len(msgs)-1].seq
	live := msgs
	var dead []*message
	wait := retry.Backoff{Min: r.cfg.RetryMin, Max: r.cfg.RetryMax}
	for attempt := 1; ; attempt++ {
		n, err := r.commit(ctx, live, upTo)
		if err == nil {
			r.applied += uint64(n)
			r.m.Batch("committed")
			r.m.Messages("applied", n)
			r.m.Messages("skipped", len(live)-n)
			break
		}
		if pe, ok := projection.AsPoison(err); ok {
			var m *message
			live, m = remove(live, pe.Seq)
			if m == nil {
				return fmt.Errorf("projector named message %d, which is not in the batch: %w", pe.Seq, err)
			}
			if err := r.deadLetter(ctx, m, pe.Reason); err != nil {
				return err
			}
			dead = append(dead, m)
			continue
		}
		if !Transient(err) {
			// A data error without a culprit named: find it by applying
			// the messages one at a time.
			if len(live) == 1 {
				if err := r.deadLetter(ctx, live[0], err); err != nil {
					return err
				}
				dead, live = append(dead, live[0]), nil
				continue
			}
			return r.isolate(ctx, live, msgs, dead)
		}
		r.m.Batch("transient_error")
		r.m.Retry()
		if ctx.Err() != nil {
			r.handBack(live)
			return ctx.Err()
		}
		if ferr := r.held.Fence(ctx); ferr != nil {
			// The lock went with the connection: whoever leads next starts
			// from the committed position, so this batch is handed back.
			r.handBack(live)
			return errors.Join(err, ferr)
		}
		r.log.Warn("batch failed; retrying", "attempt", attempt, "messages", len(live), "err", err)
		for _, m := range live {
			m.InProgress()
		}
		if !wait.Wait(ctx) {
			r.handBack(live)
			return ctx.Err()
		}
	}
	return r.ack(msgs, dead)
}

// isolate applies the batch one message per transaction after a data error,
// dead-lettering each message that fails on its own.
func (r *Runner) isolate(ctx context.Context, live, all, dead []*message) error {
	r.log.Warn("data error in batch; applying its messages one by one", "messages", len(live))
	for _, m := range live {
		for {
			_, err := r.commit(ctx, []*message{m}, m.seq)
			if err == nil {
				break
			}
			if pe, ok := projection.AsPoison(err); ok {
				err = pe.Reason
			} else if Transient(err) {
				// As in handle: a connection that is gone took the lock
				// with it, and retrying on it would spin for ever while the
				// runner still counted itself the leader.
				if ferr := r.held.Fence(ctx); ferr != nil {
					return fmt.Errorf("isolate message %d: %w", m.seq, errors.Join(err, ferr))
				}
				r.m.Retry()
				if !retry.Sleep(ctx, r.cfg.RetryMax) {
					r.handBack(live)
					return ctx.Err()
				}
				continue
			}
			if err := r.deadLetter(ctx, m, err); err != nil {
				return err
			}
			dead = append(dead, m)
			break
		}
	}
	if _, err := r.commit(ctx, nil, all[len(all)-1].seq); err != nil {
		return err
	}
	return r.ack(all, dead)
}

// commit runs one transaction: lock and read the position, apply the
// messages above it, move the position to upTo, commit. It returns how
// many messages were applied.
func (r *Runner) commit(ctx context.Context, msgs []*message, upTo uint64) (int, error) {
	start := time.Now()
	applied := 0
	err := r.inTx(ctx, func(tx pgx.Tx) error {
		var pos int64
		err := tx.QueryRow(ctx, "select stream_seq from consumer_positions where consumer = $1 for update", r.name).Scan(&pos)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		batch := make([]projection.Message, 0, len(msgs))
		for _, m := range msgs {
			if m.seq > uint64(pos) && (r.skip == nil || !r.skip(m)) {
				batch = append(batch, m)
			}
		}
		if len(batch) > 0 {
			if err := r.apply(ctx, tx, batch); err != nil {
				return err
			}
		}
		applied = len(batch)
		if upTo <= uint64(pos) {
			return nil
		}
		_, err = tx.Exec(ctx, `insert into consumer_positions (consumer, stream, stream_seq, updated_at)
			values ($1, $2, $3, now())
			on conflict (consumer) do update set stream_seq = excluded.stream_seq, updated_at = excluded.updated_at`,
			r.name, r.cfg.Stream, int64(upTo))
		return err
	})
	r.m.Step("apply_commit", time.Since(start))
	r.settle(err == nil)
	if err != nil {
		return 0, err
	}
	if upTo > r.position {
		r.position = upTo
	}
	r.m.Position(r.position)
	if len(msgs) > 0 {
		last := msgs[len(msgs)-1]
		r.m.Lag(time.Since(last.stored), last.pending)
	}
	if r.cfg.Progress != nil {
		pending := uint64(0)
		if len(msgs) > 0 {
			pending = msgs[len(msgs)-1].pending
		}
		r.cfg.Progress(Progress{Applied: r.applied + uint64(applied), Position: r.position, Pending: pending})
	}
	return applied, nil
}

// apply calls the projector, turning a panic into a permanent error so
// that the message behind it is isolated and parked rather than taking the
// process down (and with it, again and again, every process that tries).
func (r *Runner) apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) (err error) {
	defer func() {
		if v := recover(); v != nil {
			r.log.Error("projector panicked", "panic", v, "stack", string(debug.Stack()))
			err = &PanicError{Value: v}
		}
	}()
	return r.p.Apply(ctx, tx, batch)
}

// settle tells a projector that keeps a cache whether the transaction it
// worked in committed (see projection.Committer).
func (r *Runner) settle(committed bool) {
	c, ok := r.p.(projection.Committer)
	if !ok {
		return
	}
	if committed {
		c.Committed()
	} else {
		c.Aborted()
	}
}

// PanicError is a projector's panic, recovered by the runner.
type PanicError struct{ Value any }

func (e *PanicError) Error() string { return fmt.Sprintf("projector panicked: %v", e.Value) }

func (r *Runner) inTx(ctx context.Context, f func(pgx.Tx) error) error {
	if r.conn == nil {
		return errors.New("no database connection")
	}
	return pgx.BeginFunc(ctx, r.conn, f)
}

// ack acknowledges a committed batch: AckAll on the last message covers
// every message before it, and dead-lettered ones are terminated.
func (r *Runner) ack(msgs, dead []*message) error {
	start := time.Now()
	isDead := make(map[uint64]bool, len(dead))
	for _, m := range dead {
		isDead[m.seq] = true
	}
	for i := len(msgs) - 1; i >= 0; i-- {
		if !isDead[msgs[i].seq] {
			if err := msgs[i].Ack(); err != nil {
				// Committed already: a lost ack only means a redelivery
				// that the position check skips.
				r.log.Warn("ack failed", "seq", msgs[i].seq, "err", err)
			}
			break
		}
	}
	r.m.Step("ack", time.Since(start))
	return nil
}

// handBack returns messages to JetStream for whoever leads next.
func (r *Runner) handBack(msgs []*message) {
	for _, m := range msgs {
		m.NakWithDelay(time.Second)
	}
	r.m.Batch("naked")
}

func (r *Runner) deadLetter(ctx context.Context, m *message, reason error) error {
	msg := nats.NewMsg(subjects.Dead(r.name))
	for k, v := range m.Headers() {
		msg.Header[k] = v
	}
	msg.Header.Set(envelope.MsgID, "dead/"+r.name+"/"+strconv.FormatUint(m.seq, 10))
	// A reason is the projector's error text, which may quote the message:
	// bounded, so that the dead letter itself always fits the backbone's
	// max payload (a letter that can never be stored would hold the
	// projection at this message for good).
	msg.Header.Set(envelope.Reason, truncate(reason.Error(), 4096))
	msg.Header.Set(envelope.Consumer, r.name)
	msg.Header.Set(envelope.Origin, r.cfg.Stream+":"+strconv.FormatUint(m.seq, 10)+":"+m.Subject())
	msg.Data = m.Data()
	if err := NewPublisher(r.js, r.mset).Publish(ctx, msg); err != nil {
		return fmt.Errorf("dead-letter message %d: %w", m.seq, err)
	}
	m.TermWithReason(truncate(reason.Error(), 200))
	r.m.Messages("dead", 1)
	r.m.DeadLetter()
	r.log.Error("message parked in the dead-letter stream", "seq", m.seq, "subject", m.Subject(), "err", reason)
	return nil
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n]
}

func remove(msgs []*message, seq uint64) ([]*message, *message) {
	for i, m := range msgs {
		if m.seq == seq {
			out := make([]*message, 0, len(msgs)-1)
			out = append(out, msgs[:i]...)
			return append(out, msgs[i+1:]...), m
		}
	}
	return msgs, nil
}

// message adapts a JetStream message to projection.Message.
type message struct {
	jetstream.Msg
	seq     uint64
	stored  time.Time
	pending uint64
}

func (m *message) Seq() uint64              { return m.seq }
func (m *message) Time() time.Time          { return m.stored }
func (m *message) Header(key string) string { return m.Headers().Get(key) }
