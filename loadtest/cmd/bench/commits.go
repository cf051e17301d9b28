package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/millrace/millrace/loadtest/commitsload"
)

// Commit-log scenarios: `millrace serve commits` on a natsd of its own
// (so that the edge's and the server's CPU are apart, and a fresh edge can
// come up on the same stream and bucket), a file:// bucket, and the load
// generator and oracle (package commitsload) in this process.
const (
	scCommits3Writers  = "commits-3writers"
	scCommits1Writer   = "commits-1writer"
	scCommitsFold      = "commits-fold"
	scCommitsColdStart = "commits-coldstart"
)

var commitsScenarios = []string{scCommits3Writers, scCommits1Writer, scCommitsFold, scCommitsColdStart}

// commitsConfig sizes the commit-log scenarios (flags of the bench).
type commitsConfig struct {
	duration, warmup time.Duration // 3writers, 1writer: measured time after the warm-up
	docs             int           // 3writers, 1writer: documents of the world
	inFlight3        int           // 3writers: puts in flight per writer
	inFlight1        int           // 1writer: puts in flight
	verify           float64       // 3writers, 1writer: fraction of documents read back
	bodyBytes        int
	foldDocs         int
	foldUpdates      int
	foldVerify       float64
	coldDocs         int
	coldTail         int
	coldWriters      int
	coldBodyBytes    int
	coldVerify       float64
	verifyTimeout    time.Duration // 3writers, 1writer, fold: longest read-back
	coldTimeout      time.Duration // coldstart: longest read-back
}

func (c *commitsConfig) register(fs *flag.FlagSet) {
	fs.DurationVar(&c.duration, "commits-duration", 10*time.Second, "commits-3writers, commits-1writer: measured time of the flat-out writes, after the warm-up")
	fs.DurationVar(&c.warmup, "commits-warmup", 3*time.Second, "commits-3writers, commits-1writer: warm-up left out of the rate and latency")
	fs.IntVar(&c.docs, "commits-docs", 20000, "commits-3writers, commits-1writer: documents of the world the updates hit at random")
	fs.IntVar(&c.inFlight3, "commits-in-flight", 16, "commits-3writers: puts each of the three writers keeps outstanding")
	fs.IntVar(&c.inFlight1, "commits-1writer-in-flight", 64, "commits-1writer: puts the one writer keeps outstanding")
	fs.Float64Var(&c.verify, "commits-verify-fraction", 1, "commits-3writers, commits-1writer: fraction of the documents whose every version the oracle reads back (List checks all)")
	fs.IntVar(&c.bodyBytes, "commits-body-bytes", 100, "commits-3writers, commits-1writer, commits-fold: body size")
	fs.IntVar(&c.foldDocs, "commits-fold-docs", 100000, "commits-fold: documents written once, then folded (pass 1)")
	fs.IntVar(&c.foldUpdates, "commits-fold-updates", 50000, "commits-fold: random updates of the folded world, then folded again (pass 2)")
	fs.Float64Var(&c.foldVerify, "commits-fold-verify-fraction", 1, "commits-fold: fraction of the documents the oracle reads back after the passes")
	fs.IntVar(&c.coldDocs, "commits-cold-docs", 1000000, "commits-coldstart: documents of the world opened cold")
	fs.IntVar(&c.coldTail, "commits-cold-tail", 20000, "commits-coldstart: random updates after the fold, left in the stream tail")
	fs.IntVar(&c.coldWriters, "commits-cold-writers", 2, "commits-coldstart: writers filling the world (64 puts in flight each)")
	fs.IntVar(&c.coldBodyBytes, "commits-cold-body-bytes", 32, "commits-coldstart: body size")
	fs.Float64Var(&c.coldVerify, "commits-cold-verify-fraction", 1, "commits-coldstart: fraction of the documents the oracle reads back through the fresh edge (List checks all)")
	fs.DurationVar(&c.verifyTimeout, "commits-verify-timeout", 5*time.Minute, "commits-3writers, commits-1writer, commits-fold: the oracle stops reading documents back after this (those left fail a check)")
	fs.DurationVar(&c.coldTimeout, "commits-cold-verify-timeout", 10*time.Minute, "commits-coldstart: the oracle stops reading documents back after this (those left fail a check)")
}

// commitsRun is one run of the load generator within a scenario, with the
// share of the machine other work took meanwhile.
type commitsRun struct {
	Name           string              `json:"name"`
	Report         *commitsload.Report `json:"report"`
	WallS          float64             `json:"wall_s"`
	OtherLoadCores float64             `json:"other_load_cores"`
}

// commitsEdgeProc is a running `millrace serve commits`.
type commitsEdgeProc struct {
	p       *proc
	addr    string
	metrics string
}

// startCommitsEdge starts `serve commits` on natsURL and bucketURL with
// key allowed every world.
func (b *bench) startCommitsEdge(ctx context.Context, dir, name, natsURL, bucketURL, key string) (*commitsEdgeProc, error) {
	addr, err := freeAddr()
	if err != nil {
		return nil, err
	}
	web, err := freeAddr()
	if err != nil {
		return nil, err
	}
	env := []string{
		"MILLRACE_NATS_URL=" + natsURL,
		"MILLRACE_COMMITS_LISTEN=" + addr,
		"MILLRACE_HTTP_LISTEN=" + web,
		"MILLRACE_COMMITS_API_KEYS=*=" + key,
		"MILLRACE_BUCKET_URL=" + bucketURL,
		"MILLRACE_SHUTDOWN_TIMEOUT=10s",
	}
	p, err := startProc(name, b.cfg.bin, []string{"serve", "commits"}, env, filepath.Join(dir, name+".log"))
	if err != nil {
		return nil, err
	}
	if err := waitReady(ctx, p, "http://"+web+"/readyz", readyTimeout); err != nil {
		p.stop(stopGrace)
		return nil, err
	}
	return &commitsEdgeProc{p: p, addr: addr, metrics: "http://" + web + "/metrics"}, nil
}

// commitsLoad runs the load generator (progress to stdout) and keeps its
// report in the scenario's.
func (b *bench) commitsLoad(ctx context.Context, rep *scenarioReport, name string, cfg commitsload.Config, procs map[string]*proc) (*commitsload.Report, error) {
	fmt.Printf("  -- %s\n", name)
	cfg.PIDs = map[string]int{}
	for n, p := range procs {
		cfg.PIDs[n] = p.pid()
	}
	cfg.ProgressEvery = 5 * time.Second
	if cfg.Seed == 0 {
		cfg.Seed = 1
	}
	m0, self0, t0 := readMachineCPU(), selfCPU(), time.Now()
	r, err := commitsload.Run(ctx, cfg, os.Stdout)
	wall := time.Since(t0)
	if r == nil {
		return nil, err
	}
	run := commitsRun{Name: name, Report: r, WallS: round(wall.Seconds(), 1)}
	// Other work on the machine: busy CPU that none of the measured
	// processes (nor this one) used.
	busy := readMachineCPU().sub(m0).busy
	known := selfCPU() - self0
	for _, p := range r.Processes {
		known += time.Duration((p.WriteCPUS + p.FoldCPUS + p.VerifyCPUS) * float64(time.Second))
	}
	if wall > 0 {
		run.OtherLoadCores = round((busy-known).Seconds()/wall.Seconds(), 2)
	}
	rep.Commits = append(rep.Commits, run)
	for _, p := range r.Processes {
		if p.WriteCPUS > 0 {
			fmt.Printf("  %s: %.4f CPU-s per 1,000 writes (%.2f CPU-s)\n", p.Name, p.Per1kWrites, p.WriteCPUS)
		}
	}
	return r, err
}

// busyNote says when other work on the machine took enough of it to
// distort a rate or a latency.
func (b *bench) busyNote(rep *scenarioReport) string {
	if len(rep.Commits) == 0 {
		return ""
	}
	if o := rep.Commits[len(rep.Commits)-1].OtherLoadCores; o > 0.25 {
		return fmt.Sprintf("other work on the machine took %.1f of its %d cores meanwhile", o, b.machine.NProc)
	}
	return ""
}

// oracleChecks: nothing acknowledged lost or missing from History, and
// nothing else wrong.
func oracleChecks(name string, r *commitsload.Report) []check {
	v := r.Verify
	if v == nil {
		return nil
	}
	note := fmt.Sprintf("%d of %d acknowledged versions (%d of %d documents, %d sampled) read back with Get and History at %s in %.0f s (%.0f reads/s); List checked every document",
		v.VersionsChecked, v.Versions, v.DocsChecked, v.Docs, v.DocsSampled, v.Addr, v.Seconds, v.ReadsPerS)
	if v.ListError != "" {
		note = fmt.Sprintf("%d of %d acknowledged versions read back; List not checked: %s", v.VersionsChecked, v.Versions, v.ListError)
	}
	other := float64(len(r.Failed()))
	if v.Lost > 0 {
		other--
	}
	if v.Gaps > 0 {
		other--
	}
	return []check{
		atMost(name+": acknowledged versions lost", float64(v.Lost), 0, "versions", note),
		atMost(name+": acknowledged versions missing from History (gaps)", float64(v.Gaps), 0, "versions", ""),
		atMost(name+": other oracle findings (mismatched, unread, unexpected, sampled documents left unread at the time limit, List missing or stale)", other, 0, "kinds", strings.Join(r.Failed(), "; ")),
	}
}

func (b *bench) commitsScenario(ctx context.Context, name string, rep *scenarioReport) error {
	cc := b.cfg.commits
	dir, err := mkdir(b.tmp, name)
	if err != nil {
		return err
	}
	if !b.cfg.keep {
		defer os.RemoveAll(dir)
	}
	natsd, natsURL, err := b.startNATSD(ctx, dir)
	if err != nil {
		return err
	}
	defer natsd.stop(stopGrace)
	bucketURL := "file://" + filepath.Join(dir, "bucket")
	key := "bench-" + strconv.FormatInt(time.Now().UnixNano(), 36) + "-key"
	edge, err := b.startCommitsEdge(ctx, dir, "edge", natsURL, bucketURL, key)
	if err != nil {
		return err
	}
	defer func() {
		if !edge.p.exited() {
			edge.p.stop(stopGrace)
		}
	}()
	procs := map[string]*proc{"edge": edge.p, "natsd": natsd}
	base := commitsload.Config{Addr: edge.addr, APIKey: key, BodyBytes: cc.bodyBytes, NATSURL: natsURL, BucketURL: bucketURL}
	ledger := filepath.Join(dir, "ledger")

	switch name {
	case scCommits3Writers, scCommits1Writer:
		writers, inFlight, target := 3, cc.inFlight3, 5000.0
		if name == scCommits1Writer {
			writers, inFlight, target = 1, cc.inFlight1, 10000
		}
		rep.Description = fmt.Sprintf("%d writer(s) (each a client with its own gRPC connection and up to %d puts in flight) put %d-byte bodies flat out for %s (after a %s warm-up) on random documents of one world of %d through `millrace serve commits` (natsd apart); then the oracle",
			writers, inFlight, cc.bodyBytes, cc.duration, cc.warmup, cc.docs)
		cfg := base
		cfg.World, cfg.Docs, cfg.Writers, cfg.InFlight = "bench", cc.docs, writers, inFlight
		cfg.Duration, cfg.Warmup, cfg.VerifyFraction, cfg.VerifyTimeout = cc.duration, cc.warmup, cc.verify, cc.verifyTimeout
		r, err := b.commitsLoad(ctx, rep, "write and verify", cfg, procs)
		if err != nil {
			return err
		}
		w, busy := r.Write, b.busyNote(rep)
		rep.Checks = append(rep.Checks,
			atLeast(fmt.Sprintf("%s: acknowledged writes per second, %d writer(s) on one world", name, writers), w.AckedPerS, target, "writes/s",
				join(fmt.Sprintf("%d puts in flight per writer; edge %.4f, natsd %.4f CPU-s per 1,000 writes", inFlight, per1k(r, "edge"), per1k(r, "natsd")), busy)))
		if name == scCommits3Writers {
			rep.Checks = append(rep.Checks, below(name+": put latency p99", w.Latency.P99MS, 50, "ms", busy))
		}
		rep.Checks = append(rep.Checks, oracleChecks(name, r)...)

	case scCommitsFold:
		rep.Description = fmt.Sprintf("the compactor (in the bench process, as `project compactor` runs it) folds a world of %d documents (pass 1), then %d random updates of it (pass 2), into a file:// bucket; then the oracle reads the folded versions back through the edge",
			cc.foldDocs, cc.foldUpdates)
		cfg := base
		cfg.World, cfg.Docs, cfg.Writers, cfg.InFlight = "fold", cc.foldDocs, 1, 64
		cfg.Fill, cfg.Fold, cfg.NoVerify, cfg.Ledger = true, true, true, ledger
		r1, err := b.commitsLoad(ctx, rep, "fill and fold (pass 1: new documents)", cfg, procs)
		if err != nil {
			return err
		}
		cfg.Fill, cfg.Writes, cfg.LedgerAppend = false, int64(cc.foldUpdates), true
		r2, err := b.commitsLoad(ctx, rep, "updates and fold (pass 2: updates of a folded world)", cfg, procs)
		if err != nil {
			return err
		}
		v := commitsload.Config{Addr: edge.addr, APIKey: key, VerifyOnly: true, Ledger: ledger, VerifyFraction: cc.foldVerify, VerifyTimeout: cc.verifyTimeout}
		r3, err := b.commitsLoad(ctx, rep, "oracle after compaction", v, procs)
		if err != nil {
			return err
		}
		for i, r := range []*commitsload.Report{r1, r2} {
			f := r.Fold
			rep.Checks = append(rep.Checks, atLeast(fmt.Sprintf("%s: pass %d (%s), documents folded per second", name, i+1, []string{"new documents", "updates of a folded world"}[i]),
				f.DocsPerS, 20000, "docs/s",
				join(fmt.Sprintf("%d documents changed, %d versions; %.5f bucket operations and %.2f stream deletions per changed document; %.0f documents per CPU-second of the compactor's process; natsd %.2f CPU-s",
					f.DocsChanged, f.Versions, f.BucketOpsPerDoc, f.DeletionsPerDoc, f.DocsPerCPUS, foldCPU(r, "natsd")), b.busyNote(rep))))
		}
		rep.Checks = append(rep.Checks, oracleChecks(name, r3)...)

	case scCommitsColdStart:
		rep.Description = fmt.Sprintf("a world of %d documents (%d-byte bodies) written by %d writers and folded, %d updates left in the stream tail; a fresh `millrace serve commits` on the same natsd and bucket: its first List, then the oracle through it",
			cc.coldDocs, cc.coldBodyBytes, cc.coldWriters, cc.coldTail)
		cfg := base
		cfg.World, cfg.Docs, cfg.Writers, cfg.InFlight, cfg.BodyBytes = "cold", cc.coldDocs, cc.coldWriters, 64, cc.coldBodyBytes
		cfg.Fill, cfg.Fold, cfg.NoVerify, cfg.Ledger = true, true, true, ledger
		if _, err := b.commitsLoad(ctx, rep, "fill and fold", cfg, procs); err != nil {
			return err
		}
		if cc.coldTail > 0 {
			cfg.Fill, cfg.Fold, cfg.Writes, cfg.LedgerAppend = false, false, int64(cc.coldTail), true
			if _, err := b.commitsLoad(ctx, rep, "updates left in the stream tail", cfg, procs); err != nil {
				return err
			}
		}
		// The writing edge goes: the fresh one holds nothing of the world.
		if err := edge.p.stop(stopGrace); err != nil {
			fmt.Printf("bench: %v\n", err)
		}
		fresh, err := b.startCommitsEdge(ctx, dir, "edge-fresh", natsURL, bucketURL, key)
		if err != nil {
			return err
		}
		defer fresh.p.stop(stopGrace)
		v := commitsload.Config{Addr: fresh.addr, APIKey: key, VerifyOnly: true, Ledger: ledger, VerifyFraction: cc.coldVerify, VerifyTimeout: cc.coldTimeout}
		r, err := b.commitsLoad(ctx, rep, "cold start and oracle through a fresh edge", v, map[string]*proc{"edge-fresh": fresh.p, "natsd": natsd})
		if err != nil {
			return err
		}
		first := -1.0
		if vr := r.Verify; vr != nil && len(vr.List) > 0 && vr.List[0].Error == "" {
			first = vr.List[0].FirstPageMS / 1000
		}
		note := "first List call on a fresh edge: the world's checkpoint from the bucket plus the stream tail"
		if s := scrape(fresh.metrics); s != nil {
			if n := s.sum("millrace_commits_world_open_seconds_count"); n > 0 {
				note += fmt.Sprintf("; the edge's own world-open time %.2f s", s.sum("millrace_commits_world_open_seconds_sum")/n)
			}
		}
		if first < 0 {
			note = "List failed or is not served: " + r.Verify.ListError
			first = 1e9
		}
		rep.Checks = append(rep.Checks,
			below(fmt.Sprintf("%s: cold start of a %d-document world (first List page)", name, cc.coldDocs), first, 10, "s", join(note, b.busyNote(rep))))
		rep.Checks = append(rep.Checks, oracleChecks(name, r)...)
	}
	return nil
}

func per1k(r *commitsload.Report, name string) float64 {
	for _, p := range r.Processes {
		if p.Name == name {
			return p.Per1kWrites
		}
	}
	return 0
}

func foldCPU(r *commitsload.Report, name string) float64 {
	for _, p := range r.Processes {
		if p.Name == name {
			return p.FoldCPUS
		}
	}
	return 0
}

// anyOf reports whether any of names is selected.
func anyOf(selected map[string]bool, names []string) bool {
	for _, n := range names {
		if selected[n] {
			return true
		}
	}
	return false
}
