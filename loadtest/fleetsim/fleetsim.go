// Package fleetsim is the fleet simulator behind `millrace loadtest fleet`:
// thousands of simulated GPU nodes in one process, each a real
// agent.Agent holding a real mTLS session with the fleet gateways, with
// heartbeats, status changes, crashes, a reconnect storm and reservations
// through the Reservations API, and a JSON report of what the fleet's
// services did with it (sessions, refusals, re-home times, placements and
// place-to-active, liveness lag, false unreachable marks, double bookings,
// gateway memory per session). See README.md.
package fleetsim

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"runtime"
	"runtime/debug"
	"sort"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"

	"github.com/millrace/millrace/agent"
	"github.com/millrace/millrace/internal/tlsfiles"
	"github.com/millrace/millrace/loadtest/replay"
)

// sim is one run's state.
type sim struct {
	cfg      Config
	out      io.Writer
	outMu    sync.Mutex
	seed     uint64
	nodes    []*node
	byID     map[string]*node
	settings *agent.Settings
	match    *matcher
	samples  chan sample

	start    time.Time // first dial
	resvFrom atomic.Int64

	sessions, peak                              atomic.Int64
	welcomes, heartbeats                        atomic.Int64
	statusChanges                               atomic.Int64
	allHeldAt                                   atomic.Int64
	firstWelcome                                replay.Histogram
	rehome, stormRehome                         replay.Histogram
	stormPending                                atomic.Int64
	stormDoneAt                                 atomic.Int64
	crashStarted, crashResumed                  atomic.Int64
	crashForever, crashReconnect, crashSurvived atomic.Int64

	resvCreated, resvCancelled, resvSkipped atomic.Int64
	createTime                              replay.Histogram
	placed, released, failed, allocations   atomic.Int64

	bindsReceived, bindRepeats, bindConflicts, bindsInvalid, unbinds atomic.Int64

	liveLag    replay.Histogram
	liveUnseen atomic.Int64

	mu           sync.Mutex
	refusals     map[string]int64
	disconnects  map[string]int64
	createErrors map[string]int64
	cancelErrors map[string]int64
	errs         []string
	errCount     map[string]int
	marks        map[string]mark
	gw           []GatewayProcess
	goroutines   int
	conflicts    []Conflict
}

// maxConflictSamples bounds Binds.ConflictSamples.
const maxConflictSamples = 32

// conflict counts a Bind that met a GPU held for another allocation and
// keeps the first few.
func (s *sim) conflict(c Conflict) {
	s.bindConflicts.Add(1)
	s.mu.Lock()
	if len(s.conflicts) < maxConflictSamples {
		s.conflicts = append(s.conflicts, c)
	}
	s.mu.Unlock()
}

func (s *sim) newRand(stream uint64) *rand.Rand { return rand.New(rand.NewPCG(s.seed, stream)) }

func (s *sim) printf(format string, args ...any) {
	s.outMu.Lock()
	fmt.Fprintf(s.out, format, args...)
	s.outMu.Unlock()
}

func (s *sim) count(m *map[string]int64, k string) {
	s.mu.Lock()
	(*m)[k]++
	s.mu.Unlock()
}

// errorf keeps the first few errors of each kind for the report.
func (s *sim) errorf(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.errCount[format]++
	if s.errCount[format] <= 3 {
		s.errs = append(s.errs, fmt.Sprintf(format, args...))
	}
}

func (s *sim) sessionUp(at time.Time) {
	v := s.sessions.Add(1)
	for {
		p := s.peak.Load()
		if v <= p || s.peak.CompareAndSwap(p, v) {
			break
		}
	}
	if v == int64(len(s.nodes)) && s.allHeldAt.CompareAndSwap(0, at.UnixNano()) {
		s.printf("fleetsim: all %d nodes hold sessions, %.1fs after the first dial\n", len(s.nodes), at.Sub(s.start).Seconds())
	}
}

func (s *sim) stormWelcomed(at time.Time) {
	if s.stormPending.Add(-1) == 0 {
		s.stormDoneAt.CompareAndSwap(0, at.UnixNano())
	}
}

func (s *sim) resvStarted(at time.Time) { s.resvFrom.CompareAndSwap(0, at.UnixNano()) }

// Run simulates cfg.Nodes nodes against the gateways for cfg.Duration and
// reports what it measured. Progress lines go to progress every
// cfg.ProgressEvery. It refuses a run that cannot fit in this process'
// open-files limit. When ctx ends early the load stops, the run winds down
// and Run returns the partial report with ctx's error.
func Run(ctx context.Context, cfg Config, progress io.Writer) (*Report, error) {
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("fleetsim: %w", err)
	}
	cfg = cfg.withDefaults()
	if progress == nil {
		progress = io.Discard
	}
	if cfg.GCPercent > 0 {
		defer debug.SetGCPercent(debug.SetGCPercent(cfg.GCPercent))
	}
	limit, err := checkFiles(cfg)
	if err != nil {
		return nil, fmt.Errorf("fleetsim: %w", err)
	}
	s := &sim{
		cfg: cfg, out: progress, seed: cfg.Seed,
		byID: make(map[string]*node, cfg.Nodes), match: newMatcher(), samples: make(chan sample, 256),
		refusals: map[string]int64{}, disconnects: map[string]int64{}, createErrors: map[string]int64{},
		cancelErrors: map[string]int64{}, errCount: map[string]int{}, marks: map[string]mark{},
	}
	if s.seed == 0 {
		s.seed = rand.Uint64()
	}
	rep := &Report{Started: time.Now()}
	ips, _ := cfg.localIPs()
	rep.Setup = Setup{
		Nodes: cfg.Nodes, FirstNode: cfg.FirstNode, Pool: cfg.Pool, GPUsPerNode: cfg.GPUsPerNode,
		Gateways: cfg.Gateways, OpenFilesLimit: limit, RampS: max(0, cfg.Ramp.Seconds()), StatusRate: cfg.StatusRate,
		CrashRate: cfg.CrashRate, CrashForS: cfg.CrashFor.Seconds(), StormAtS: cfg.StormAt.Seconds(),
		ReservationRPS: cfg.ReservationRate, UnreachableS: cfg.UnreachableAfter.Seconds(), Seed: s.seed,
	}
	for _, m := range cfg.Models {
		rep.Setup.Models = append(rep.Setup.Models, fmt.Sprintf("%s:%d", m.Name, m.MemoryMiB))
	}
	for _, ip := range ips {
		rep.Setup.LocalAddrs = append(rep.Setup.LocalAddrs, ip.String())
	}

	// The nodes and their certificates.
	ids := make([]string, cfg.Nodes)
	width := len(fmt.Sprint(cfg.FirstNode + cfg.Nodes - 1))
	width = max(width, 5)
	for i := range ids {
		ids[i] = fmt.Sprintf("%s%0*d", cfg.NodePrefix, width, cfg.FirstNode+i)
	}
	certStart := time.Now()
	certs, trust, mode, err := s.certificates(ctx, ids, ips)
	if err != nil {
		return nil, fmt.Errorf("fleetsim: node certificates: %w", err)
	}
	rep.Setup.Certificates, rep.Setup.CertSetupS = mode, round(time.Since(certStart).Seconds(), 2)
	s.printf("fleetsim: %d node certificates (%s) in %.1fs\n", len(certs), mode, rep.Setup.CertSetupS)

	s.settings = &agent.Settings{
		Gateways:       cfg.Gateways,
		TLS:            &tls.Config{RootCAs: trust, ServerName: cfg.ServerName, MinVersion: tls.VersionTLS12},
		AgentVersion:   "fleetsim",
		GaugeInterval:  cfg.GaugeInterval,
		SilenceTimeout: cfg.SilenceTimeout,
	}
	var dialers []func(context.Context, string) (net.Conn, error)
	for _, ip := range ips {
		dialers = append(dialers, dialer(ip))
	}
	for i, id := range ids {
		n := newNode(s, i, id, cfg.Models[i%len(cfg.Models)], cfg.GPUsPerNode)
		ac := agent.Config{
			Settings: s.settings, NodeID: id, Pool: cfg.Pool, Labels: n.labels(), GPUs: n.gpus,
			Certificate: certs[i], Status: n.status, Bind: n.bind, Observer: n,
		}
		if len(dialers) > 0 {
			ac.Dialer = dialers[i%len(dialers)]
		}
		a, err := agent.New(ac)
		if err != nil {
			return nil, fmt.Errorf("fleetsim: node %s: %w", id, err)
		}
		n.a = a
		s.nodes = append(s.nodes, n)
		s.byID[id] = n
	}

	// What measures, before anything connects.
	if cfg.NATSURL != "" {
		nc, err := s.subscribeDecisions(cfg.NATSURL)
		if err != nil {
			return nil, fmt.Errorf("fleetsim: %w", err)
		}
		defer nc.Close()
		rep.Placements.Source = "nats"
	}
	var db *pgxpool.Pool
	var dbStart time.Time
	if cfg.DatabaseURL != "" {
		pc, err := pgxpool.ParseConfig(cfg.DatabaseURL)
		if err != nil {
			return nil, fmt.Errorf("fleetsim: database URL: %w", err)
		}
		pc.MaxConns = 4
		if db, err = pgxpool.NewWithConfig(ctx, pc); err != nil {
			return nil, fmt.Errorf("fleetsim: database: %w", err)
		}
		defer db.Close()
		if err := db.QueryRow(ctx, "select now()").Scan(&dbStart); err != nil {
			return nil, fmt.Errorf("fleetsim: database: %w", err)
		}
		if rep.Placements.Source == "" {
			rep.Placements.Source = "database"
		}
	}
	for _, pid := range cfg.GatewayPIDs {
		kib, err := readRSS(pid)
		if err != nil {
			return nil, fmt.Errorf("fleetsim: gateway pid %d: %w", pid, err)
		}
		cpu, err := readCPU(pid)
		if err != nil {
			return nil, fmt.Errorf("fleetsim: gateway pid %d: %w", pid, err)
		}
		s.gw = append(s.gw, GatewayProcess{PID: pid, BaselineKiB: kib, AtPeakKiB: kib, MaxKiB: kib, EndKiB: kib, cpu0: cpu, cpu: cpu})
	}
	var res *reserver
	if cfg.ReservationRate > 0 {
		if res, err = newReserver(s); err != nil {
			return nil, fmt.Errorf("fleetsim: %w", err)
		}
	}
	var ru0 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru0)

	// The load.
	s.start = time.Now()
	loadCtx, stopLoad := context.WithDeadline(ctx, s.start.Add(cfg.Duration))
	defer stopLoad()
	measureCtx, stopMeasure := context.WithCancel(context.Background())
	defer stopMeasure()
	var loadWG, measureWG sync.WaitGroup
	goLoad := func(f func()) { loadWG.Add(1); go func() { defer loadWG.Done(); f() }() }
	goMeasure := func(f func()) { measureWG.Add(1); go func() { defer measureWG.Done(); f() }() }

	goLoad(func() { s.startNodes(loadCtx) })
	goMeasure(func() { s.sampleMemory(measureCtx) })
	goMeasure(func() { s.progressLoop(measureCtx) })
	if cfg.StatusRate > 0 {
		goLoad(func() { s.statusLoop(loadCtx) })
	}
	if cfg.CrashRate > 0 {
		goLoad(func() { s.crashLoop(loadCtx) })
	}
	var storm *Storm
	if cfg.StormAt > 0 && cfg.StormAt < cfg.Duration {
		storm = &Storm{RecoveredS: -1}
		goLoad(func() { s.stormAfter(loadCtx, storm) })
	}
	if res != nil {
		goLoad(func() { res.run(loadCtx) })
	}
	if db != nil {
		if cfg.NATSURL == "" {
			goMeasure(func() { s.pollAllocations(measureCtx, db, dbStart) })
		}
		goMeasure(func() { s.pollLiveness(measureCtx, db) })
		goMeasure(func() { s.pollUnreachable(measureCtx, db, dbStart) })
		if cfg.LivenessSamples > 0 {
			goLoad(func() { s.livenessSampler(loadCtx) })
		}
	}

	<-loadCtx.Done()
	loadWG.Wait()
	loadEnd := time.Now()
	s.sampleMemoryOnce()
	s.mu.Lock()
	for i := range s.gw {
		s.gw[i].CPUS = round((s.gw[i].cpu - s.gw[i].cpu0).Seconds(), 2)
	}
	s.mu.Unlock()
	var ru1 syscall.Rusage
	_ = syscall.Getrusage(syscall.RUSAGE_SELF, &ru1)
	rep.Simulator.CPUS = round(time.Duration(syscall.TimevalToNsec(ru1.Utime)-syscall.TimevalToNsec(ru0.Utime)+
		syscall.TimevalToNsec(ru1.Stime)-syscall.TimevalToNsec(ru0.Stime)).Seconds(), 2)
	rep.Simulator.MaxRSSKiB = ru1.Maxrss
	if res != nil {
		res.close()
	}
	s.printf("fleetsim: load done after %.1fs; settling (up to %s): %d placed allocations not yet bound, %d nodes crashed, %d storm re-homes to go\n",
		loadEnd.Sub(s.start).Seconds(), cfg.Settle, s.match.pending(), s.crashStarted.Load()-s.crashResumed.Load(), max(0, s.stormPending.Load()))
	s.settle(ctx, cfg.Settle)

	// Final figures, sessions still up.
	rep.DurationS = round(loadEnd.Sub(s.start).Seconds(), 2)
	rep.Sessions.Held = s.sessions.Load()
	if db != nil {
		fctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		s.unreachableOnce(fctx, db, dbStart)
		liv := &Liveness{}
		if st, err := nodeStates(fctx, db, cfg.Pool); err == nil {
			liv.States = st
		} else {
			s.errorf("count node states: %v", err)
		}
		if d, err := doubleBookings(fctx, db, cfg.Pool); err == nil {
			rep.DoubleBookings = d
		} else {
			s.errorf("check double bookings: %v", err)
		}
		cancel()
		rep.Liveness = liv
	}
	stopMeasure()
	measureWG.Wait()
	s.sampleMemoryOnce()

	s.printf("fleetsim: stopping %d agents\n", len(s.nodes))
	s.stopAgents()
	s.fill(rep, storm, loadEnd)
	rep.Finished = time.Now()
	s.printf("%s\n", s.summaryLine(rep))
	if ctx.Err() != nil {
		return rep, ctx.Err()
	}
	return rep, nil
}

// certificates gets every node's certificate and the pool to trust the
// gateways with.
func (s *sim) certificates(ctx context.Context, ids []string, ips []net.IP) ([]*tls.Certificate, *x509.CertPool, string, error) {
	cfg := s.cfg
	caPEM, err := os.ReadFile(cfg.GatewayCA)
	if err != nil {
		return nil, nil, "", err
	}
	trust, err := tlsfiles.PoolPEM(caPEM)
	if err != nil {
		return nil, nil, "", fmt.Errorf("%s: %w", cfg.GatewayCA, err)
	}
	if cfg.CACert != "" {
		is, err := loadIssuer(cfg.CACert, cfg.CAKey)
		if err != nil {
			return nil, nil, "", err
		}
		certs, err := is.issueAll(ctx, ids, cfg.Pool)
		return certs, trust, "ca", err
	}
	var tokens []string
	if cfg.JoinTokensFile != "" {
		if tokens, err = readTokens(cfg.JoinTokensFile); err != nil {
			return nil, nil, "", err
		}
		if len(tokens) < len(ids) {
			return nil, nil, "", fmt.Errorf("%s has %d tokens for %d nodes", cfg.JoinTokensFile, len(tokens), len(ids))
		}
	}
	var dialOpts []grpc.DialOption
	for _, ip := range ips {
		dialOpts = append(dialOpts, grpc.WithContextDialer(dialer(ip)))
	}
	var last atomic.Int64
	last.Store(time.Now().UnixNano())
	certs, err := joinAll(ctx, cfg, ids, tokens, caPEM, dialOpts, func(done int) {
		l := last.Load()
		if now := time.Now().UnixNano(); time.Duration(now-l) > cfg.ProgressEvery && last.CompareAndSwap(l, now) {
			s.printf("fleetsim: joined %d/%d nodes\n", done, len(ids))
		}
	})
	return certs, trust, "join", err
}

// startNodes starts the agents, spread evenly over the ramp.
func (s *sim) startNodes(ctx context.Context) {
	n := len(s.nodes)
	ramp := s.cfg.Ramp
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for i := 0; i < n; {
		due := n
		if ramp > 0 {
			due = min(n, int(float64(n)*float64(time.Since(s.start))/float64(ramp))+1)
		}
		for ; i < due; i++ {
			nd := s.nodes[i]
			nd.mu.Lock()
			nd.startedAt = time.Now()
			nd.mu.Unlock()
			nd.a.Start()
		}
		if i >= n {
			return
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// pick returns a random node that holds a session and is not crashed, or
// nil after a few tries.
func (s *sim) pick(rnd *rand.Rand) *node {
	for range 32 {
		n := s.nodes[rnd.IntN(len(s.nodes))]
		n.mu.Lock()
		ok := n.connected && !n.crashed
		n.mu.Unlock()
		if ok {
			return n
		}
	}
	return nil
}

// poisson waits an exponential time of mean 1/ratePerSec; false when ctx
// ends first.
func poisson(ctx context.Context, rnd *rand.Rand, ratePerSec float64) bool {
	d := time.Duration(rnd.ExpFloat64() / ratePerSec * float64(time.Second))
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}

func (s *sim) statusLoop(ctx context.Context) {
	rnd := s.newRand(1)
	for poisson(ctx, rnd, s.cfg.StatusRate) {
		if n := s.pick(rnd); n != nil {
			n.flip(rnd.IntN(len(n.gpus)))
			s.statusChanges.Add(1)
		}
	}
}

func (s *sim) crashLoop(ctx context.Context) {
	rnd := s.newRand(2)
	for poisson(ctx, rnd, s.cfg.CrashRate/60) {
		n := s.pick(rnd)
		if n == nil {
			continue
		}
		n.crash()
		s.crashStarted.Add(1)
		if s.cfg.CrashFor > 0 {
			time.AfterFunc(s.cfg.CrashFor, n.resume)
		} else {
			s.crashForever.Add(1)
		}
	}
}

// stormAfter drops every session (of nodes not crashed) at once.
func (s *sim) stormAfter(ctx context.Context, st *Storm) {
	t := time.NewTimer(time.Until(s.start.Add(s.cfg.StormAt)))
	defer t.Stop()
	select {
	case <-ctx.Done():
		return
	case <-t.C:
	}
	var victims []*node
	for _, n := range s.nodes {
		n.mu.Lock()
		if n.connected && !n.crashed {
			victims = append(victims, n)
		}
		n.mu.Unlock()
	}
	st.At = time.Now()
	st.Dropped = len(victims)
	s.stormPending.Store(int64(len(victims)))
	s.printf("fleetsim: reconnect storm: dropping %d sessions\n", len(victims))
	for _, n := range victims {
		n.a.Reconnect()
	}
}

// livenessSampler marks a random node so that its next heartbeat is
// followed into the database.
func (s *sim) livenessSampler(ctx context.Context) {
	rnd := s.newRand(4)
	for poisson(ctx, rnd, s.cfg.LivenessSamples) {
		if n := s.pick(rnd); n != nil {
			n.sampleNext.Store(true)
		}
	}
}

// settle waits until every placed allocation is bound, every crash with
// an end has ended and every node dropped by the storm is back, or d
// passes.
func (s *sim) settle(ctx context.Context, d time.Duration) {
	deadline := time.Now().Add(d)
	for time.Now().Before(deadline) && ctx.Err() == nil {
		crashing := s.crashStarted.Load() - s.crashForever.Load() - s.crashResumed.Load()
		if s.match.pending() == 0 && crashing == 0 && s.stormPending.Load() <= 0 {
			return
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func (s *sim) sampleMemory(ctx context.Context) {
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.sampleMemoryOnce()
	}
}

// sampleMemoryOnce reads the gateways' RSS, keeping the figure taken when
// the sessions held were at their peak.
func (s *sim) sampleMemoryOnce() {
	sessions := s.sessions.Load()
	gr := runtime.NumGoroutine()
	s.mu.Lock()
	defer s.mu.Unlock()
	s.goroutines = max(s.goroutines, gr)
	for i := range s.gw {
		g := &s.gw[i]
		kib, err := readRSS(g.PID)
		if err != nil {
			g.Gone = true
			continue
		}
		if cpu, err := readCPU(g.PID); err == nil {
			g.cpu = cpu
		}
		g.EndKiB = kib
		g.MaxKiB = max(g.MaxKiB, kib)
		if sessions >= g.peakSessions && sessions > 0 {
			g.peakSessions = sessions
			g.AtPeakKiB = kib
		}
	}
}

func (s *sim) progressLoop(ctx context.Context) {
	if s.cfg.ProgressEvery <= 0 {
		return
	}
	t := time.NewTicker(s.cfg.ProgressEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.printf("%s\n", s.progressLine())
	}
}

func (s *sim) progressLine() string {
	s.mu.Lock()
	var refused int64
	for _, v := range s.refusals {
		refused += v
	}
	var rss int64
	for _, g := range s.gw {
		rss += g.EndKiB
	}
	s.mu.Unlock()
	el := time.Since(s.start)
	line := fmt.Sprintf("fleetsim %4.0fs: sessions %d/%d (peak %d) refused %d rehomes %d crashed %d",
		el.Seconds(), s.sessions.Load(), len(s.nodes), s.peak.Load(), refused,
		s.rehome.Count()+s.stormRehome.Count(), s.crashStarted.Load()-s.crashResumed.Load())
	if s.cfg.ReservationRate > 0 || s.placed.Load() > 0 {
		line += fmt.Sprintf(" | resv %d placed %d active %d pending %d", s.resvCreated.Load(), s.placed.Load(), s.match.matched(), s.match.pending())
	}
	if rss > 0 {
		line += fmt.Sprintf(" | gateway rss %d MiB", rss/1024)
	}
	return line
}

// stopAgents stops every agent, all at once, each given a few seconds to
// close its session cleanly.
func (s *sim) stopAgents() {
	var wg sync.WaitGroup
	for _, n := range s.nodes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			n.a.Stop(ctx)
		}()
	}
	wg.Wait()
}

// fill writes the figures into the report.
func (s *sim) fill(rep *Report, storm *Storm, loadEnd time.Time) {
	rep.Sessions.Peak = s.peak.Load()
	rep.Sessions.Welcomes = s.welcomes.Load()
	rep.Sessions.AllHeldS = -1
	if at := s.allHeldAt.Load(); at != 0 {
		rep.Sessions.AllHeldS = round(time.Unix(0, at).Sub(s.start).Seconds(), 3)
	}
	for _, n := range s.nodes {
		n.mu.Lock()
		if !n.everConnected {
			rep.Sessions.NeverConnected++
		}
		n.mu.Unlock()
	}
	rep.Sessions.FirstWelcome = s.firstWelcome.Summary()
	rep.Heartbeats = s.heartbeats.Load()
	rep.StatusChanges = s.statusChanges.Load()
	rep.Rehome = Rehome{s.rehome.Summary()}
	if storm != nil && !storm.At.IsZero() {
		storm.Rehome = s.stormRehome.Summary()
		if at := s.stormDoneAt.Load(); at != 0 {
			storm.RecoveredS = round(time.Unix(0, at).Sub(storm.At).Seconds(), 3)
		}
		rep.Storm = storm
	}
	rep.Crash = Crashes{
		Started: s.crashStarted.Load(), Resumed: s.crashResumed.Load(), Forever: s.crashForever.Load(),
		Reconnect: s.crashReconnect.Load(), SessionSurvived: s.crashSurvived.Load(),
	}
	rep.Binds = Binds{
		Received: s.bindsReceived.Load(), Repeats: s.bindRepeats.Load(), Conflicts: s.bindConflicts.Load(),
		Invalid: s.bindsInvalid.Load(), Unbinds: s.unbinds.Load(),
	}
	p := &rep.Placements
	p.Placed, p.Released, p.Failed, p.Allocations = s.placed.Load(), s.released.Load(), s.failed.Load(), s.allocations.Load()
	if from := s.resvFrom.Load(); from != 0 {
		p.WindowS = round(loadEnd.Sub(time.Unix(0, from)).Seconds(), 3)
	} else {
		p.WindowS = round(loadEnd.Sub(s.start).Seconds(), 3)
	}
	if p.WindowS > 0 {
		p.PerSecond = round(float64(p.Placed)/p.WindowS, 2)
	}
	p.PlaceToActive = s.match.hist.Summary()
	s.match.mu.Lock()
	p.NotBound = int64(len(s.match.decided))
	p.ReleasedUnbound = s.match.released
	s.match.mu.Unlock()

	s.mu.Lock()
	defer s.mu.Unlock()
	rep.Refusals = s.refusals
	rep.Disconnect = s.disconnects
	rep.Reservations = Reservations{
		Created: s.resvCreated.Load(), Skipped: s.resvSkipped.Load(), Cancelled: s.resvCancelled.Load(),
		CreateErrors: s.createErrors, CancelErrors: s.cancelErrors, CreateTime: s.createTime.Summary(),
	}
	rep.Binds.ConflictSamples = s.conflicts
	rep.Gateways = s.gw
	rep.Simulator.PeakGoroutines = s.goroutines
	var base, atPeak int64
	for _, g := range s.gw {
		base += g.BaselineKiB
		atPeak += g.AtPeakKiB
	}
	if rep.Sessions.Peak > 0 && len(s.gw) > 0 {
		rep.RSSPerSessionKiB = round(float64(atPeak-base)/float64(rep.Sessions.Peak), 2)
	}
	if rep.Liveness != nil {
		l := rep.Liveness
		l.Lag = s.liveLag.Summary()
		l.Unseen = s.liveUnseen.Load()
		l.UnreachableMarks = int64(len(s.marks))
		ids := make([]string, 0, len(s.marks))
		for id := range s.marks {
			ids = append(ids, id)
		}
		sort.Strings(ids)
		for _, id := range ids {
			m := s.marks[id]
			if m.longest >= s.cfg.UnreachableAfter {
				continue
			}
			l.FalseUnreachable++
			if len(l.FalseExamples) < 20 {
				l.FalseExamples = append(l.FalseExamples, FalseMark{Node: id, StateSince: m.since, LongestDownMS: ms(m.longest)})
			}
		}
	}
	rep.Errors = append(rep.Errors, s.errs...)
	for k, n := range s.errCount {
		if n > 3 {
			rep.Errors = append(rep.Errors, fmt.Sprintf("(%d more like %q)", n-3, k))
		}
	}
}

func (s *sim) summaryLine(r *Report) string {
	line := fmt.Sprintf("fleetsim: done: %d nodes, sessions held %d (peak %d), all held after %.1fs, rehome p50/p99/max %.0f/%.0f/%.0f ms (n=%d)",
		r.Setup.Nodes, r.Sessions.Held, r.Sessions.Peak, r.Sessions.AllHeldS, r.Rehome.P50MS, r.Rehome.P99MS, r.Rehome.MaxMS, r.Rehome.Count)
	if r.Placements.Placed > 0 {
		line += fmt.Sprintf(", placements %.1f/s, place-to-active p50/p99 %.0f/%.0f ms", r.Placements.PerSecond, r.Placements.PlaceToActive.P50MS, r.Placements.PlaceToActive.P99MS)
	}
	if r.RSSPerSessionKiB > 0 {
		line += fmt.Sprintf(", gateway RSS %.1f KiB/session", r.RSSPerSessionKiB)
	}
	if r.DoubleBookings != nil {
		line += fmt.Sprintf(", double bookings %d", r.DoubleBookings.Total)
	}
	if r.Liveness != nil {
		line += fmt.Sprintf(", false unreachable %d", r.Liveness.FalseUnreachable)
	}
	return line
}

func ms(d time.Duration) float64 { return round(float64(d)/1e6, 3) }

func round(v float64, digits int) float64 {
	p := 1.0
	for range digits {
		p *= 10
	}
	if v < 0 {
		return -float64(int64(-v*p+0.5)) / p
	}
	return float64(int64(v*p+0.5)) / p
}
