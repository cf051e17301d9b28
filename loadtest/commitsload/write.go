package commitsload

import (
	"cmp"
	"context"
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/loadtest/replay"
	commitspb "github.com/millrace/millrace/schemas/commits"
)

// writer is the write phase's shared state.
type writer struct {
	cfg    Config
	led    *ledger
	out    *printer
	seed   uint64
	worlds int
	docs   int

	// known is, per document (world × docs + doc), the latest version
	// this run saw acknowledged: the expected version of a
	// compare-and-set.
	known []atomic.Uint64

	start, windowStart time.Time
	deadline           time.Time // of the current phase; zero: none
	lastAck            atomic.Int64
	hist               replay.Histogram
	limiter            *rate.Limiter

	next                                   atomic.Int64
	attempted, acked, windowAcked, fillAck atomic.Int64
	casWrites, conflicts, errs             atomic.Int64

	mu       sync.Mutex
	byCode   map[string]int64
	samples  []string
	refusal  error // a permanent refusal that stops the run
	slots    []*slot
	stopLoad context.CancelFunc
}

// slot is one put in flight of a writer: its own random source, body
// buffer and share of the ledger (merged at the end, so no lock per put).
type slot struct {
	rng    *rand.Rand
	body   []byte
	acks   []ack
	doubts []doubt
}

// dial opens a plaintext gRPC connection to addr (loopback and test
// networks; a TLS edge is out of this tool's scope).
func dial(addr string) (*grpc.ClientConn, error) {
	return grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
}

func withKey(ctx context.Context, key string) context.Context {
	return metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+key)
}

// runWrites runs the fill and the updates and fills in the ledger.
func runWrites(ctx context.Context, cfg Config, led *ledger, seed uint64, out *printer) (*Write, error) {
	w := &writer{cfg: cfg, led: led, out: out, seed: seed, worlds: len(led.worlds), docs: cfg.Docs,
		known: make([]atomic.Uint64, len(led.worlds)*cfg.Docs), byCode: map[string]int64{}}
	if cfg.Rate > 0 {
		// A burst of 10 ms of puts lets the pacer keep up despite timer
		// granularity without bunching puts up.
		w.limiter = rate.NewLimiter(rate.Limit(cfg.Rate), max(1, int(cfg.Rate/100)))
	}
	conns := make([]*grpc.ClientConn, 0, cfg.Writers)
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	clients := make([]commitspb.CommitsClient, cfg.Writers)
	for i := range clients {
		if i == 0 || !cfg.SharedConn {
			c, err := dial(cfg.Addr)
			if err != nil {
				return nil, fmt.Errorf("dial the edge at %s: %w", cfg.Addr, err)
			}
			conns = append(conns, c)
		}
		clients[i] = commitspb.NewCommitsClient(conns[len(conns)-1])
	}
	for range cfg.Writers * cfg.InFlight {
		w.slots = append(w.slots, nil)
	}

	cpu0 := selfCPU()
	w.start = time.Now()
	w.windowStart = w.start.Add(cfg.Warmup)
	progressCtx, stopProgress := context.WithCancel(ctx)
	var pwg sync.WaitGroup
	pwg.Add(1)
	go func() { defer pwg.Done(); w.progress(progressCtx) }()

	callCtx := withKey(ctx, cfg.APIKey)
	fillN := int64(w.worlds) * int64(w.docs)
	var fillEnd time.Time
	var phaseErr error
	if cfg.Fill {
		phaseErr = w.phase(ctx, callCtx, clients, fillN, true, 0)
		fillEnd = time.Now()
	}
	var end time.Time
	if phaseErr == nil && (cfg.Writes > 0 || cfg.Duration > 0) {
		phaseErr = w.phase(ctx, callCtx, clients, cfg.Writes, false, cfg.Duration)
	}
	stopProgress()
	pwg.Wait()
	switch last := time.Unix(0, w.lastAck.Load()); {
	case !w.deadline.IsZero() && !last.Before(w.deadline):
		end = w.deadline
	case w.lastAck.Load() > 0:
		end = last
	default:
		end = time.Now()
	}

	rep := &Write{
		Attempted: w.attempted.Load(), Acked: w.acked.Load(), FillAcked: w.fillAck.Load(),
		CASWrites: w.casWrites.Load(), Conflicts: w.conflicts.Load(), Errors: w.errs.Load(),
		ElapsedS: round(time.Since(w.start).Seconds(), 2), WindowAcked: w.windowAcked.Load(),
		Latency: w.hist.Summary(), ClientMaxRSSKiB: selfMaxRSSKiB(),
	}
	if !fillEnd.IsZero() {
		rep.FillS = round(fillEnd.Sub(w.start).Seconds(), 2)
	}
	if window := end.Sub(w.windowStart); window > 0 {
		rep.WindowS = round(window.Seconds(), 3)
		rep.AckedPerS = per(float64(rep.WindowAcked), window)
	}
	cpu := selfCPU() - cpu0
	rep.ClientCPUS = round(cpu.Seconds(), 2)
	if rep.Acked > 0 {
		rep.ClientCPUPer1k = round(cpu.Seconds()/float64(rep.Acked)*1000, 4)
	}
	w.mu.Lock()
	if len(w.byCode) > 0 {
		rep.ErrorsByCode = w.byCode
	}
	rep.ErrorSamples = w.samples
	refusal := w.refusal
	w.mu.Unlock()

	// The ledger, in version order.
	for _, s := range w.slots {
		if s != nil {
			led.acks = append(led.acks, s.acks...)
			led.doubts = append(led.doubts, s.doubts...)
		}
	}
	slices.SortFunc(led.acks, func(a, b ack) int { return cmp.Compare(a.version, b.version) })
	for i := 1; i < len(led.acks); i++ {
		if led.acks[i].version == led.acks[i-1].version {
			rep.DuplicateVersions++
		}
	}
	if refusal != nil {
		return rep, refusal
	}
	if phaseErr != nil {
		return rep, phaseErr
	}
	return rep, ctx.Err()
}

// phase runs the slots until count puts were sent (count 0: no bound) or
// d passed (0: no bound). A fill writes document n/worlds of world
// n%worlds for the n-th put; updates pick a world and a document at random.
func (w *writer) phase(ctx, callCtx context.Context, clients []commitspb.CommitsClient, count int64, fill bool, d time.Duration) error {
	var (
		loadCtx context.Context
		stop    context.CancelFunc
	)
	if d > 0 {
		w.deadline = time.Now().Add(d)
		loadCtx, stop = context.WithDeadline(ctx, w.deadline)
	} else {
		w.deadline = time.Time{}
		loadCtx, stop = context.WithCancel(ctx)
	}
	defer stop()
	w.mu.Lock()
	w.stopLoad = stop
	w.mu.Unlock()
	w.next.Store(0)
	var wg sync.WaitGroup
	for i := range w.cfg.Writers {
		for j := range w.cfg.InFlight {
			k := i*w.cfg.InFlight + j
			if w.slots[k] == nil {
				s := &slot{rng: rand.New(rand.NewPCG(w.seed, uint64(k)+1)), body: make([]byte, w.cfg.BodyBytes)}
				for b := range s.body {
					s.body[b] = byte('a' + s.rng.IntN(26))
				}
				w.slots[k] = s
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				w.run(loadCtx, callCtx, clients[i], w.slots[k], count, fill)
			}()
		}
	}
	wg.Wait()
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.refusal
}

// serial numbers every put of the run, for the first 8 bytes of its body.
var serial atomic.Uint64

func (w *writer) run(loadCtx, callCtx context.Context, client commitspb.CommitsClient, s *slot, count int64, fill bool) {
	for loadCtx.Err() == nil {
		n := w.next.Add(1) - 1
		if count > 0 && n >= count {
			return
		}
		var wi, doc int
		if fill {
			wi, doc = int(n%int64(w.worlds)), int(n/int64(w.worlds))
		} else {
			wi, doc = s.rng.IntN(w.worlds), s.rng.IntN(w.docs)
		}
		sent := time.Now()
		if w.limiter != nil {
			r := w.limiter.Reserve()
			if delay := r.Delay(); delay > 0 {
				sent = sent.Add(delay)
				t := time.NewTimer(delay)
				select {
				case <-t.C:
				case <-loadCtx.Done():
					t.Stop()
					r.Cancel()
					return
				}
			}
		}
		// Unique per put (and per run: the seed is mixed in), so that no
		// two versions have the same body.
		binary.BigEndian.PutUint64(s.body, serial.Add(1)^w.seed)
		key := wi*w.docs + doc
		req := &commitspb.PutRequest{World: w.led.worlds[wi], Id: w.led.id(uint32(doc)), Body: s.body}
		cas := !fill && w.cfg.CASFraction > 0 && s.rng.Float64() < w.cfg.CASFraction
		if cas {
			v := w.known[key].Load()
			req.ExpectedVersion = &v
			w.casWrites.Add(1)
		}
		cctx, cancel := context.WithTimeout(callCtx, w.cfg.RPCTimeout)
		resp, err := client.Put(cctx, req)
		cancel()
		now := time.Now()
		w.attempted.Add(1)
		if err == nil {
			v := resp.GetVersion()
			s.acks = append(s.acks, ack{world: uint16(wi), doc: uint32(doc), version: v, hash: bodyHash(s.body)})
			w.acked.Add(1)
			if fill {
				w.fillAck.Add(1)
			}
			raise(&w.known[key], v)
			if !sent.Before(w.windowStart) {
				w.hist.Record(now.Sub(sent))
			}
			if !now.Before(w.windowStart) && (w.deadline.IsZero() || !now.After(w.deadline)) {
				w.windowAcked.Add(1)
			}
			for {
				l := w.lastAck.Load()
				if now.UnixNano() <= l || w.lastAck.CompareAndSwap(l, now.UnixNano()) {
					break
				}
			}
			continue
		}
		st := status.Convert(err)
		if cas && st.Code() == codes.FailedPrecondition {
			w.conflicts.Add(1)
			for _, d := range st.Details() {
				if c, ok := d.(*commitspb.Conflict); ok {
					raise(&w.known[key], c.GetCurrentVersion())
				}
			}
			continue
		}
		w.failed(s, wi, doc, st)
	}
}

// raise sets *p to v if v is larger.
func raise(p *atomic.Uint64, v uint64) {
	for {
		old := p.Load()
		if v <= old || p.CompareAndSwap(old, v) {
			return
		}
	}
}

// failed counts a failed put. A refusal that every put would get (a bad
// key, a bad request, an edge without the API) stops the run: the rest
// would only repeat it.
func (w *writer) failed(s *slot, wi, doc int, st *status.Status) {
	w.errs.Add(1)
	s.doubts = append(s.doubts, doubt{world: uint16(wi), doc: uint32(doc), code: st.Code().String()})
	w.mu.Lock()
	defer w.mu.Unlock()
	w.byCode[st.Code().String()]++
	if len(w.samples) < 10 {
		w.samples = append(w.samples, fmt.Sprintf("%s: %s", st.Code(), st.Message()))
	}
	switch st.Code() {
	case codes.Unauthenticated, codes.PermissionDenied, codes.InvalidArgument, codes.Unimplemented:
		if w.refusal == nil {
			w.refusal = fmt.Errorf("the edge at %s refused a put (%s: %s): stopping", w.cfg.Addr, st.Code(), st.Message())
			if w.stopLoad != nil {
				w.stopLoad()
			}
		}
	}
}

func (w *writer) progress(ctx context.Context) {
	if w.cfg.ProgressEvery <= 0 {
		return
	}
	t := time.NewTicker(w.cfg.ProgressEvery)
	defer t.Stop()
	var lastN int64
	lastT := time.Now()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			n := w.acked.Load()
			rate := float64(n-lastN) / now.Sub(lastT).Seconds()
			lastN, lastT = n, now
			w.out.printf("commitsload: %5.0fs acked %d (%.0f/s), p99 %.1f ms, conflicts %d, errors %d\n",
				now.Sub(w.start).Seconds(), n, rate, float64(w.hist.Quantile(0.99))/1e6, w.conflicts.Load(), w.errs.Load())
		}
	}
}
