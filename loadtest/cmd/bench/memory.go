package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/millrace/millrace/loadtest/replay"
)

// The memory scenario: what an open stream costs the edge in resident
// memory. JetStream runs apart (natsd), so that the edge's RSS is the
// edge's alone.
const scEdgeMemory = "edge-memory"

// memoryTargetKiB is the most an open stream may add to the edge's RSS.
const memoryTargetKiB = 64

// memoryConfig sizes edge-memory (flags of the bench).
type memoryConfig struct {
	streamsList    string
	streams        []int
	rate           float64
	ramp           time.Duration
	duration       time.Duration
	warmupStreams  int
	warmupDuration time.Duration
	settle         time.Duration
	sample         time.Duration
}

func (c *memoryConfig) register(fs *flag.FlagSet) {
	fs.StringVar(&c.streamsList, "memory-streams", "1000,5000", "edge-memory: open streams, comma-separated: one run per number, each on a fresh edge and natsd")
	fs.Float64Var(&c.rate, "memory-rate", 2500, "edge-memory: total events/s of each run, whatever its number of streams (and of the warm-up)")
	fs.DurationVar(&c.ramp, "memory-ramp", 20*time.Second, "edge-memory: the streams of a run start evenly over this long (5,000 opening in the same second swamp the edge)")
	fs.DurationVar(&c.duration, "memory-duration", 40*time.Second, "edge-memory: how long the streams of a run stay open after the ramp (RSS sampled throughout)")
	fs.IntVar(&c.warmupStreams, "memory-warmup-streams", 8, "edge-memory: streams of the warm-up before the baseline (closed when it is read)")
	fs.DurationVar(&c.warmupDuration, "memory-warmup-duration", 10*time.Second, "edge-memory: length of the warm-up at -memory-rate")
	fs.DurationVar(&c.settle, "memory-settle", 5*time.Second, "edge-memory: wait after the warm-up's streams closed before the baseline RSS is read")
	fs.DurationVar(&c.sample, "memory-sample", time.Second, "edge-memory: how often the edge's RSS and open streams are read during a run")
}

func (c *memoryConfig) validate() error {
	errs := negatives(map[string]float64{"memory-rate": c.rate, "memory-duration": c.duration.Seconds(), "memory-ramp": c.ramp.Seconds(),
		"memory-warmup-streams": float64(c.warmupStreams), "memory-warmup-duration": c.warmupDuration.Seconds(),
		"memory-settle": c.settle.Seconds(), "memory-sample": c.sample.Seconds()})
	c.streams = nil
	for _, s := range strings.Split(c.streamsList, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n <= 0 {
			errs = append(errs, fmt.Errorf("-memory-streams %q: want positive numbers, comma-separated", c.streamsList))
			break
		}
		c.streams = append(c.streams, n)
	}
	if c.sample == 0 {
		c.sample = time.Second
	}
	if c.warmupStreams == 0 {
		c.warmupStreams = 8
	}
	return errors.Join(errs...)
}

// memoryReport is one edge-memory run's memory figures (KiB are 1,024
// bytes, as /proc/<pid>/status counts them).
type memoryReport struct {
	Streams       int `json:"streams"`
	WarmupStreams int `json:"warmup_streams"`
	// BaselineRSSKiB is VmRSS once the warm-up's streams had closed and
	// -memory-settle passed; BaselineHWMKiB the VmHWM then.
	BaselineRSSKiB int64 `json:"baseline_rss_kib"`
	BaselineHWMKiB int64 `json:"baseline_hwm_kib"`
	// PeakRSSKiB is VmHWM a second before the run stopped its streams;
	// PeakFrom says whether it was reset at the baseline (then it is the
	// run's own peak). EndHWMKiB is VmHWM after the stop, when every
	// stream half-closed at once.
	PeakRSSKiB       int64  `json:"peak_rss_kib"`
	PeakFrom         string `json:"peak_from"`
	EndHWMKiB        int64  `json:"end_hwm_kib"`
	MaxSampledRSSKiB int64  `json:"max_sampled_rss_kib"`
	// PerStreamKiB = (PeakRSSKiB - BaselineRSSKiB) / Streams: the target's
	// figure; PerStreamSampledKiB the same from the largest sampled VmRSS.
	PerStreamKiB        float64  `json:"rss_per_stream_kib"`
	PerStreamSampledKiB float64  `json:"rss_per_stream_sampled_kib"`
	OpenStreamsMax      int      `json:"open_streams_max"`
	AtMaxSample         memPoint `json:"at_max_sample"`
	Samples             int      `json:"samples"`
	SampleIntervalMS    float64  `json:"sample_interval_ms"`
	NATSDPeakRSSKiB     int64    `json:"natsd_peak_rss_kib"`
}

// memPoint is one sample of the edge: its RSS, the streams it had open
// (millrace_bes_streams_open) and what its Go runtime said (/metrics).
type memPoint struct {
	RSSKiB        int64 `json:"rss_kib"`
	OpenStreams   int   `json:"open_streams"`
	Goroutines    int   `json:"goroutines"`
	HeapInuseKiB  int64 `json:"heap_inuse_kib"`
	StackInuseKiB int64 `json:"stack_inuse_kib"`
}

// rssPerStreamKiB is the scenario's formula: what the open streams added
// to the edge's resident set over the baseline, per stream.
func rssPerStreamKiB(peakKiB, baselineKiB int64, streams int) float64 {
	if streams <= 0 {
		return 0
	}
	return round(float64(peakKiB-baselineKiB)/float64(streams), 2)
}

// memStatus is a process's resident set now (VmRSS) and at its peak
// (VmHWM), in KiB.
type memStatus struct{ rss, hwm int64 }

func readMemStatus(pid int) (memStatus, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return memStatus{}, err
	}
	return parseMemStatus(b)
}

// parseMemStatus reads the VmRSS and VmHWM lines of /proc/<pid>/status
// ("VmRSS:	   12345 kB").
func parseMemStatus(b []byte) (memStatus, error) {
	var m memStatus
	var seen int
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		k, v, ok := strings.Cut(sc.Text(), ":")
		if !ok || (k != "VmRSS" && k != "VmHWM") {
			continue
		}
		n, err := strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		if err != nil {
			return m, fmt.Errorf("/proc status %s: %q", k, v)
		}
		if k == "VmRSS" {
			m.rss = n
		} else {
			m.hwm = n
		}
		seen++
	}
	if seen < 2 {
		return m, errors.New("/proc status: no VmRSS or VmHWM (a kernel thread, or a process that exited)")
	}
	return m, nil
}

// resetHWM sets a process's VmHWM to its VmRSS now (proc(5), clear_refs
// "5", Linux 4.0), so that the peak read later is that of what follows.
func resetHWM(pid int) error {
	return os.WriteFile("/proc/"+strconv.Itoa(pid)+"/clear_refs", []byte("5"), 0)
}

// memSampler reads the edge's RSS and open streams every interval until
// a moment just before the run's stop, and then its VmHWM: the peak while
// the streams were open. (At the stop every stream half-closes at once, a
// burst of the bench's own making, not what N open streams hold.)
type memSampler struct {
	pid     int
	metrics string
	every   time.Duration

	mu      sync.Mutex
	samples int
	maxOpen int
	max     memPoint
	hwm     int64 // VmHWM at the deadline; 0 when it was not reached
	stopC   chan struct{}
	wg      sync.WaitGroup
}

func startMemSampler(pid int, metrics string, every time.Duration, until time.Time) *memSampler {
	s := &memSampler{pid: pid, metrics: metrics, every: every, stopC: make(chan struct{})}
	s.wg.Go(func() {
		t := time.NewTicker(every)
		defer t.Stop()
		deadline := time.NewTimer(time.Until(until))
		defer deadline.Stop()
		for {
			s.sample()
			select {
			case <-s.stopC:
				return
			case <-deadline.C:
				s.sample()
				if st, err := readMemStatus(s.pid); err == nil {
					s.mu.Lock()
					s.hwm = st.hwm
					s.mu.Unlock()
				}
				return
			case <-t.C:
			}
		}
	})
	return s
}

func (s *memSampler) sample() {
	st, err := readMemStatus(s.pid)
	if err != nil {
		return
	}
	p := memPoint{RSSKiB: st.rss}
	if m := scrape(s.metrics); m != nil {
		p.OpenStreams = int(m.sum("millrace_bes_streams_open"))
		p.Goroutines = int(m.sum("go_goroutines"))
		p.HeapInuseKiB = int64(m.sum("go_memstats_heap_inuse_bytes")) / 1024
		p.StackInuseKiB = int64(m.sum("go_memstats_stack_inuse_bytes")) / 1024
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.samples++
	s.maxOpen = max(s.maxOpen, p.OpenStreams)
	if p.RSSKiB > s.max.RSSKiB {
		s.max = p
	}
}

func (s *memSampler) stop() {
	close(s.stopC)
	s.wg.Wait()
}

func (b *bench) memoryScenario(ctx context.Context, rep *scenarioReport) error {
	mc := b.cfg.memory
	rep.Description = fmt.Sprintf("`millrace serve bes --nats-url` (natsd apart): resident memory per open stream, "+
		"(peak VmRSS at N open streams - VmRSS with none open after a warm-up) / N, at %.0f events/s in total", mc.rate)
	for _, n := range mc.streams {
		run, err := b.memoryRun(ctx, n, scEdgeMemory)
		if err != nil {
			return err
		}
		rep.Runs = append(rep.Runs, run)
		b.printRun(run)
		m := run.Memory
		fmt.Printf("  edge RSS: baseline %d KiB, peak %d KiB (%s), %d streams open at most: %.1f KiB per stream (sampled: %.1f)\n",
			m.BaselineRSSKiB, m.PeakRSSKiB, m.PeakFrom, m.OpenStreamsMax, m.PerStreamKiB, m.PerStreamSampledKiB)
		note := fmt.Sprintf("(VmHWM %d KiB - baseline VmRSS %d KiB) / %d streams; %d streams open at most", m.PeakRSSKiB, m.BaselineRSSKiB, n, m.OpenStreamsMax)
		if m.OpenStreamsMax < n {
			note += fmt.Sprintf("; fewer than the %d asked were open at once", n)
		}
		if errs := errorCount(run.Errors); errs > 0 {
			note += fmt.Sprintf("; %d streams or calls failed (%v): streams that failed were not open at the peak", errs, run.Errors)
		}
		if mc := run.Machine; mc != nil && mc.OtherCores > 0.25 {
			note += fmt.Sprintf("; other work on the machine took %.1f of its %d cores meanwhile", mc.OtherCores, b.machine.NProc)
		}
		note = join(note, b.floorMemoryNote(n))
		rep.Checks = append(rep.Checks, atMost(fmt.Sprintf("%s %d streams: edge RSS per open stream", scEdgeMemory, n),
			m.PerStreamKiB, memoryTargetKiB, "KiB", note))
	}
	return nil
}

// memoryRun measures one number of open streams on a fresh natsd and edge
// (scenario edge-memory), or on a fresh besfloor (grpc-floor).
func (b *bench) memoryRun(ctx context.Context, n int, scenario string) (runReport, error) {
	mc := b.cfg.memory
	dir, err := mkdir(b.tmp, scenario)
	if err != nil {
		return runReport{}, err
	}
	if !b.cfg.keep {
		defer os.RemoveAll(dir)
	}
	var e *edge
	var natsd *proc
	procs := map[string]*proc{}
	if scenario == scGRPCFloor {
		if e, err = b.startFloor(ctx, dir); err != nil {
			return runReport{}, err
		}
		procs["floor"] = e.p
	} else {
		var natsURL string
		if natsd, natsURL, err = b.startNATSD(ctx, dir); err != nil {
			return runReport{}, err
		}
		defer natsd.stop(stopGrace)
		if e, err = b.startEdge(ctx, dir, natsURL, edgeLimitsEnv(n)...); err != nil {
			return runReport{}, err
		}
		procs["edge"], procs["natsd"] = e.p, natsd
	}
	defer e.p.stop(stopGrace)
	mem, err := b.memoryBaseline(ctx, e, n)
	if err != nil {
		return runReport{}, err
	}

	fmt.Printf("  %d streams at %.0f events/s, starting over %s, then %s\n", n, mc.rate, mc.ramp, mc.duration)
	// The peak is read a second before the replay stops its streams.
	until := time.Now().Add(mc.ramp + mc.duration - time.Second)
	sampler := startMemSampler(e.p.pid(), e.metrics, mc.sample, until)
	before, err := takeSnapshot(procs)
	if err != nil {
		sampler.stop()
		return runReport{}, err
	}
	promBefore := scrape(e.metrics)
	res, err := replay.Run(ctx, replay.Config{
		Target: e.bes, Scripts: b.scripts, Streams: n, Projects: projectsFor(n), Rate: mc.rate, Ramp: mc.ramp, Duration: mc.ramp + mc.duration, Seed: 3,
	})
	sampler.stop()
	if err != nil {
		return runReport{}, err
	}
	after, err := takeSnapshot(procs)
	if err != nil {
		return runReport{}, err
	}
	label, natsLabel := fmt.Sprintf("%d streams", n), natsApart
	if natsd == nil {
		label, natsLabel = fmt.Sprintf("%d streams, floor", n), "none"
	}
	run := fillRun(label, res, n, natsLabel, b.cfg.natsSync)
	run.Mode = "paced"
	run.TargetEventsPerS = mc.rate
	run.CPU, run.Machine = cpuFigures(before, after, res.WindowEvents, nil)
	run.Machine.Load1Start = before.loadavg()
	run.Server = serverReport(scrape(e.metrics).delta(promBefore), nil)
	natsdPID := 0
	if natsd != nil {
		natsdPID = natsd.pid()
	}
	if err := mem.finish(e.p.pid(), natsdPID, sampler); err != nil {
		return runReport{}, err
	}
	run.Memory = mem
	return run, nil
}

// memoryBaseline warms the edge up with a few streams at the run's rate,
// waits for them to close and the process to settle, and reads its RSS:
// the edge with no stream open, its own working set included. It then
// resets VmHWM, so that the peak read at the end is the run's.
func (b *bench) memoryBaseline(ctx context.Context, e *edge, n int) (*memoryReport, error) {
	mc := b.cfg.memory
	fmt.Printf("  warm-up: %d streams at %.0f events/s for %s\n", mc.warmupStreams, mc.rate, mc.warmupDuration)
	res, err := replay.Run(ctx, replay.Config{Target: e.bes, Scripts: b.scripts, Streams: mc.warmupStreams,
		Projects: projectsFor(mc.warmupStreams), Rate: mc.rate, Duration: mc.warmupDuration, Seed: 2})
	if err != nil {
		return nil, fmt.Errorf("memory warm-up: %w", err)
	}
	if len(res.Errors) > 0 {
		return nil, fmt.Errorf("memory warm-up: errors %v: %v", res.Errors, res.ErrorSamples)
	}
	if err := waitStreamsClosed(ctx, e, 30*time.Second); err != nil {
		return nil, err
	}
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(mc.settle):
	}
	st, err := readMemStatus(e.p.pid())
	if err != nil {
		return nil, err
	}
	m := &memoryReport{Streams: n, WarmupStreams: mc.warmupStreams, BaselineRSSKiB: st.rss, BaselineHWMKiB: st.hwm,
		SampleIntervalMS: float64(mc.sample) / 1e6, PeakFrom: "VmHWM, reset to VmRSS at the baseline"}
	if err := resetHWM(e.p.pid()); err != nil {
		m.PeakFrom = fmt.Sprintf("VmHWM since the edge started (the reset was refused: %v)", err)
	}
	return m, nil
}

// finish fills in the peak (the sampler's VmHWM, before the stop) and the
// sampler's figures.
// natsdPID 0: no natsd (grpc-floor).
func (m *memoryReport) finish(edgePID, natsdPID int, s *memSampler) error {
	st, err := readMemStatus(edgePID)
	if err != nil {
		return err
	}
	if natsdPID != 0 {
		if ns, err := readMemStatus(natsdPID); err == nil {
			m.NATSDPeakRSSKiB = ns.hwm
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	m.EndHWMKiB = st.hwm
	if s.hwm == 0 {
		s.hwm = st.hwm // the run ended before the deadline
		m.PeakFrom += "; read at the end of the run, the stop included"
	}
	m.PeakRSSKiB = max(s.hwm, s.max.RSSKiB)
	m.MaxSampledRSSKiB, m.AtMaxSample, m.OpenStreamsMax, m.Samples = s.max.RSSKiB, s.max, s.maxOpen, s.samples
	m.PerStreamKiB = rssPerStreamKiB(m.PeakRSSKiB, m.BaselineRSSKiB, m.Streams)
	m.PerStreamSampledKiB = rssPerStreamKiB(m.MaxSampledRSSKiB, m.BaselineRSSKiB, m.Streams)
	return nil
}

func errorCount(errs map[string]int64) int64 {
	var n int64
	for _, c := range errs {
		n += c
	}
	return n
}

// waitStreamsClosed polls the edge's open-streams gauge until it reads 0.
func waitStreamsClosed(ctx context.Context, e *edge, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		m := scrape(e.metrics)
		if m != nil && m.sum("millrace_bes_streams_open") == 0 {
			return nil
		}
		if e.p.exited() || time.Now().After(deadline) {
			return fmt.Errorf("the edge still had streams open %s after the warm-up (exited: %v)", timeout, e.p.exited())
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}
