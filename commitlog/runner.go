package commitlog

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/backoff"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// FoldRunnerConfig configures a FoldRunner. Zero fields take the
// defaults; negative ones are refused (Validate).
type FoldRunnerConfig struct {
	// Durable names the discovery consumer on COMMITS, and the fold's
	// lease (FoldLeaseKey): one process leads each durable name, others
	// stand by. Default DefaultDurable.
	Durable string
	// MinVersions folds a world as soon as this many of its versions are
	// waiting. Default 10,000.
	MinVersions int
	// Interval folds a world once its oldest waiting version (by the time
	// JetStream stored it) is this old. Default 30s.
	Interval time.Duration
	// Concurrency is how many worlds fold at once. Default 2.
	Concurrency int
	// MaxAckPending is the most versions delivered to the runner and not
	// yet acknowledged (folded): at that many JetStream stops delivering
	// until some are. At half of it the world with the oldest waiting
	// version folds at once, whatever MinVersions and Interval say.
	// Default 200,000 (about 25 MB of the runner's memory).
	MaxAckPending int
	// AckWait is how long JetStream waits for an acknowledgement before
	// it delivers a version again. A version waits about Interval plus a
	// pass; a redelivery while it waits costs a re-read of its headers,
	// and a delivery lost in transit (a disconnect) comes again after it.
	// Default 5m.
	AckWait time.Duration
	// Fetch is how many message headers one pull asks for. Default 1000.
	Fetch int
	// FetchWait is how long a pull waits for messages. What a pull brings
	// is handed over as it comes, so this is only how often an idle fold
	// asks again (with the server's heartbeats every 5s on a pull this
	// long, which tell a pull lost with its connection). Default 30s.
	FetchWait time.Duration
	// RetryMin and RetryMax bound the backoff of a world whose pass
	// failed (doubling from RetryMin), and the pause before a runner that
	// lost the lead tries to lead again. Defaults 1s and 1m.
	RetryMin, RetryMax time.Duration
	// StandbyEvery is how often a runner on standby (another process
	// holds the fold's lease) tries to take it. Default 2s.
	StandbyEvery time.Duration
	// Drain is how long passes in flight may go on after Run's context
	// ends before they are cancelled. Default 10s.
	Drain time.Duration
	// HoldFor names the durable consumers on COMMITS, other systems'
	// exports, that hold the deletions back: no version of a world is
	// deleted above the ack floor of one whose subjects take the world. A
	// version deleted before such a consumer read it would never reach the
	// other system, and JetStream counts the deletion of a delivered
	// message as its ack (under AckAll, of every message below it too).
	// One that does not exist (yet) holds every version back, and the
	// runner warns once: a missing export consumer must not let versions
	// go before they were exported. Default none (nothing holds).
	HoldFor []string
	Logger  *slog.Logger
	// Metrics, if set, receives the fold's own figures
	// (millrace_compactor_*).
	Metrics *FoldMetrics
	// ConsumerMetrics, if set, receives the consumer metrics of the fold
	// (millrace_consumer_*{consumer=<Durable>,kind="fold"}): whether this
	// process leads, its position, lag and errors.
	ConsumerMetrics *streams.Metrics
}

// FoldRunnerConfig's defaults.
const (
	DefaultMinVersions   = 10000
	DefaultInterval      = 30 * time.Second
	DefaultConcurrency   = 2
	DefaultMaxAckPending = 200000
	DefaultAckWait       = 5 * time.Minute
	DefaultFetch         = 1000
	DefaultFetchWait     = 30 * time.Second
	DefaultRetryMin      = time.Second
	DefaultRetryMax      = time.Minute
	DefaultDrain         = 10 * time.Second
)

// DefaultDurable is the fold's discovery consumer and lease name when
// FoldRunnerConfig.Durable is empty.
const DefaultDurable = "compactor"

func (c FoldRunnerConfig) withDefaults() FoldRunnerConfig {
	if c.Durable == "" {
		c.Durable = DefaultDurable
	}
	c.MinVersions = orDefault(c.MinVersions, DefaultMinVersions)
	c.Interval = orDefault(c.Interval, DefaultInterval)
	c.Concurrency = orDefault(c.Concurrency, DefaultConcurrency)
	c.MaxAckPending = orDefault(c.MaxAckPending, DefaultMaxAckPending)
	c.AckWait = orDefault(c.AckWait, DefaultAckWait)
	c.Fetch = orDefault(c.Fetch, DefaultFetch)
	c.FetchWait = orDefault(c.FetchWait, DefaultFetchWait)
	c.RetryMin = orDefault(c.RetryMin, DefaultRetryMin)
	c.RetryMax = orDefault(c.RetryMax, DefaultRetryMax)
	c.Drain = orDefault(c.Drain, DefaultDrain)
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

func orDefault[T comparable](v, def T) T {
	var zero T
	if v == zero {
		return def
	}
	return v
}

// Validate reports a configuration the runner cannot work with: a
// negative field (a mistake, which taking the default would hide), a bad
// durable or holder name, or bounds that contradict each other.
func (c FoldRunnerConfig) Validate() error {
	const pkg = "fold runner"
	if err := errors.Join(
		knob.NotNegative(pkg, "MinVersions", c.MinVersions, DefaultMinVersions),
		knob.NotNegative(pkg, "Interval", c.Interval, DefaultInterval),
		knob.NotNegative(pkg, "Concurrency", c.Concurrency, DefaultConcurrency),
		knob.NotNegative(pkg, "MaxAckPending", c.MaxAckPending, DefaultMaxAckPending),
		knob.NotNegative(pkg, "AckWait", c.AckWait, DefaultAckWait),
		knob.NotNegative(pkg, "Fetch", c.Fetch, DefaultFetch),
		knob.NotNegative(pkg, "FetchWait", c.FetchWait, DefaultFetchWait),
		knob.NotNegative(pkg, "RetryMin", c.RetryMin, DefaultRetryMin),
		knob.NotNegative(pkg, "RetryMax", c.RetryMax, DefaultRetryMax),
		knob.NotNegative(pkg, "StandbyEvery", c.StandbyEvery, streams.DefaultStandbyEvery),
		knob.NotNegative(pkg, "Drain", c.Drain, DefaultDrain),
	); err != nil {
		return err
	}
	c = c.withDefaults()
	if strings.ContainsAny(c.Durable, ".*> \t\r\n") {
		return fmt.Errorf("fold runner: durable name %q: no '.', '*', '>' or spaces", c.Durable)
	}
	if c.MaxAckPending < 2*c.Fetch {
		return fmt.Errorf("fold runner: max ack pending %d must be at least twice the fetch size %d", c.MaxAckPending, c.Fetch)
	}
	if c.RetryMax < c.RetryMin {
		return fmt.Errorf("fold runner: retry max %s is below retry min %s", c.RetryMax, c.RetryMin)
	}
	for _, h := range c.HoldFor {
		if h == "" || strings.ContainsAny(h, ".*> \t\r\n") {
			return fmt.Errorf("fold runner: holder %q is not a durable name (empty, or with '.', '*', '>' or spaces)", h)
		}
	}
	return nil
}

// FoldRunner decides when to fold which world of the commit log, and
// folds it with FoldWorld. It is a user of the consumer core
// (streams.Loop, kind fold): its position lives in the bucket (each
// world's latest checkpoint), so it leads by a key-value lease,
// FoldLeaseKey(Durable) in streams.LeaseBucket, and processes beside the
// leader stand by.
//
// Discovery. Listing the subjects of COMMITS to find worlds with new
// versions costs a walk of every document (1,000,000 in a big world) on
// every look. Instead the runner reads a durable pull consumer on
// commits.> with HeadersOnly (subject, sequence and time; no bodies) and
// keeps, per world, the sequences, times and reply subjects of the
// versions delivered and not yet folded. A world folds when MinVersions
// of its versions wait, when its oldest is Interval old, or at once when
// the versions waiting near MaxAckPending and it holds the oldest. At
// most Concurrency passes run at once, one per world; a failed pass is
// retried with backoff while other worlds go on.
//
// Acknowledgement. Each version is acked once its world is folded up to
// it (AckExplicit, streams.KindFold), so the consumer's ack floor is the
// lowest version still waiting, and a crash re-delivers exactly what was
// not folded; a world whose checkpoint already covers what comes again
// makes a pass that finds nothing new. Not AckAll, though one ack per
// batch would be cheaper: a pass deletes folded versions that the
// consumer still has delivered and unacknowledged, JetStream treats the
// deletion of a pending message as its acknowledgement, and under AckAll
// that acknowledges every message below it, the unfolded versions of
// other worlds included (nats-server consumer.decStreamPending). Under
// AckExplicit such a deletion acknowledges that one message, which is
// exactly right, and the runner's own ack of it later is a no-op.
//
// Lead, restart and loss. Whenever the runner takes the lead it starts
// discovery afresh and attaches the consumer (streams.Attach) right after
// its ack floor, so what the last leader held comes at once rather than
// after AckWait; versions above the floor that were folded come again
// and cost an idle pass per world. A pass writes its checkpoint and each
// batch of its deletions only while the lease holds (projection.Fence);
// losing the lease ends the passes and the lead. When the consumer
// disappears (deleted, or the stream recreated) the runner attaches it
// again from its own lowest waiting version. A delivery lost in transit
// (a disconnect) is redelivered after AckWait. Until the COMMITS stream
// exists the runner waits and says so once.
type FoldRunner struct {
	js   jetstream.JetStream
	f    projection.Folder
	cfg  FoldRunnerConfig
	m    *FoldMetrics
	cm   streams.ConsumerMetrics
	log  *slog.Logger
	loop streams.Loop

	// Consumer state, for one lead; owned by the goroutine of Run.
	cons        jetstream.Consumer
	created     time.Time // the stream's creation time when attached
	attached    bool      // attached once in this lead: positions are ours, not the server's
	attachAt    time.Time // the next attach attempt
	attachErr   string    // the last attach error logged, to say it once
	pullRetry   backoff.Backoff
	fetchErrs   int       // pull failures in a row
	fetchAt     time.Time // the next pull after a failure
	undelivered uint64    // versions the consumer had not delivered yet, at the last pull

	// Discovery state, for one lead.
	worlds   map[string]*foldState
	maxSeq   uint64 // the highest sequence delivered, or below which all is folded
	waiting  int    // versions waiting, all worlds
	urgent   bool   // a pull made a world due by size, or the pressure high
	inFlight int
	missing  map[string]bool // holders found missing, warned of
}

// foldState is one world as the runner knows it.
type foldState struct {
	covered uint64        // the folder's position after the last pass (0: unknown)
	last    uint64        // the highest of its sequences delivered
	waiting []waitVersion // delivered, not known folded; ascending
	folding bool
	cut     uint64 // last when the pass in flight began
	fails   int
	retry   backoff.Backoff // the pause after a failed pass
	retryAt time.Time
}

// waitVersion is a version waiting to be folded. It keeps the delivery's
// reply subject, which is all an ack needs: about 120 bytes a version,
// where the delivered message with its headers takes several times that.
type waitVersion struct {
	seq   uint64
	at    int64 // unix nanoseconds, stored by JetStream
	reply string
}

// ackBody is JetStream's acknowledgement, what jetstream.Msg.Ack sends.
var ackBody = []byte("+ACK")

// FoldLeaseKey is the key of the fold's lease for durable in
// streams.LeaseBucket.
func FoldLeaseKey(durable string) string { return "fold." + durable }

// NewFoldRunner makes a runner that folds the worlds of COMMITS with f;
// it refuses a cfg that does not Validate.
func NewFoldRunner(js jetstream.JetStream, f projection.Folder, cfg FoldRunnerConfig) (*FoldRunner, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	r := &FoldRunner{js: js, f: f, cfg: cfg, m: cfg.Metrics,
		cm:      cfg.ConsumerMetrics.Consumer(cfg.Durable, streams.KindFold),
		log:     cfg.Logger.With("component", "compactor", "consumer", cfg.Durable),
		missing: map[string]bool{}}
	r.loop = streams.Loop{Name: cfg.Durable, Kind: streams.KindFold,
		Lease:        streams.NewKVLease(js, FoldLeaseKey(cfg.Durable)),
		Retry:        backoff.Backoff{Min: cfg.RetryMin, Max: cfg.RetryMax},
		StandbyEvery: cfg.StandbyEvery, Metrics: r.cm, Logger: r.log}
	r.begin()
	return r, nil
}

// fetched is what one pull brought.
type fetched struct {
	cons jetstream.Consumer
	msgs []jetstream.Msg
	err  error
}

// passDone is what one pass did.
type passDone struct {
	world string
	st    FoldStats
	err   error
	took  time.Duration
}

// Run leads the fold (standing by while another process does), discovers
// and folds worlds until ctx ends; then it lets passes in flight finish
// for up to Drain (cancelling them after), acks what they folded, gives
// the lease up, and returns: what is not folded stays unacknowledged for
// the next leader. It returns nil: NewFoldRunner refused a bad
// configuration.
//
// The lease outlives ctx until the passes have drained: they commit
// their checkpoints under it (projection.Fence), and it is renewed
// meanwhile. Losing it ends the lead at once, passes included.
func (r *FoldRunner) Run(ctx context.Context) error {
	g := newLeadGate(ctx)
	defer g.close()
	r.loop.Run(g.ctx, streams.Session{
		Begin: func(context.Context, streams.Held) error { r.begin(); return nil },
		Step: func(held context.Context) error {
			if !g.enter() {
				return nil
			}
			defer g.leave()
			began := time.Now()
			r.lead(ctx, held)
			if time.Since(began) > 2*r.cfg.RetryMax {
				r.loop.Retry.Reset() // a lead that lasted: its loss is a new failure
			}
			return nil
		},
	})
	return nil
}

// leadGate is the context the fold's Loop runs in. It ends with Run's:
// at once on standby or between leads, and while the process leads only
// once the lead's passes have drained, so that the lease stays held, and
// renewed, until their last checkpoint.
type leadGate struct {
	parent  context.Context
	ctx     context.Context
	end     context.CancelFunc
	unwatch func() bool
	mu      sync.Mutex
	leading bool
}

func newLeadGate(parent context.Context) *leadGate {
	g := &leadGate{parent: parent}
	g.ctx, g.end = context.WithCancel(context.WithoutCancel(parent))
	g.unwatch = context.AfterFunc(parent, func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		if !g.leading {
			g.end()
		}
	})
	return g
}

// enter begins a lead's step; false when Run's context has ended.
func (g *leadGate) enter() bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.parent.Err() != nil {
		g.end()
		return false
	}
	g.leading = true
	return true
}

// leave ends the step, and the Loop with it once Run's context has ended.
func (g *leadGate) leave() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.leading = false
	if g.parent.Err() != nil {
		g.end()
	}
}

func (g *leadGate) close() {
	g.unwatch()
	g.end()
}

// begin forgets what a previous lead knew: another leader may have
// folded and acknowledged since, and the replies held were that
// consumer's. Which holders were warned of stays.
func (r *FoldRunner) begin() {
	r.cons, r.created, r.attached = nil, time.Time{}, false
	r.attachAt, r.attachErr = time.Time{}, ""
	r.pullRetry = backoff.Backoff{Min: pullRetryMin, Max: pullRetryMax}
	r.fetchErrs, r.fetchAt, r.undelivered = 0, time.Time{}, 0
	r.worlds, r.maxSeq, r.waiting, r.urgent = map[string]*foldState{}, 0, 0, false
}

// The pause after a failed pull from the discovery consumer.
const (
	pullRetryMin = 250 * time.Millisecond
	pullRetryMax = 5 * time.Second
)

// newWorld is the state of a world discovery has just met.
func (r *FoldRunner) newWorld() *foldState {
	return &foldState{retry: backoff.Backoff{Min: r.cfg.RetryMin, Max: r.cfg.RetryMax}}
}

// leadLoop is the channels of one lead's event loop.
type leadLoop struct {
	done    chan passDone
	pulls   chan fetched
	fetcher *fetcher
}

// stopFetcher ends the pulls of the lead, if any.
func (l *leadLoop) stopFetcher() {
	if l.fetcher == nil {
		return
	}
	l.fetcher.stop()
	l.fetcher = nil
	// A pull it had made may be waiting in the channel.
	select {
	case <-l.pulls:
	default:
	}
}

// lead runs discovery and passes while held (the lease's context) lasts
// and stop (Run's) has not ended, then drains the passes in flight.
func (r *FoldRunner) lead(stop, held context.Context) {
	passCtx, cancelPasses := context.WithCancel(held)
	defer cancelPasses()
	l := &leadLoop{done: make(chan passDone, r.cfg.Concurrency), pulls: make(chan fetched, 1)}
	defer l.stopFetcher()
	tick := newTick(max(10*time.Millisecond, min(time.Second, r.cfg.Interval/4)), quietTick)
	defer tick.stop()
	over := func() bool { return stop.Err() != nil || held.Err() != nil }
	for !over() {
		tick.next(r.quiet(l))
		now := time.Now()
		if r.cons == nil && !now.Before(r.attachAt) {
			r.attach(held)
		}
		if r.cons != nil && l.fetcher == nil && !now.Before(r.fetchAt) {
			l.fetcher = r.startFetch(held, r.cons, l.pulls)
		}
		// Scheduling walks every world waiting, so it runs on the tick,
		// when a pass ends (a slot is free), and when a pull made a world
		// or the whole due by size; not on every pull, which may bring a
		// handful of versions thousands of times a second.
		sched := false
		select {
		case <-stop.Done():
		case <-held.Done():
		case p := <-l.pulls:
			sched = r.pulled(held, l, p)
		case d := <-l.done:
			r.finish(d, false)
			sched = true
		case <-tick.C():
			tick.fired()
			r.tidy(time.Now())
			sched = true
		}
		if sched && !over() {
			r.urgent = false
			r.schedule(passCtx, l.done, time.Now())
		}
	}
	l.stopFetcher()
	r.drain(held, l.done, cancelPasses)
}

// quiet says that nothing of the lead waits on the clock: no world has
// versions waiting or a pass in flight, and the consumer is attached and
// pulled from (attaching and pulling again after a failure are retried on
// the tick). A version that comes ends it (pulled).
func (r *FoldRunner) quiet(l *leadLoop) bool {
	return len(r.worlds) == 0 && r.inFlight == 0 && r.cons != nil && l.fetcher != nil
}

// quietTick is how often the lead loop looks when nothing waits on the
// clock (quiet): only a pull or a pass can change that, and each wakes the
// loop, so this is a safety net.
const quietTick = time.Minute

// tick is the lead loop's clock: every `every` while something waits on
// it, every `idle` while nothing does (an idle fold need not wake each
// second to find nothing due), and back to `every` at once when something
// comes.
type tick struct {
	every, idle time.Duration
	t           *time.Timer
	due         time.Time // when t fires; zero once it has
}

func newTick(every, idle time.Duration) *tick {
	return &tick{every: every, idle: max(every, idle), t: time.NewTimer(every), due: time.Now().Add(every)}
}

func (k *tick) C() <-chan time.Time { return k.t.C }
func (k *tick) fired()              { k.due = time.Time{} }
func (k *tick) stop()               { k.t.Stop() }

// next sets the timer to fire within every, or within idle when quiet,
// unless it fires sooner already.
func (k *tick) next(quiet bool) {
	d := k.every
	if quiet {
		d = k.idle
	}
	at := time.Now().Add(d)
	if k.due.IsZero() || at.Before(k.due) {
		k.due = at
		k.t.Reset(d)
	}
}

// pulled takes what a pull brought, and says whether to schedule now.
func (r *FoldRunner) pulled(ctx context.Context, l *leadLoop, p fetched) bool {
	if p.cons != r.cons {
		return false // from a consumer since replaced
	}
	if p.err != nil {
		l.stopFetcher()
		r.fetchFailed(ctx, p.err)
		return false
	}
	r.take(p.msgs)
	return r.urgent
}

// drain waits for the passes in flight: for up to Drain when the process
// stops (they may still commit, the lease held), not at all once the
// lease is lost (their context has ended with it).
func (r *FoldRunner) drain(held context.Context, done <-chan passDone, cancelPasses context.CancelFunc) {
	abandoned := held.Err() != nil
	if r.inFlight > 0 && !abandoned {
		r.log.Info("stopping: waiting for passes in flight", "passes", r.inFlight, "drain", r.cfg.Drain)
	}
	t := time.NewTimer(r.cfg.Drain)
	defer t.Stop()
	for r.inFlight > 0 {
		select {
		case d := <-done:
			r.finish(d, abandoned || held.Err() != nil)
		case <-t.C:
			abandoned = true
			cancelPasses()
		}
	}
	r.tidy(time.Now())
}

// fetcher is the goroutine that pulls from one consumer.
type fetcher struct {
	cancel context.CancelFunc
	done   chan struct{}
}

func (r *FoldRunner) startFetch(ctx context.Context, cons jetstream.Consumer, out chan<- fetched) *fetcher {
	ctx, cancel := context.WithCancel(ctx)
	f := &fetcher{cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(f.done)
		r.fetch(ctx, cons, out)
	}()
	return f
}

// stop ends the pulls and waits for the goroutine.
func (f *fetcher) stop() {
	f.cancel()
	<-f.done
}

// fetch pulls headers until ctx ends or a pull fails, handing what each
// pull brings to Run's loop as it comes (a pull that does not fill waits
// until FetchWait, and discovery should not wait with it).
func (r *FoldRunner) fetch(ctx context.Context, cons jetstream.Consumer, out chan<- fetched) {
	send := func(p fetched) bool {
		select {
		case out <- p:
			return true
		case <-ctx.Done():
			return false
		}
	}
	for ctx.Err() == nil {
		// A pull's own deadline, not FetchMaxWait, so that a stop ends it
		// at once; the server's expiry is set a tenth earlier, so a pull
		// normally ends with the server's timeout and loses nothing.
		pctx, cancel := context.WithTimeout(ctx, r.cfg.FetchWait)
		batch, err := cons.Fetch(r.cfg.Fetch, jetstream.FetchContext(pctx))
		if err != nil {
			cancel()
			if ctx.Err() == nil {
				send(fetched{cons: cons, err: err})
			}
			return
		}
		var chunk []jetstream.Msg
		msgs := batch.Messages()
		for open := true; open; {
			msg, ok := <-msgs
			if ok {
				chunk = append(chunk, msg)
			}
			open = ok
			// Take whatever else is already here, then hand it over.
		more:
			for open {
				select {
				case msg, ok := <-msgs:
					if !ok {
						open = false
						break more
					}
					chunk = append(chunk, msg)
				default:
					break more
				}
			}
			if len(chunk) > 0 {
				if !send(fetched{cons: cons, msgs: chunk}) {
					cancel()
					return
				}
				chunk = nil
			}
		}
		err = batch.Error()
		cancel()
		if ctx.Err() != nil {
			return // what this pull brought is delivered again after AckWait
		}
		if err != nil && !errors.Is(err, context.DeadlineExceeded) { // the pull's own deadline is its normal end
			send(fetched{cons: cons, err: err})
			return
		}
	}
}

// attach points the discovery consumer at where discovery stands: right
// after the consumer's ack floor on the lead's first attach, and at the
// runner's own lowest waiting version afterwards (the consumer was
// deleted, or the stream recreated). Until it succeeds it is tried every
// second, and each error is logged once.
func (r *FoldRunner) attach(ctx context.Context) {
	err := r.tryAttach(ctx)
	if err == nil {
		r.attachErr = ""
		return
	}
	r.attachAt = time.Now().Add(time.Second)
	if ctx.Err() != nil {
		return
	}
	r.cm.Batch("attach_error")
	msg := err.Error()
	if msg != r.attachErr {
		if errors.Is(err, jetstream.ErrStreamNotFound) {
			r.log.Warn("waiting for the "+subjects.StreamCommits+" stream (any millrace service creates it at start, or `millrace streams apply`); retrying every second", "err", err)
		} else {
			r.log.Warn("cannot attach the discovery consumer; retrying every second", "err", err)
		}
		r.attachErr = msg
	}
}

func (r *FoldRunner) tryAttach(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	// The stream's creation time says whether its sequences still mean
	// what discovery knows of them.
	stream, err := r.js.Stream(ctx, subjects.StreamCommits)
	if err != nil {
		return fmt.Errorf("the %s stream: %w", subjects.StreamCommits, err)
	}
	created := stream.CachedInfo().Created
	if r.attached && !created.Equal(r.created) {
		r.log.Error("the " + subjects.StreamCommits + " stream was recreated: its sequences start over, so discovery does too")
		r.reset()
	}
	cons, start, err := streams.Attach(ctx, r.js, subjects.StreamCommits, streams.KindFold, r.consumerConfig(),
		streams.Position{Next: r.resumeFrom(), AfterFloor: true}, r.log)
	if err != nil {
		return err
	}
	r.use(cons, created, start)
	return nil
}

// resumeFrom is where the consumer is attached: the lowest version
// waiting, or after the highest delivered when none waits (1 at the
// start of a lead, so that the consumer's ack floor decides).
func (r *FoldRunner) resumeFrom() uint64 {
	if low, ok := r.watermark(); ok {
		return low
	}
	return r.maxSeq + 1
}

// use makes cons the discovery consumer, delivering from start.
func (r *FoldRunner) use(cons jetstream.Consumer, created time.Time, start uint64) {
	first := !r.attached
	r.cons, r.created, r.attached = cons, created, true
	r.fetchErrs, r.fetchAt = 0, time.Time{}
	r.pullRetry.Reset()
	// Below start every version is folded: acknowledged, or the runner's
	// own lowest waiting is start.
	r.maxSeq = max(r.maxSeq, start-1)
	if first {
		r.log.Info("discovering worlds", "from", start, "min_versions", r.cfg.MinVersions,
			"interval", r.cfg.Interval, "concurrency", r.cfg.Concurrency, "hold_for", strings.Join(r.cfg.HoldFor, ","))
		return
	}
	// The waiting versions' replies were the old consumer's, and acks to
	// them go nowhere: the new consumer delivers them again, from the
	// lowest, and they are recorded afresh. What a world has folded
	// (covered) and its pass in flight stay.
	for _, w := range r.worlds {
		w.waiting, w.last = nil, 0
	}
	r.waiting = 0
	r.log.Info("discovery consumer recreated", "from", start)
}

// reset forgets everything the runner knew of the stream (it was
// recreated, so its sequences mean something else now), but for which
// worlds have a pass in flight: one pass at a time per world.
func (r *FoldRunner) reset() {
	for name, w := range r.worlds {
		if !w.folding {
			delete(r.worlds, name)
			continue
		}
		// Its pass still reports here; nothing of the old stream counts.
		*w = *r.newWorld()
		w.folding = true
	}
	r.maxSeq, r.waiting = 0, 0
}

// consumerConfig is the discovery consumer; its ack and deliver policies
// are the core's (streams.Attach, streams.KindFold).
func (r *FoldRunner) consumerConfig() jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       r.cfg.Durable,
		Description:   "millrace compactor: which worlds of the commit log have versions to fold (headers only)",
		FilterSubject: subjects.CommitsFilter,
		AckWait:       r.cfg.AckWait,
		MaxDeliver:    -1,
		MaxAckPending: r.cfg.MaxAckPending,
		HeadersOnly:   true,
		ReplayPolicy:  jetstream.ReplayInstantPolicy,
	}
}

// detach drops the consumer; the next attach makes it again from the
// lowest version waiting.
func (r *FoldRunner) detach() {
	r.cons = nil
	r.attachAt = time.Time{}
}

// fetchFailed decides what a failed pull means: the consumer or the
// stream gone (attach again), or a passing fault such as a disconnect
// (pull again after a backoff).
func (r *FoldRunner) fetchFailed(ctx context.Context, err error) {
	if ctx.Err() != nil {
		return
	}
	gone := errors.Is(err, jetstream.ErrConsumerDeleted) || errors.Is(err, jetstream.ErrConsumerNotFound)
	if !gone {
		ictx, cancel := context.WithTimeout(ctx, 5*time.Second)
		_, ierr := r.cons.Info(ictx)
		cancel()
		gone = errors.Is(ierr, jetstream.ErrConsumerNotFound) || errors.Is(ierr, jetstream.ErrStreamNotFound)
	}
	r.cm.Batch("pull_error")
	if gone {
		r.log.Warn("the discovery consumer is gone; recreating it from the lowest version waiting", "err", err)
		r.detach()
		return
	}
	r.fetchErrs++
	r.cm.Retry()
	wait := r.pullRetry.Next()
	r.fetchAt = time.Now().Add(wait)
	if r.fetchErrs == 1 || r.fetchErrs%20 == 0 {
		r.log.Warn("pull from the discovery consumer failed; retrying", "err", err, "failures", r.fetchErrs, "retry_in", wait)
	}
}

// take records a pull. A version already folded (at or below its world's
// position, or delivered again after its world's pass) is acked at once;
// a version delivered again while it waits keeps its place.
func (r *FoldRunner) take(msgs []jetstream.Msg) {
	if r.fetchErrs > 0 {
		r.log.Info("pulling from the discovery consumer again", "failures", r.fetchErrs)
		r.fetchErrs = 0
		r.pullRetry.Reset()
	}
	for _, msg := range msgs {
		meta, err := msg.Metadata()
		if err != nil {
			r.log.Warn("a delivery without metadata; skipped (JetStream delivers it again)", "subject", msg.Subject(), "err", err)
			continue
		}
		seq := meta.Sequence.Stream
		r.maxSeq = max(r.maxSeq, seq)
		r.undelivered = meta.NumPending
		world, _, ok := subjects.ParseCommits(msg.Subject())
		if !ok {
			r.log.Warn("a message on COMMITS that is not a document version; acknowledged and skipped", "subject", msg.Subject(), "seq", seq)
			r.ack(msg.Reply())
			continue
		}
		w := r.worlds[world]
		if w == nil {
			w = r.newWorld()
			r.worlds[world] = w
		}
		switch {
		case seq <= w.covered:
			r.ack(msg.Reply()) // folded by a pass before discovery got here
		case seq <= w.last:
			if _, found := slices.BinarySearchFunc(w.waiting, seq, cmpWait); !found {
				r.ack(msg.Reply()) // delivered again after its pass
			}
		default:
			w.last = seq
			w.waiting = append(w.waiting, waitVersion{seq: seq, at: meta.Timestamp.UnixNano(), reply: msg.Reply()})
			r.waiting++
			r.m.discovered()
			if len(w.waiting) == r.cfg.MinVersions || r.waiting == r.cfg.MaxAckPending/2 {
				r.urgent = true
			}
		}
	}
}

func cmpWait(v waitVersion, seq uint64) int { return cmp.Compare(v.seq, seq) }

// ack acknowledges one delivery. A lost ack costs a redelivery after
// AckWait, which finds the version folded and acks it again.
func (r *FoldRunner) ack(reply string) {
	if reply == "" {
		return
	}
	if err := r.js.Conn().Publish(reply, ackBody); err != nil {
		r.log.Debug("ack not sent; JetStream delivers the version again after AckWait", "err", err)
	}
}

// schedule starts passes of the worlds that are due, oldest waiting
// version first (they hold the acknowledgement back), up to Concurrency.
func (r *FoldRunner) schedule(ctx context.Context, done chan<- passDone, now time.Time) {
	if r.inFlight >= r.cfg.Concurrency || ctx.Err() != nil {
		return
	}
	pressure := r.waiting >= r.cfg.MaxAckPending/2
	var floor string
	var floorSeq uint64
	type due struct {
		world string
		first uint64
	}
	var ready []due
	for name, w := range r.worlds {
		if len(w.waiting) == 0 {
			continue
		}
		first := w.waiting[0]
		if floor == "" || first.seq < floorSeq {
			floor, floorSeq = name, first.seq
		}
		if w.folding || now.Before(w.retryAt) {
			continue
		}
		if len(w.waiting) >= r.cfg.MinVersions || now.Sub(time.Unix(0, first.at)) >= r.cfg.Interval {
			ready = append(ready, due{name, first.seq})
		}
	}
	if pressure && floor != "" {
		w := r.worlds[floor]
		if !w.folding && !now.Before(w.retryAt) && !slices.ContainsFunc(ready, func(d due) bool { return d.world == floor }) {
			ready = append(ready, due{floor, floorSeq})
		}
	}
	slices.SortFunc(ready, func(a, b due) int { return cmp.Compare(a.first, b.first) })
	for _, d := range ready {
		if r.inFlight >= r.cfg.Concurrency {
			break
		}
		w := r.worlds[d.world]
		w.folding, w.cut = true, w.last
		r.inFlight++
		go r.pass(ctx, d.world, len(w.waiting), done)
	}
}

// pass runs FoldWorld on one world and reports; a panic in the folder is
// a failed pass, not a dead process.
func (r *FoldRunner) pass(ctx context.Context, world string, waiting int, done chan<- passDone) {
	start := time.Now()
	d := passDone{world: world}
	defer func() {
		if p := recover(); p != nil {
			d.err = fmt.Errorf("panic: %v\n%s", p, debug.Stack())
		}
		d.took = time.Since(start)
		done <- d
	}()
	d.st, d.err = FoldWorld(ctx, r.js, r.f, world, FoldWaiting(waiting), HoldFor(r.cfg.HoldFor...))
}

// finish records a pass. After a pass that succeeded, every version
// delivered before it began is folded or gone from the stream (the pass
// read the world up to its last message), and so is everything at or
// below the folder's position.
func (r *FoldRunner) finish(d passDone, abandoned bool) {
	r.inFlight--
	r.noteHolders(d.st)
	w := r.worlds[d.world]
	if w == nil {
		return // the stream was recreated meanwhile
	}
	w.folding = false
	if d.err != nil {
		if abandoned {
			r.m.pass("abandoned", d.took, d.st)
			r.log.Info("pass abandoned (stopping, or the lead lost); the world stays unacknowledged for the next leader", "world", d.world, "err", d.err)
			return
		}
		r.m.pass("error", d.took, d.st)
		r.cm.Batch("error")
		r.cm.Retry()
		w.fails++
		wait := w.retry.Next()
		w.retryAt = time.Now().Add(wait)
		r.log.Warn("pass failed; the world is retried later, others go on", "world", d.world, "err", d.err,
			"failures", w.fails, "retry_in", wait, "waiting", len(w.waiting))
		return
	}
	w.fails, w.retryAt = 0, time.Time{}
	w.retry.Reset()
	w.covered = max(w.covered, d.st.Position())
	upto := max(w.cut, w.covered)
	n, _ := slices.BinarySearchFunc(w.waiting, upto+1, cmpWait)
	for _, v := range w.waiting[:n] {
		r.ack(v.reply)
	}
	w.waiting = slices.Delete(w.waiting, 0, n)
	r.waiting -= n
	if len(w.waiting) == 0 {
		w.waiting = nil // let a big world's slice go
	}
	switch {
	case d.st.Versions > 0 || d.st.Swept > 0:
		r.m.pass("folded", d.took, d.st)
		r.log.Info("folded", "world", d.world, "versions", d.st.Versions, "dropped", d.st.Dropped,
			"swept", d.st.Swept, "withheld", d.st.Withheld, "to", d.st.To, "seconds", roundSeconds(d.took))
	default:
		r.m.pass("idle", d.took, d.st)
		r.log.Debug("nothing new to fold", "world", d.world, "checkpoint", w.covered, "seconds", roundSeconds(d.took))
	}
}

// noteHolders warns once of each holder a pass found missing, and says
// when one is back.
func (r *FoldRunner) noteHolders(st FoldStats) {
	for _, name := range st.Missing {
		if !r.missing[name] {
			r.missing[name] = true
			r.log.Warn("a consumer that holds deletions back does not exist on "+subjects.StreamCommits+
				": nothing is deleted from it until the consumer is created (by its export) or no longer named a holder",
				"holder", name)
		}
	}
	if !st.held {
		return
	}
	for name := range r.missing {
		if !slices.Contains(st.Missing, name) {
			delete(r.missing, name)
			r.log.Info("a consumer that holds deletions back exists again; deletions resume up to its ack floor", "holder", name)
		}
	}
}

func roundSeconds(d time.Duration) float64 {
	return float64(d.Round(time.Millisecond)) / float64(time.Second)
}

// watermark is the lowest waiting version of any world (ok false: none
// waits).
func (r *FoldRunner) watermark() (uint64, bool) {
	var low uint64
	found := false
	for _, w := range r.worlds {
		if len(w.waiting) > 0 && (!found || w.waiting[0].seq < low) {
			low, found = w.waiting[0].seq, true
		}
	}
	return low, found
}

// tidy forgets the worlds with nothing waiting whose position is at or
// below what discovery has delivered (from then on every delivery of
// theirs is new, and the position filters nothing), and updates the
// gauges. The worlds kept are those waiting or folding, and those a pass
// folded further than discovery has read: their position spares a pass
// when discovery delivers what is already folded.
func (r *FoldRunner) tidy(now time.Time) {
	dirty, waiting := 0, 0
	var oldest int64
	pos := r.maxSeq // every version below the lowest waiting is folded
	for name, w := range r.worlds {
		if len(w.waiting) == 0 {
			if !w.folding && w.covered <= r.maxSeq {
				delete(r.worlds, name)
			}
			continue
		}
		dirty++
		waiting += len(w.waiting)
		if oldest == 0 || w.waiting[0].at < oldest {
			oldest = w.waiting[0].at
		}
		pos = min(pos, w.waiting[0].seq-1)
	}
	var age time.Duration
	if oldest != 0 {
		age = max(0, now.Sub(time.Unix(0, oldest)))
	}
	r.cm.Position(pos)
	r.cm.Lag(age, uint64(waiting)+r.undelivered)
	if r.m == nil {
		return
	}
	r.m.worldsDirty.Set(float64(dirty))
	r.m.waiting.Set(float64(waiting))
}
