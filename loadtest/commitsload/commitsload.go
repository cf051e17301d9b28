// Package commitsload is the load generator and oracle of the commit log
// behind `millrace loadtest commits`: writers put document versions
// through the commits edge (one world or many, flat out or at a rate,
// blind or with compare-and-set), the compactor optionally folds the
// worlds into the bucket in this process, and the oracle then reads back
// every acknowledged version (Get), each document's History and every
// world's List, from the same edge or a freshly started one (a cold
// start): nothing acknowledged may be lost, changed or missing. A JSON
// report has the rate, the latency, the errors, the fold's figures and
// the oracle's counts. See README.md.
package commitsload

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"strings"
	"sync"
	"time"
)

// printer serializes progress lines.
type printer struct {
	mu sync.Mutex
	w  io.Writer
}

func (p *printer) printf(format string, args ...any) {
	p.mu.Lock()
	fmt.Fprintf(p.w, format, args...)
	p.mu.Unlock()
}

// Run writes (unless cfg.VerifyOnly), folds (cfg.Fold) and verifies
// (unless cfg.NoVerify), printing progress lines to progress, and reports
// what it measured. Problems the oracle finds are in the report (see
// Report.Failed), not in the error, which says that the run itself could
// not go on. When ctx ends early Run returns the partial report with
// ctx's error.
func Run(ctx context.Context, cfg Config, progress io.Writer) (*Report, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("commitsload: %w", err)
	}
	cfg = cfg.withDefaults()
	if progress == nil {
		progress = io.Discard
	}
	out := &printer{w: progress}
	seed := cfg.Seed
	if seed == 0 {
		seed = rand.Uint64()
	}
	rep := &Report{Started: time.Now()}
	defer func() { rep.Finished = time.Now() }()
	conns := cfg.Writers
	if cfg.SharedConn {
		conns = 1
	}
	rep.Setup = Setup{
		Addr: cfg.Addr, ReadAddr: cfg.ReadAddr, DocsPerWorld: cfg.Docs, BodyBytes: cfg.BodyBytes,
		Writers: cfg.Writers, InFlight: cfg.InFlight, Connections: conns, Rate: cfg.Rate, Fill: cfg.Fill,
		Writes: cfg.Writes, DurationS: cfg.Duration.Seconds(), WarmupS: cfg.Warmup.Seconds(), CASFraction: cfg.CASFraction,
		Fold: cfg.Fold, VerifyOnly: cfg.VerifyOnly, Ledger: cfg.Ledger, Seed: seed,
		Writer: fmt.Sprintf("one client keeping up to %d puts in flight (one goroutine per put, each waiting for its answer) on %s",
			cfg.InFlight, map[bool]string{true: "a gRPC connection shared by all writers", false: "its own gRPC connection"}[cfg.SharedConn]),
	}
	meter, err := newProcMeter(cfg.PIDs)
	if err != nil {
		return nil, fmt.Errorf("commitsload: %w", err)
	}

	var led *ledger
	if cfg.VerifyOnly {
		if led, err = readLedger(cfg.Ledger); err != nil {
			return nil, fmt.Errorf("commitsload: %w", err)
		}
		out.printf("commitsload: ledger %s: %d acknowledged versions, %d doubtful puts, worlds %s\n",
			cfg.Ledger, len(led.acks), len(led.doubts), strings.Join(led.worlds, ","))
	} else {
		led = newLedger(cfg.WorldNames(), cfg.IDPrefix, cfg.Docs)
		out.printf("commitsload: %d writers x %d in flight on %d connection(s) to %s, %d world(s) x %d documents, %d-byte bodies%s\n",
			cfg.Writers, cfg.InFlight, conns, cfg.Addr, len(led.worlds), cfg.Docs, cfg.BodyBytes, pace(cfg.Rate))
		meter.begin()
		w, werr := runWrites(ctx, cfg, led, seed, out)
		acked := float64(0)
		if w != nil {
			acked = float64(w.Acked)
		}
		meter.end(func(p *Process, cpu float64) {
			p.WriteCPUS = cpu
			if acked > 0 {
				p.Per1kWrites = round(cpu/acked*1000, 4)
			}
		})
		rep.Write = w
		if w != nil {
			out.printf("commitsload: wrote %d versions (%d in the window of %.1fs: %.0f/s), latency p50 %.2f ms, p99 %.2f ms, p99.9 %.2f ms, max %.1f ms; %d conflicts, %d errors\n",
				w.Acked, w.WindowAcked, w.WindowS, w.AckedPerS, w.Latency.P50MS, w.Latency.P99MS, w.Latency.P999MS, w.Latency.MaxMS, w.Conflicts, w.Errors)
		}
		if cfg.Ledger != "" {
			if lerr := led.write(cfg.Ledger, cfg.LedgerAppend); lerr != nil {
				rep.Processes = meter.report()
				return rep, fmt.Errorf("commitsload: %w", lerr)
			}
		}
		if werr != nil {
			rep.Processes = meter.report()
			return rep, fmt.Errorf("commitsload: %w", werr)
		}
	}

	if cfg.Fold {
		meter.begin()
		f, ferr := runFold(ctx, cfg, led, out)
		meter.end(func(p *Process, cpu float64) { p.FoldCPUS = cpu })
		rep.Fold = f
		if ferr != nil {
			rep.Processes = meter.report()
			return rep, fmt.Errorf("commitsload: %w", ferr)
		}
		out.printf("commitsload: fold: %d versions, %d documents changed in %.2fs (%.0f documents/s, %.0f per CPU-second of this process), %.4f bucket operations and %.2f stream deletions per changed document\n",
			f.Versions, f.DocsChanged, f.Seconds, f.DocsPerS, f.DocsPerCPUS, f.BucketOpsPerDoc, f.DeletionsPerDoc)
	}

	if !cfg.NoVerify {
		meter.begin()
		v, verr := runVerify(ctx, cfg, led, out)
		meter.end(func(p *Process, cpu float64) { p.VerifyCPUS = cpu })
		rep.Verify = v
		rep.Processes = meter.report()
		if verr != nil {
			return rep, fmt.Errorf("commitsload: verify: %w", verr)
		}
		verdict := "OK"
		if f := rep.Failed(); len(f) > 0 {
			verdict = "FAILED: " + strings.Join(f, ", ")
		}
		out.printf("commitsload: read back %d of %d versions (%d of %d documents) at %s in %.1fs (%.0f reads/s): lost %d, mismatched %d, gaps %d, unexpected %d (+%d after failed puts), read errors %d: %s\n",
			v.VersionsChecked, v.Versions, v.DocsChecked, v.Docs, v.Addr, v.Seconds, v.ReadsPerS, v.Lost, v.Mismatched, v.Gaps, v.Unexpected, v.UnexpectedAfterErrors,
			v.ReadErrors+v.HistoryErrors, verdict)
	}
	rep.Processes = meter.report()
	return rep, nil
}

func pace(r float64) string {
	if r <= 0 {
		return ", flat out"
	}
	return fmt.Sprintf(", at %.0f puts/s", r)
}
