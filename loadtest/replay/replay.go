package replay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"time"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/knob"
)

// Config of one replay run. Scripts and Target are required. A zero field
// takes its default; a negative one is refused by Run, unless its comment
// gives negative a meaning.
type Config struct {
	// Target is the BES server's host:port.
	Target string
	// Scripts are the builds to replay, taken round robin.
	Scripts []*Script
	// Streams is how many invocations run at once (each worker replays one
	// invocation after another). Default 1.
	Streams int
	// Conns is how many gRPC connections the workers share. Default
	// Streams: one per worker, as every Bazel client has its own (more than
	// Streams would sit unused, and are cut to Streams).
	Conns int
	// Projects are the project ids the workers send, worker i taking
	// Projects[i % len]. Empty: the recorded project ids.
	Projects []string

	// Events stops the run once workers have started invocations holding
	// this many events; the invocations under way finish. 0: no limit.
	Events int64
	// Duration stops the run after this long; invocations under way are cut
	// short (their streams half-close early, as if the build stopped, and
	// every event sent is still acknowledged). 0: no limit.
	Duration time.Duration

	// Rate is the total events per second to send, spread evenly over the
	// workers; 0 sends flat out.
	Rate float64
	// RateJitter spreads the workers' rates uniformly over
	// (1 ± RateJitter) × Rate/Streams, so that streams do not move in step.
	// Default 0.2; negative: none.
	RateJitter float64
	// Warmup (paced only) starts each worker's first invocation at a random
	// point of its script, and sends the events before that point during
	// the warm-up, so that at its end the invocations are spread over their
	// lives as in a steady state and some finish every second. Ack latency
	// and window counts only include events sent after the warm-up.
	Warmup time.Duration
	// WarmupPhase bounds that random point to the first WarmupPhase of
	// the script (0 < WarmupPhase <= 1; default 1), which keeps the
	// warm-up's burst smaller on a small machine.
	WarmupPhase float64
	// WarmupEvents, above 0, also bounds that point to the script's first
	// WarmupEvents events. At thousands of streams it caps what the
	// warm-up must send (a stream of a long build starts early in its
	// life) while streams of builds shorter than the bound still start
	// anywhere in theirs, so that some finish every second. 0: no bound.
	WarmupEvents int
	// Ramp (paced, without a warm-up) starts worker i's first invocation
	// i × Ramp / Streams after the start, so that thousands of streams do
	// not dial, send their lifecycle calls and open their streams in the
	// same second. The ramp is part of the measured window. 0: every
	// worker starts within its first interval.
	Ramp time.Duration
	// Seed makes the phases and rates repeatable.
	Seed uint64

	// Retries is how many times a failed stream or lifecycle call is tried
	// again, as Bazel 4 does: a stream resumes on a new stream from its
	// first unacknowledged event, after Backoff × 1.6^n. Not retried, as
	// by Bazel: INVALID_ARGUMENT, FAILED_PRECONDITION, a wrong ack, and a
	// stream closed OK before every event was acknowledged. Default 4;
	// negative: none (each failure is counted and the invocation given up).
	Retries int
	// Backoff is the first retry's wait. Default 1s, Bazel's.
	Backoff time.Duration

	// SeriesStep, above 0, also keeps the tool events' ack latencies per
	// step of the time they were first sent (Result.AckSeries), so that a
	// run can tell what clients saw while something happened to the
	// server (a rolling restart).
	SeriesStep time.Duration

	// OnStreamDone, when set, is called as soon as a tool event stream has
	// sent and had acknowledged every one of its events, before the
	// finishing lifecycle events (from the worker's goroutine: it should be
	// quick).
	OnStreamDone func(StreamDone)
}

// StreamDone describes a tool event stream replayed to the end.
type StreamDone struct {
	// InvocationID is the stream's (new) invocation id.
	InvocationID string
	// LastSequence is the sequence number of the stream's last event
	// (ComponentStreamFinished), and LastAck when its ack arrived.
	LastSequence int64
	LastAck      time.Time
}

// Validate reports what is wrong with c.
func (c Config) Validate() error {
	errs := []error{
		knob.NotNegative("replay", "Streams", c.Streams, 1),
		knob.NotNegative("replay", "Conns", c.Conns, "Streams"),
		knob.NotNegative("replay", "Events", c.Events, "no limit"),
		knob.NotNegative("replay", "Duration", c.Duration, "no limit"),
		knob.NotNegative("replay", "Rate", c.Rate, "flat out"),
		knob.NotNegative("replay", "Warmup", c.Warmup, "none"),
		knob.NotNegative("replay", "WarmupEvents", c.WarmupEvents, "no bound"),
		knob.NotNegative("replay", "Ramp", c.Ramp, "none"),
		knob.NotNegative("replay", "Backoff", c.Backoff, time.Second),
		knob.NotNegative("replay", "SeriesStep", c.SeriesStep, "none"),
	}
	if c.Ramp > 0 && (c.Rate == 0 || c.Warmup > 0) {
		errs = append(errs, errors.New("replay: Ramp is for paced runs without a warm-up (a warm-up spreads the streams' starts itself)"))
	}
	if c.WarmupPhase < 0 || c.WarmupPhase > 1 {
		errs = append(errs, fmt.Errorf("replay: WarmupPhase %v is not in 0..1; set 0 for the default (1) or a fraction of the script", c.WarmupPhase))
	}
	if len(c.Scripts) == 0 {
		errs = append(errs, errors.New("replay: no scripts"))
	}
	if c.Target == "" {
		errs = append(errs, errors.New("replay: no target"))
	}
	return errors.Join(errs...)
}

func (c Config) withDefaults() Config {
	if c.Streams == 0 {
		c.Streams = 1
	}
	if c.Conns == 0 || c.Conns > c.Streams {
		c.Conns = c.Streams
	}
	if c.RateJitter == 0 {
		c.RateJitter = 0.2
	}
	if c.RateJitter < 0 {
		c.RateJitter = 0
	}
	if c.WarmupPhase == 0 {
		c.WarmupPhase = 1
	}
	if c.Retries == 0 {
		c.Retries = 4
	}
	if c.Retries < 0 {
		c.Retries = 0
	}
	if c.Backoff == 0 {
		c.Backoff = time.Second
	}
	return c
}

// Result of a run.
type Result struct {
	// Elapsed is from the start until every worker finished.
	Elapsed time.Duration
	// Window is the measurement window: from the end of the warm-up to the
	// stop (the whole run when flat out).
	Window time.Duration
	// ToolEvents acknowledged, LifecycleEvents stored, in the whole run.
	ToolEvents      int64
	LifecycleEvents int64
	// ToolEventsSent may exceed ToolEvents when streams failed.
	ToolEventsSent int64
	// WindowEvents were sent inside the window and acknowledged.
	WindowEvents int64
	// Invocations replayed to the end, cut short by the stop, or failed.
	Invocations int64
	Truncated   int64
	Failed      int64
	// Errors by kind ("stream Unavailable", "ack mismatch", ...), and the
	// first few messages: failures the retries did not get past.
	Errors       map[string]int64
	ErrorSamples []string
	// Retried are the failures that were tried again, by kind, and
	// Resumed the streams that went on from their first unacknowledged
	// event on a new stream.
	Retried map[string]int64
	Resumed int64
	// AckSeries[i] holds the ack latencies of tool events first sent
	// between Elapsed i×SeriesStep and (i+1)×SeriesStep from the start
	// (Config.SeriesStep; nil without).
	AckSeries []*Histogram
	// Ack latencies of tool events sent in the window; of those sent during
	// the warm-up; and of lifecycle calls in the window.
	Ack       *Histogram
	WarmupAck *Histogram
	Lifecycle *Histogram
}

// Events is every event stored: tool and lifecycle.
func (r *Result) Events() int64 { return r.ToolEvents + r.LifecycleEvents }

// Run replays until the configured stop, or until ctx ends (which cancels
// the streams under way and returns ctx's error).
func Run(ctx context.Context, cfg Config) (*Result, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	r := &runner{
		cfg:   cfg,
		stopC: make(chan struct{}),
		res: &Result{
			Errors: map[string]int64{}, Retried: map[string]int64{}, Ack: new(Histogram), WarmupAck: new(Histogram), Lifecycle: new(Histogram),
		},
		codec: grpc.ForceCodecV2(newRawCodec()),
	}
	for range cfg.Conns {
		cc, err := grpc.NewClient(cfg.Target,
			grpc.WithTransportCredentials(insecure.NewCredentials()),
			grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64<<20)))
		if err != nil {
			r.close()
			return nil, fmt.Errorf("replay: dial %s: %w", cfg.Target, err)
		}
		r.conns = append(r.conns, cc)
		r.clients = append(r.clients, buildpb.NewPublishBuildEventClient(cc))
	}
	defer r.close()

	r.start = time.Now()
	r.measureFrom = r.start
	if cfg.Rate > 0 {
		r.measureFrom = r.start.Add(cfg.Warmup)
	}
	if cfg.Duration > 0 {
		t := time.AfterFunc(cfg.Duration, r.stop)
		defer t.Stop()
	}
	var wg sync.WaitGroup
	for i := range cfg.Streams {
		wg.Go(func() { r.worker(ctx, i) })
	}
	wg.Wait()
	end := time.Now()
	r.stop()
	res := r.res
	res.Elapsed = end.Sub(r.start)
	stopAt := r.stopAt.Load()
	if stopAt == nil || stopAt.After(end) {
		stopAt = &end
	}
	res.Window = max(0, stopAt.Sub(r.measureFrom))
	res.ToolEvents = r.toolEvents.Load()
	res.LifecycleEvents = r.lifecycleEvents.Load()
	res.ToolEventsSent = r.sent.Load()
	res.WindowEvents = r.windowEvents.Load()
	res.Invocations = r.invocations.Load()
	res.Truncated = r.truncated.Load()
	res.Failed = r.failed.Load()
	res.Resumed = r.resumed.Load()
	res.AckSeries = r.series
	return res, ctx.Err()
}

type runner struct {
	cfg     Config
	conns   []*grpc.ClientConn
	clients []buildpb.PublishBuildEventClient
	codec   grpc.CallOption

	start, measureFrom time.Time
	stopOnce           sync.Once
	stopC              chan struct{}
	stopAt             atomic.Pointer[time.Time]

	next, claimed atomic.Int64
	toolEvents, lifecycleEvents, sent, windowEvents,
	invocations, truncated, failed, resumed atomic.Int64

	mu     sync.Mutex // guards res.Errors, res.ErrorSamples, res.Retried and series
	res    *Result
	series []*Histogram
}

func (r *runner) close() {
	for _, cc := range r.conns {
		cc.Close()
	}
}

func (r *runner) stop() {
	r.stopOnce.Do(func() {
		now := time.Now()
		r.stopAt.Store(&now)
		close(r.stopC)
	})
}

func (r *runner) stopping() bool {
	select {
	case <-r.stopC:
		return true
	default:
		return false
	}
}

// recordSeries adds an ack latency to the step of its send time.
func (r *runner) recordSeries(sent time.Time, d time.Duration) {
	if r.cfg.SeriesStep <= 0 {
		return
	}
	i := max(0, int(sent.Sub(r.start)/r.cfg.SeriesStep))
	r.mu.Lock()
	for len(r.series) <= i {
		r.series = append(r.series, new(Histogram))
	}
	h := r.series[i]
	r.mu.Unlock()
	h.Record(d)
}

// Between merges the steps of a series (Result.AckSeries, steps of step)
// that overlap from..to, durations since the run's start.
func Between(series []*Histogram, step, from, to time.Duration) *Histogram {
	h := new(Histogram)
	if step <= 0 {
		return h
	}
	for i, s := range series {
		at := time.Duration(i) * step
		if at+step > from && at <= to {
			h.Merge(s)
		}
	}
	return h
}

// retry reports whether a failure of this kind is tried again after the
// retry-th (from 0), and waits the backoff first; false when it is given
// up, the run stops, or ctx ends.
func (r *runner) retry(ctx context.Context, retry int, kind string, err error) bool {
	if retry >= r.cfg.Retries || !retriable(err) || r.stopping() || ctx.Err() != nil {
		return false
	}
	r.mu.Lock()
	r.res.Retried[kind]++
	r.mu.Unlock()
	d := time.Duration(float64(r.cfg.Backoff) * math.Pow(1.6, float64(retry)))
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return true
	case <-ctx.Done():
		return false
	case <-r.stopC:
		return false
	}
}

// retriable: what Bazel 4 tries again. errNoRetry marks the client's own
// verdicts that Bazel fails on (a wrong ack, an early close).
func retriable(err error) bool {
	if errors.Is(err, errNoRetry) {
		return false
	}
	switch status.Code(err) {
	case codes.InvalidArgument, codes.FailedPrecondition:
		return false
	}
	return true
}

var errNoRetry = errors.New("not retried")

func (r *runner) error(kind string, err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.res.Errors[kind]++
	if len(r.res.ErrorSamples) < 10 {
		r.res.ErrorSamples = append(r.res.ErrorSamples, kind+": "+err.Error())
	}
}

// worker is one stream slot: one invocation after another.
type worker struct {
	client  buildpb.PublishBuildEventClient
	project string
	rng     *rand.Rand
	pace    pacer
}

func (r *runner) worker(ctx context.Context, i int) {
	w := &worker{
		client: r.clients[i%len(r.clients)],
		rng:    rand.New(rand.NewPCG(r.cfg.Seed, uint64(i))),
		pace:   pacer{stopC: r.stopC},
	}
	if len(r.cfg.Projects) > 0 {
		w.project = r.cfg.Projects[i%len(r.cfg.Projects)]
	}
	first := true
	for ctx.Err() == nil && !r.stopping() {
		s := r.cfg.Scripts[int(r.next.Add(1)-1)%len(r.cfg.Scripts)]
		n := int64(s.Events())
		if r.cfg.Events > 0 && r.claimed.Add(n)-n >= r.cfg.Events {
			return
		}
		if r.cfg.Rate > 0 && first {
			rate := r.cfg.Rate / float64(r.cfg.Streams) * (1 + r.cfg.RateJitter*(2*w.rng.Float64()-1))
			w.pace.interval = time.Duration(float64(time.Second) / rate)
			// Each stream starts at its own offset within one interval,
			// so that the streams do not send in step.
			steady := rampStart(r.measureFrom, r.cfg.Ramp, i, r.cfg.Streams).Add(time.Duration(w.rng.Float64() * float64(w.pace.interval)))
			w.pace.next = steady
			if phase := warmupPoint(w.rng.Float64(), r.cfg.WarmupPhase, r.cfg.WarmupEvents, n); r.cfg.Warmup > 0 && phase > 0 {
				// Send the first phase events of this invocation during
				// the warm-up, then go on at the stream's own pace.
				w.pace.warm = phase
				w.pace.warmInterval = r.cfg.Warmup / time.Duration(phase+1)
				w.pace.next = r.start.Add(w.pace.warmInterval)
				w.pace.steadyFrom = steady
			}
		}
		first = false
		r.invocation(ctx, w, s)
		if ctx.Err() == nil && r.stopping() {
			return
		}
	}
}

// rampStart is when worker i of streams starts its pace: from, plus its
// share of the ramp.
func rampStart(from time.Time, ramp time.Duration, i, streams int) time.Time {
	if ramp <= 0 || streams <= 0 {
		return from
	}
	return from.Add(ramp * time.Duration(i) / time.Duration(streams))
}

// warmupPoint is where, u (uniform in [0, 1)) of the way into its range, a
// stream's first invocation of n events starts: within the first phase of
// the script, and within its first maxEvents events when that is above 0.
func warmupPoint(u, phase float64, maxEvents int, n int64) int {
	p := u * phase * float64(n)
	if maxEvents > 0 {
		p = min(p, u*float64(maxEvents))
	}
	return int(p)
}

// backoff after a failed invocation, so that a refusing server is not
// hammered in a tight loop.
const backoff = 100 * time.Millisecond

func (r *runner) invocation(ctx context.Context, w *worker, s *Script) {
	buildID := NewID()
	invs := make(map[string]string, len(s.Streams))
	for _, ts := range s.Streams {
		invs[ts.InvocationID] = NewID()
	}
	fail := func() {
		r.failed.Add(1)
		select {
		case <-time.After(backoff):
		case <-ctx.Done():
		}
	}
	for _, req := range s.Before {
		if !w.pace.wait(ctx) {
			r.truncated.Add(1)
			return
		}
		if _, err := r.lifecycle(ctx, w, lifecycle(req, buildID, invs, w.project)); err != nil {
			fail()
			return
		}
	}
	for _, ts := range s.Streams {
		ids, err := newStreamIDs(buildID, invs[ts.InvocationID], w.project, ts.component)
		if err != nil {
			r.error("encode", err)
			fail()
			return
		}
		complete, at, err := r.stream(ctx, w, ts, ids)
		if err != nil {
			fail()
			return
		}
		if !complete {
			r.truncated.Add(1)
			return
		}
		if r.cfg.OnStreamDone != nil {
			r.cfg.OnStreamDone(StreamDone{InvocationID: ids.sid.InvocationId, LastSequence: int64(len(ts.Requests)), LastAck: at})
		}
	}
	// The finishing events go out even after the stop: the invocation's
	// stream is complete and a build would not leave them out.
	for _, req := range s.After {
		if !r.stopping() {
			w.pace.wait(ctx)
		}
		if _, err := r.lifecycle(ctx, w, lifecycle(req, buildID, invs, w.project)); err != nil {
			fail()
			return
		}
	}
	r.invocations.Add(1)
}

func (r *runner) lifecycle(ctx context.Context, w *worker, req *buildpb.PublishLifecycleEventRequest) (time.Time, error) {
	t0 := time.Now()
	var err error
	for retry := 0; ; retry++ {
		if _, err = w.client.PublishLifecycleEvent(ctx, req); err == nil || !r.retry(ctx, retry, "lifecycle "+status.Code(err).String(), err) {
			break
		}
	}
	t1 := time.Now()
	if err != nil {
		if ctx.Err() == nil {
			r.error("lifecycle "+status.Code(err).String(), err)
		}
		return t1, err
	}
	r.lifecycleEvents.Add(1)
	if !t0.Before(r.measureFrom) {
		r.res.Lifecycle.Record(t1.Sub(t0))
		r.windowEvents.Add(1)
	}
	return t1, nil
}

// stream sends one invocation's tool events as Bazel does and reads the
// acks as they come; a failed stream is resumed on a new one from its
// first unacknowledged event (Config.Retries). complete is false when the
// run's stop cut the stream short; at is when the last ack arrived.
func (r *runner) stream(ctx context.Context, w *worker, ts *ToolStream, ids streamIDs) (complete bool, at time.Time, err error) {
	st := &streamState{sentAt: make([]atomic.Int64, len(ts.Requests))}
	for retry := 0; ; retry++ {
		complete, kind, err := r.attempt(ctx, w, ts, ids, st)
		if err == nil {
			return complete, st.last, nil
		}
		if !r.retry(ctx, retry, kind, err) {
			if ctx.Err() == nil {
				r.error(kind, err)
			}
			return false, st.last, err
		}
		r.resumed.Add(1)
	}
}

// streamState is what one invocation's stream has done over its attempts.
type streamState struct {
	// sentAt[i] is when event i was first handed to gRPC (a resent event's
	// ack latency counts from there, as its build waited that long).
	sentAt []atomic.Int64
	// sent events went out at least once; acked is the first
	// unacknowledged one.
	sent, acked int
	last        time.Time
}

// attempt is one PublishBuildToolEventStream: the events from st.acked on,
// those already sent once resent at once and the rest paced. kind names a
// failure for the counts.
func (r *runner) attempt(ctx context.Context, w *worker, ts *ToolStream, ids streamIDs, st *streamState) (complete bool, kind string, err error) {
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	cs, err := w.client.PublishBuildToolEventStream(sctx, r.codec)
	if err != nil {
		return false, "stream " + status.Code(err).String(), err
	}
	n, from := len(ts.Requests), st.acked

	type recvResult struct {
		acked int
		last  time.Time
		err   error
		kind  string
	}
	recvDone := make(chan recvResult, 1)
	go func() {
		var res recvResult
		var ack buildpb.PublishBuildToolEventStreamResponse
		for {
			err := cs.RecvMsg(&ack)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				res.err, res.kind = err, "stream "+status.Code(err).String()
				break
			}
			now := time.Now()
			i := from + res.acked
			if i >= n || ack.GetSequenceNumber() != ts.Requests[i].GetOrderedBuildEvent().GetSequenceNumber() ||
				ack.GetStreamId().GetInvocationId() != ids.sid.InvocationId || ack.GetStreamId().GetBuildId() != ids.sid.BuildId {
				res.err = fmt.Errorf("%w: invocation %s: ack #%d is for %s/%s sequence %d", errNoRetry, ids.sid.InvocationId, i+1,
					ack.GetStreamId().GetBuildId(), ack.GetStreamId().GetInvocationId(), ack.GetSequenceNumber())
				res.kind = "ack mismatch"
				cancel()
				break
			}
			sent := time.Unix(0, st.sentAt[i].Load())
			r.recordSeries(sent, now.Sub(sent))
			if sent.Before(r.measureFrom) {
				r.res.WarmupAck.Record(now.Sub(sent))
			} else {
				r.res.Ack.Record(now.Sub(sent))
				r.windowEvents.Add(1)
			}
			r.toolEvents.Add(1)
			res.acked++
			res.last = now
		}
		recvDone <- res
	}()

	sent := from
	for i := from; i < n; i++ {
		if i >= st.sent {
			if !w.pace.wait(sctx) {
				break
			}
			st.sentAt[i].Store(time.Now().UnixNano())
			st.sent++
			r.sent.Add(1)
		}
		if err := cs.SendMsg(frame(ts.request(i, ids))); err != nil {
			break // the stream ended; RecvMsg has the status
		}
		sent = i + 1
	}
	cs.CloseSend()
	res := <-recvDone
	st.acked = from + res.acked
	if res.acked > 0 {
		st.last = res.last
	}
	switch {
	case res.err != nil:
		return false, res.kind, res.err
	case st.acked != sent:
		return false, "early close", fmt.Errorf("%w: invocation %s: the server closed the stream OK after %d acks for %d events", errNoRetry, ids.sid.InvocationId, st.acked, sent)
	}
	return sent == n, "", nil
}

// pacer spaces one worker's events.
type pacer struct {
	interval time.Duration // 0: flat out
	next     time.Time
	stopC    <-chan struct{}
	// warm-up: the first warm events are spaced by warmInterval, and the
	// steady pace starts at steadyFrom.
	warm         int
	warmInterval time.Duration
	steadyFrom   time.Time
}

// maxLag is how far a paced worker may fall behind its schedule before it
// gives up catching up (a burst to catch up would not be the pace asked).
const maxLag = time.Second

// wait blocks until the next event is due; false when the run stops first.
func (p *pacer) wait(ctx context.Context) bool {
	if p.interval == 0 {
		select {
		case <-p.stopC:
			return false
		default:
			return ctx.Err() == nil
		}
	}
	if d := time.Until(p.next); d > 0 {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
		case <-p.stopC:
			return false
		case <-ctx.Done():
			return false
		}
	} else {
		select {
		case <-p.stopC:
			return false
		default:
		}
	}
	switch {
	case p.warm > 0:
		p.warm--
		p.next = p.next.Add(p.warmInterval)
		if p.warm == 0 {
			p.next = p.steadyFrom
		}
	default:
		p.next = p.next.Add(p.interval)
		if now := time.Now(); now.Sub(p.next) > maxLag {
			p.next = now
		}
	}
	return ctx.Err() == nil
}
