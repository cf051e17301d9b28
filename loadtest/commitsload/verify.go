package commitsload

import (
	"cmp"
	"context"
	"fmt"
	"math"
	"slices"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/backoff"
	commitspb "github.com/millrace/millrace/schemas/commits"
)

// docCheck is one document of the ledger: its acknowledged versions in
// order, and whether a put of it failed without an answer.
type docCheck struct {
	world    uint16
	doc      uint32
	acks     []ack
	doubtful bool
}

func (d *docCheck) key() uint64 { return uint64(d.world)<<32 | uint64(d.doc) }

// verifier is the oracle's state.
type verifier struct {
	cfg     Config
	led     *ledger
	out     *printer
	docs    []docCheck
	minAck  uint64
	clients []commitspb.CommitsClient
	ctx     context.Context // carries the API key
	total   int64           // versions to read back
	sampled int             // documents to read back

	reads, versionsDone, docsDone                    atomic.Int64
	lost, mismatched, readErrors                     atomic.Int64
	gaps, disorder, unexpected, afterErrors, earlier atomic.Int64
	historyErrors                                    atomic.Int64

	mu       sync.Mutex
	examples []string
}

// maxExamples bounds the problems quoted in the report.
const maxExamples = 20

func (v *verifier) example(format string, args ...any) {
	v.mu.Lock()
	defer v.mu.Unlock()
	if len(v.examples) < maxExamples {
		v.examples = append(v.examples, fmt.Sprintf(format, args...))
	}
}

// runVerify reads back every acknowledged version of the ledger at
// cfg.ReadAddr: first List of each world (the first page timed: on a fresh
// edge, the world's cold start), then per document Get of each version and
// its History.
func runVerify(ctx context.Context, cfg Config, led *ledger, out *printer) (*Verify, error) {
	v := &verifier{cfg: cfg, led: led, out: out, minAck: math.MaxUint64, ctx: withKey(ctx, cfg.APIKey)}
	v.index()
	// A few connections: one HTTP/2 connection carries many calls, but
	// its reads are serialized on one goroutine each side.
	for range min(4, cfg.VerifyConcurrency) {
		c, err := dial(cfg.ReadAddr)
		if err != nil {
			return nil, fmt.Errorf("dial the edge at %s: %w", cfg.ReadAddr, err)
		}
		defer c.Close()
		v.clients = append(v.clients, commitspb.NewCommitsClient(c))
	}
	rep := &Verify{Addr: cfg.ReadAddr, Docs: len(v.docs), Versions: int64(len(led.acks)), Fraction: cfg.VerifyFraction}
	// The documents read back: all, or every 1/fraction-th.
	var sample []int
	for i := range v.docs {
		if cfg.VerifyFraction >= 1 || math.Floor(float64(i+1)*cfg.VerifyFraction) > math.Floor(float64(i)*cfg.VerifyFraction) {
			sample = append(sample, i)
			v.total += int64(len(v.docs[i].acks))
		}
	}
	rep.DocsSampled, v.sampled = int64(len(sample)), len(sample)
	cpu0, t0 := selfCPU(), time.Now()

	for wi := range led.worlds {
		lw, err := v.list(uint16(wi))
		if st, ok := status.FromError(err); ok && st.Code() == codes.Unimplemented {
			rep.ListError = fmt.Sprintf("%s: %s", st.Code(), st.Message())
			out.printf("commitsload: List is not available at %s (%s): documents are checked without it\n", cfg.ReadAddr, st.Code())
			break
		}
		if err != nil {
			lw.Error = err.Error()
		}
		rep.List = append(rep.List, lw)
		out.printf("commitsload: List %s: first page in %.0f ms, %d entries in %d pages (%.1fs): %d of the ledger's documents listed, %d missing, %d stale, %d newer, %d foreign\n",
			lw.World, lw.FirstPageMS, lw.Entries, lw.Pages, lw.Seconds, lw.Docs, lw.Missing, lw.Stale, lw.Newer, lw.Foreign)
	}
	if ctx.Err() != nil {
		return rep, ctx.Err()
	}

	// The time limit stops taking documents; calls under way finish.
	docsCtx := ctx
	if cfg.VerifyTimeout > 0 {
		var cancel context.CancelFunc
		docsCtx, cancel = context.WithTimeout(ctx, cfg.VerifyTimeout)
		defer cancel()
	}
	pctx, stopProgress := context.WithCancel(ctx)
	var pwg sync.WaitGroup
	pwg.Add(1)
	go func() { defer pwg.Done(); v.progress(pctx, t0) }()
	var next atomic.Int64
	var wg sync.WaitGroup
	for i := range cfg.VerifyConcurrency {
		wg.Add(1)
		go func() {
			defer wg.Done()
			client := v.clients[i%len(v.clients)]
			for docsCtx.Err() == nil {
				n := next.Add(1) - 1
				if n >= int64(len(sample)) {
					return
				}
				v.check(client, &v.docs[sample[n]])
				v.docsDone.Add(1)
			}
		}()
	}
	wg.Wait()
	stopProgress()
	pwg.Wait()

	wall := time.Since(t0)
	rep.DocsChecked, rep.VersionsChecked = v.docsDone.Load(), v.versionsDone.Load()
	if ctx.Err() == nil {
		rep.Unchecked = rep.DocsSampled - rep.DocsChecked
		if rep.Unchecked > 0 {
			out.printf("commitsload: verify stopped after %s: %d of %d sampled documents not read back\n", cfg.VerifyTimeout, rep.Unchecked, rep.DocsSampled)
		}
	}
	rep.Lost, rep.Mismatched, rep.ReadErrors = v.lost.Load(), v.mismatched.Load(), v.readErrors.Load()
	rep.Gaps, rep.Disorder, rep.Unexpected = v.gaps.Load(), v.disorder.Load(), v.unexpected.Load()
	rep.UnexpectedAfterErrors, rep.Earlier, rep.HistoryErrors = v.afterErrors.Load(), v.earlier.Load(), v.historyErrors.Load()
	rep.Seconds = round(wall.Seconds(), 2)
	rep.ReadsPerS = per(float64(v.reads.Load()), wall)
	rep.ClientCPUS = round((selfCPU() - cpu0).Seconds(), 2)
	rep.Examples = v.examples
	rep.OK = rep.Lost == 0 && rep.Mismatched == 0 && rep.ReadErrors == 0 && rep.Gaps == 0 && rep.Disorder == 0 &&
		rep.Unexpected == 0 && rep.HistoryErrors == 0 && rep.Unchecked == 0
	for _, l := range rep.List {
		if l.Missing > 0 || l.Stale > 0 || l.OutOfOrder > 0 || l.Error != "" {
			rep.OK = false
		}
	}
	if ctx.Err() != nil {
		return rep, ctx.Err()
	}
	return rep, nil
}

// index groups the ledger's acknowledged versions by document, documents
// in (world, number) order.
func (v *verifier) index() {
	acks := slices.Clone(v.led.acks)
	slices.SortFunc(acks, func(a, b ack) int {
		return cmp.Or(cmp.Compare(a.world, b.world), cmp.Compare(a.doc, b.doc), cmp.Compare(a.version, b.version))
	})
	for i := 0; i < len(acks); {
		j := i + 1
		for j < len(acks) && acks[j].world == acks[i].world && acks[j].doc == acks[i].doc {
			j++
		}
		v.docs = append(v.docs, docCheck{world: acks[i].world, doc: acks[i].doc, acks: acks[i:j:j]})
		i = j
	}
	for _, a := range acks {
		v.minAck = min(v.minAck, a.version)
	}
	for _, d := range v.led.doubts {
		if i := v.find(d.world, d.doc); i >= 0 {
			v.docs[i].doubtful = true
		}
	}
}

// find is the document's position in docs (-1: the ledger has no
// acknowledged version of it).
func (v *verifier) find(world uint16, doc uint32) int {
	k := uint64(world)<<32 | uint64(doc)
	i := sort.Search(len(v.docs), func(i int) bool { return v.docs[i].key() >= k })
	if i < len(v.docs) && v.docs[i].key() == k {
		return i
	}
	return -1
}

// transient reports whether a failed read is worth trying again.
func transient(err error) bool {
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded, codes.ResourceExhausted, codes.Aborted, codes.Unknown:
		return true
	}
	return false
}

// call runs f up to three times while it fails transiently, 200 ms and
// then 400 ms apart.
func (v *verifier) call(f func(ctx context.Context) error) error {
	var err error
	pause := backoff.Backoff{Min: 200 * time.Millisecond, Max: 400 * time.Millisecond}
	for attempt := range 3 {
		if attempt > 0 && !pause.Wait(v.ctx) {
			return err
		}
		ctx, cancel := context.WithTimeout(v.ctx, v.cfg.RPCTimeout)
		err = f(ctx)
		cancel()
		v.reads.Add(1)
		if err == nil || !transient(err) || v.ctx.Err() != nil {
			return err
		}
	}
	return err
}

// check reads back one document: Get of each acknowledged version, then
// its History compared with them.
func (v *verifier) check(client commitspb.CommitsClient, d *docCheck) {
	world, id := v.led.worlds[d.world], v.led.id(d.doc)
	for _, a := range d.acks {
		var doc *commitspb.Document
		err := v.call(func(ctx context.Context) (err error) {
			doc, err = client.Get(ctx, &commitspb.GetRequest{World: world, Id: id, Version: a.version})
			return err
		})
		v.versionsDone.Add(1)
		switch {
		case status.Code(err) == codes.NotFound:
			v.lost.Add(1)
			v.example("lost: %s/%s version %d: %s", world, id, a.version, status.Convert(err).Message())
		case err != nil:
			v.readErrors.Add(1)
			v.example("read error: %s/%s version %d: %v", world, id, a.version, err)
		case doc.GetVersion() != a.version || doc.GetDeleted() || bodyHash(doc.GetBody()) != a.hash:
			v.mismatched.Add(1)
			v.example("mismatched: %s/%s version %d: got version %d, deleted %v, %d bytes of another body",
				world, id, a.version, doc.GetVersion(), doc.GetDeleted(), len(doc.GetBody()))
		}
	}

	var listed []uint64
	var after uint64
	for {
		var resp *commitspb.HistoryResponse
		err := v.call(func(ctx context.Context) (err error) {
			resp, err = client.History(ctx, &commitspb.HistoryRequest{World: world, Id: id, AfterVersion: after, PageSize: 1000})
			return err
		})
		if err != nil {
			v.historyErrors.Add(1)
			v.example("history error: %s/%s after %d: %v", world, id, after, err)
			return
		}
		for _, hv := range resp.GetVersions() {
			listed = append(listed, hv.GetVersion())
		}
		next := resp.GetNextAfterVersion()
		if next == 0 {
			break
		}
		if next <= after {
			v.disorder.Add(1)
			v.example("history of %s/%s: next page after %d, not after %d", world, id, next, after)
			break
		}
		after = next
	}
	if !slices.IsSorted(listed) || len(slices.Compact(slices.Clone(listed))) != len(listed) {
		v.disorder.Add(1)
		v.example("history of %s/%s is not in ascending order: %v", world, id, head(listed))
		slices.Sort(listed)
		listed = slices.Compact(listed)
	}
	i, j := 0, 0
	for i < len(d.acks) || j < len(listed) {
		switch {
		case j == len(listed) || (i < len(d.acks) && d.acks[i].version < listed[j]):
			v.gaps.Add(1)
			v.example("gap: %s/%s version %d was acknowledged and History does not list it", world, id, d.acks[i].version)
			i++
		case i == len(d.acks) || listed[j] < d.acks[i].version:
			switch {
			case listed[j] < v.minAck:
				v.earlier.Add(1)
			case d.doubtful:
				v.afterErrors.Add(1)
			default:
				v.unexpected.Add(1)
				v.example("unexpected: %s/%s version %d is in History and no put of it was acknowledged or failed", world, id, listed[j])
			}
			j++
		default:
			i++
			j++
		}
	}
}

func head(vs []uint64) []uint64 {
	if len(vs) > 10 {
		return vs[:10]
	}
	return vs
}

// list pages through List of one world and compares it with the ledger.
func (v *verifier) list(wi uint16) (ListWorld, error) {
	world := v.led.worlds[wi]
	lw := ListWorld{World: world}
	client := v.clients[0]
	// The ledger's documents of this world.
	lo := sort.Search(len(v.docs), func(i int) bool { return v.docs[i].world >= wi })
	hi := sort.Search(len(v.docs), func(i int) bool { return v.docs[i].world > wi })
	seen := make([]bool, hi-lo)
	t0 := time.Now()
	var prev, after string
	for {
		var resp *commitspb.ListResponse
		start := time.Now()
		err := v.call(func(ctx context.Context) (err error) {
			resp, err = client.List(ctx, &commitspb.ListRequest{World: world, AfterId: after, PageSize: 1000})
			return err
		})
		if lw.Pages == 0 {
			lw.FirstPageMS = ms(time.Since(start))
		}
		if err != nil {
			lw.Seconds = round(time.Since(t0).Seconds(), 3)
			return lw, err
		}
		lw.Pages++
		for _, e := range resp.GetDocs() {
			lw.Entries++
			if e.GetId() <= prev && lw.Entries > 1 {
				lw.OutOfOrder++
			}
			prev = e.GetId()
			i := -1
			if n, ok := v.led.docNum(e.GetId()); ok {
				i = v.find(wi, n)
			}
			if i < 0 {
				lw.Foreign++
				continue
			}
			d := &v.docs[i]
			lw.Docs++
			seen[i-lo] = true
			latest := d.acks[len(d.acks)-1].version
			switch got := e.GetVersion(); {
			case got < latest:
				lw.Stale++
				v.example("List of %s: %s at version %d, acknowledged %d", world, e.GetId(), got, latest)
			case got > latest:
				lw.Newer++
				if !d.doubtful {
					v.example("List of %s: %s at version %d, which nobody acknowledged (latest acknowledged %d)", world, e.GetId(), got, latest)
				}
			}
		}
		after = resp.GetNextAfterId()
		if after == "" {
			break
		}
	}
	for i, s := range seen {
		if !s {
			lw.Missing++
			d := &v.docs[lo+i]
			v.example("List of %s does not name %s (acknowledged at version %d)", world, v.led.id(d.doc), d.acks[len(d.acks)-1].version)
		}
	}
	lw.Seconds = round(time.Since(t0).Seconds(), 3)
	return lw, nil
}

func (v *verifier) progress(ctx context.Context, t0 time.Time) {
	if v.cfg.ProgressEvery <= 0 {
		return
	}
	t := time.NewTicker(v.cfg.ProgressEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case now := <-t.C:
			v.out.printf("commitsload: verify %5.0fs: %d/%d versions, %d/%d documents (%.0f reads/s): lost %d, mismatched %d, gaps %d, unexpected %d, read errors %d\n",
				now.Sub(t0).Seconds(), v.versionsDone.Load(), v.total, v.docsDone.Load(), v.sampled,
				float64(v.reads.Load())/now.Sub(t0).Seconds(), v.lost.Load(), v.mismatched.Load(), v.gaps.Load(),
				v.unexpected.Load(), v.readErrors.Load()+v.historyErrors.Load())
		}
	}
}
