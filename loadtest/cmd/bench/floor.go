package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/millrace/millrace/loadtest/replay"
)

// The floor scenario: the paced-1000 load and the edge-memory streams
// against besfloor (loadtest/cmd/besfloor), a BES server with the edge's
// gRPC options and collector pacing that acknowledges every event at once
// and does nothing else. What it spends is gRPC's and the Go runtime's
// own cost of a paced stream on this machine: the floor under the edge's
// figures, which no change to the edge can go below.
const scGRPCFloor = "grpc-floor"

// floorFigures are what grpc-floor measured, for the notes of the edge's
// checks that run after it in the same bench run.
type floorFigures struct {
	eventsPerCPUS float64
	perStreamKiB  map[int]float64 // by open streams
}

func buildFloor(ctx context.Context, dir string) (string, error) {
	return goBuild(ctx, dir, "besfloor")
}

// freshFloor starts besfloor in a new directory named for the run; stop
// stops it and removes the directory (unless -keep).
func (b *bench) freshFloor(ctx context.Context, name string) (f *edge, dir string, stop func(), err error) {
	if dir, err = mkdir(b.tmp, name); err != nil {
		return nil, "", nil, err
	}
	if f, err = b.startFloor(ctx, dir); err != nil {
		if !b.cfg.keep {
			os.RemoveAll(dir)
		}
		return nil, "", nil, err
	}
	return f, dir, func() {
		f.p.stop(stopGrace)
		if !b.cfg.keep {
			os.RemoveAll(dir)
		}
	}, nil
}

// startFloor starts besfloor on free ports.
func (b *bench) startFloor(ctx context.Context, dir string) (*edge, error) {
	bes, err := freeAddr()
	if err != nil {
		return nil, err
	}
	web, err := freeAddr()
	if err != nil {
		return nil, err
	}
	p, err := startProc("floor", b.floor, []string{"-listen", bes, "-http", web}, nil, filepath.Join(dir, "besfloor.log"))
	if err != nil {
		return nil, err
	}
	if err := waitReady(ctx, p, "http://"+web+"/readyz", readyTimeout); err != nil {
		p.stop(stopGrace)
		return nil, err
	}
	return &edge{p: p, bes: bes, metrics: "http://" + web + "/metrics"}, nil
}

func (b *bench) floorScenario(ctx context.Context, rep *scenarioReport) error {
	c := b.cfg
	rep.Description = "besfloor (a BES server with the edge's gRPC options that acknowledges every event at once): " +
		"CPU per event under paced-1000's load and RSS per open stream as edge-memory measures it; the floor under the edge's figures"
	b.floorFig = &floorFigures{perStreamKiB: map[int]float64{}}
	run, err := b.floorPacedRun(ctx, pacedSpec{streams: c.pacedStreams, rate: c.pacedRate, warmup: c.warmup, window: c.duration, warmupPhase: c.warmupPhase})
	if err != nil {
		return err
	}
	rep.Runs = append(rep.Runs, run)
	b.printRun(run)
	f := run.CPU["floor"]
	b.floorFig.eventsPerCPUS = f.EventsPerCPUS
	fmt.Printf("  floor: %.0f events/CPU-s, %.2f context switches per event\n", f.EventsPerCPUS, f.CtxSwitchesPerEvent)
	for _, n := range c.memory.streams {
		run, err := b.memoryRun(ctx, n, scGRPCFloor)
		if err != nil {
			return err
		}
		rep.Runs = append(rep.Runs, run)
		b.printRun(run)
		m := run.Memory
		b.floorFig.perStreamKiB[n] = m.PerStreamKiB
		fmt.Printf("  floor RSS: baseline %d KiB, peak %d KiB, %d streams open at most: %.1f KiB per stream\n",
			m.BaselineRSSKiB, m.PeakRSSKiB, m.OpenStreamsMax, m.PerStreamKiB)
	}
	return nil
}

// floorPacedRun replays paced-1000's load into besfloor and measures its
// CPU over the window after the warm-up.
func (b *bench) floorPacedRun(ctx context.Context, sp pacedSpec) (runReport, error) {
	f, _, stop, err := b.freshFloor(ctx, scGRPCFloor)
	if err != nil {
		return runReport{}, err
	}
	defer stop()
	procs := map[string]*proc{"floor": f.p}
	var quiet float64
	if b.cfg.quietWait > 0 {
		quiet = waitQuiet(ctx, b.cfg.quietWait)
	}
	measureFrom := time.Now().Add(sp.warmup)
	type windowStart struct {
		snap snapshot
		err  error
	}
	wsC := make(chan windowStart, 1)
	go func() {
		select {
		case <-time.After(time.Until(measureFrom)):
		case <-ctx.Done():
			wsC <- windowStart{err: ctx.Err()}
			return
		}
		s, err := takeSnapshot(procs)
		wsC <- windowStart{snap: s, err: err}
	}()
	fmt.Printf("  %d streams at %.0f events/s into besfloor: %s warm-up, then %s measured\n", sp.streams, sp.rate, sp.warmup, sp.window)
	res, err := replay.Run(ctx, replay.Config{
		Target: f.bes, Scripts: b.scripts, Streams: sp.streams, Projects: projectsFor(sp.streams),
		Rate: sp.rate, Warmup: sp.warmup, WarmupPhase: sp.warmupPhase, WarmupEvents: sp.warmupEvents, Duration: sp.warmup + sp.window, Seed: 1,
	})
	if err != nil {
		return runReport{}, err
	}
	after, err := takeSnapshot(procs)
	if err != nil {
		return runReport{}, err
	}
	ws := <-wsC
	if ws.err != nil {
		return runReport{}, ws.err
	}
	run := fillRun(fmt.Sprintf("%d streams paced, floor", sp.streams), res, sp.streams, "none", b.cfg.natsSync)
	run.Mode = "paced"
	run.TargetEventsPerS = sp.rate
	run.CPU, run.Machine = cpuFigures(ws.snap, after, res.WindowEvents, nil)
	run.Machine.Load1Start = ws.snap.loadavg()
	run.Machine.OtherCoresBefore = quiet
	return run, nil
}

// floorNote names the floor in an edge check's note, when grpc-floor ran
// earlier in the same bench run.
func (b *bench) floorCPUNote() string {
	if b.floorFig == nil || b.floorFig.eventsPerCPUS == 0 {
		return ""
	}
	return fmt.Sprintf("grpc-floor in this run: %.0f events/CPU-s for gRPC alone at the same load", b.floorFig.eventsPerCPUS)
}

func (b *bench) floorMemoryNote(n int) string {
	if b.floorFig == nil {
		return ""
	}
	kib, ok := b.floorFig.perStreamKiB[n]
	if !ok {
		return ""
	}
	return fmt.Sprintf("grpc-floor in this run: %.1f KiB per stream for gRPC alone", kib)
}
