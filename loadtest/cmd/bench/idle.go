package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"time"
)

// The idle scenario: what `millrace dev` costs when nothing happens (its
// timers, polls, heartbeats and leases), and what it makes PostgreSQL do.
const scIdle = "idle"

// idleTargetCPUSPerS is the most CPU an idle dev may take per second.
const idleTargetCPUSPerS = 0.003

// natsInDev labels runs against `millrace dev`, whose JetStream is its own.
const natsInDev = "embedded in millrace dev"

// idleConfig sizes idle, and bazel-real's idle measurement (flags of the bench).
type idleConfig struct {
	settle, window time.Duration
}

func (c *idleConfig) register(fs *flag.FlagSet) {
	fs.DurationVar(&c.settle, "idle-settle", 15*time.Second, "idle, bazel-real: wait after `millrace dev` is ready before its idle CPU is measured (startup work done)")
	fs.DurationVar(&c.window, "idle-window", 60*time.Second, "idle: how long the idle dev's CPU is measured")
}

func (c *idleConfig) validate() error {
	errs := negatives(map[string]float64{"idle-settle": c.settle.Seconds(), "idle-window": c.window.Seconds()})
	if c.window == 0 {
		c.window = 60 * time.Second
	}
	return errors.Join(errs...)
}

// devStack starts `millrace dev` as the fleet scenarios do (fresh
// database, state in a temporary directory, every listener on a free
// loopback port), waits until it is ready and -idle-settle has passed.
// cleanup stops it and drops its state.
func (b *bench) devStack(ctx context.Context, scenario string) (s *fleetStack, db string, cleanup func(), err error) {
	return b.devStackEnv(ctx, scenario)
}

// devStackEnv is devStack with more environment for dev.
func (b *bench) devStackEnv(ctx context.Context, scenario string, env ...string) (s *fleetStack, db string, cleanup func(), err error) {
	dir, err := mkdir(b.tmp, scenario)
	if err != nil {
		return nil, "", nil, err
	}
	db, dbURL, err := b.pg.createDB(ctx, scenario)
	if err != nil {
		os.RemoveAll(dir)
		return nil, "", nil, err
	}
	cleanup = func() {
		if s != nil {
			s.stop()
		}
		if !b.cfg.keep {
			b.pg.dropDB(db)
			os.RemoveAll(dir)
		}
	}
	if s, err = b.startFleetStack(ctx, dir, dbURL, env...); err != nil {
		cleanup()
		return nil, "", nil, err
	}
	fmt.Printf("  millrace dev ready; settling for %s\n", b.cfg.idle.settle)
	select {
	case <-ctx.Done():
		cleanup()
		return nil, "", nil, ctx.Err()
	case <-time.After(b.cfg.idle.settle):
	}
	return s, db, cleanup, nil
}

func (b *bench) idleScenario(ctx context.Context, rep *scenarioReport) error {
	rep.Description = "`millrace dev` with nothing to do, after it is ready and -idle-settle: its CPU-s and context switches per second, and PostgreSQL's CPU-s per second"
	s, db, cleanup, err := b.devStack(ctx, scIdle)
	if err != nil {
		return err
	}
	defer cleanup()
	run, err := b.idleRun(ctx, s, db, b.cfg.idle.window)
	if err != nil {
		return err
	}
	rep.Runs = append(rep.Runs, run)
	printIdle(run)
	dev := run.CPU["dev"]
	rep.Checks = append(rep.Checks, atMost(scIdle+": millrace dev CPU-s per second", dev.Cores, idleTargetCPUSPerS, "CPU-s/s",
		fmt.Sprintf("%.0f context switches per second; PostgreSQL %s CPU-s per second (%s)", dev.CtxSwitchesPerS,
			num(pgIdleFigure(run).Cores), pgFigureName(run.Postgres))))
	return nil
}

// idleRun measures dev and PostgreSQL over window, with nothing sent.
func (b *bench) idleRun(ctx context.Context, s *fleetStack, db string, window time.Duration) (runReport, error) {
	procs := map[string]*proc{"dev": s.dev}
	meter, err := b.pg.meter(ctx, db)
	if err != nil {
		return runReport{}, err
	}
	defer meter.stop(context.Background()) // a no-op after the stop below
	before, err := takeSnapshot(procs)
	if err != nil {
		return runReport{}, err
	}
	fmt.Printf("  measuring the idle dev for %s\n", window)
	select {
	case <-ctx.Done():
		return runReport{}, ctx.Err()
	case <-time.After(window):
	}
	after, err := takeSnapshot(procs)
	if err != nil {
		return runReport{}, err
	}
	cost, err := meter.stop(ctx)
	if err != nil {
		return runReport{}, err
	}
	if s.dev.exited() {
		return runReport{}, fmt.Errorf("millrace dev exited while idle: %v", s.dev.exitErr())
	}
	wall := after.at.Sub(before.at)
	run := runReport{Name: fmt.Sprintf("idle %s", window.Round(time.Second)), Mode: "idle", NATS: natsInDev, NATSSync: b.cfg.natsSync,
		ElapsedS: round(wall.Seconds(), 2), WindowS: round(wall.Seconds(), 2)}
	run.CPU, run.Machine = cpuFigures(before, after, 0, &cost)
	run.Machine.Load1Start = before.loadavg()
	run.Postgres = b.pgReport(cost, 0)
	return run, nil
}

// pgIdleFigure is PostgreSQL's figure the checks read: all of its
// processes, or only what is attributed to the scenario's database when
// the server was shared (as projectorChecks reads it).
func pgIdleFigure(run runReport) cpuFigure {
	if run.Postgres != nil && run.Postgres.Shared {
		return run.CPU["postgres_attributed"]
	}
	return run.CPU["postgres_all"]
}

func pgFigureName(pg *pgReport) string {
	if pg != nil && pg.Shared {
		return "server shared: this database's backends and the background writers"
	}
	return "all postgres processes"
}

func printIdle(r runReport) { printIdleRow(os.Stdout, "", r) }
