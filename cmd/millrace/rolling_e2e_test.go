package main

import (
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/loadtest/balancer"
	"github.com/millrace/millrace/loadtest/besrecord"
	"github.com/millrace/millrace/loadtest/fleetsim"
	"github.com/millrace/millrace/loadtest/replay"
)

// besEdgeProcess prepares `millrace serve bes` (bin: empty for this
// tree's binary) on addr, on dev's backbone, with a shutdown that cuts open
// streams after 2 s (the default waits 20 s for builds that may run for an
// hour; either way their clients resume).
func besEdgeProcess(t *testing.T, dev *devProcess, addr, bin string) *devProcess {
	t.Helper()
	e := &devProcess{t: t, bin: bin, args: []string{"serve", "bes"}, besAddr: addr}
	e.env = append(os.Environ(),
		"MILLRACE_NATS_URL="+dev.natsURL,
		"MILLRACE_NATS_NKEY="+dev.natsNKey,
		"MILLRACE_BES_LISTEN="+addr,
		"MILLRACE_HTTP_LISTEN=127.0.0.1:0",
		"MILLRACE_SHUTDOWN_TIMEOUT=2s",
	)
	t.Cleanup(e.kill)
	return e
}

// besEdge starts this tree's `millrace serve bes` on addr (besEdgeProcess).
func besEdge(t *testing.T, dev *devProcess, addr string) *devProcess {
	t.Helper()
	e := besEdgeProcess(t, dev, addr, "")
	e.start()
	return e
}

// pacedBuilds runs the load generator in the background against target:
// builds of the 10-target fixture over streams streams at 25 events/s
// each (a build takes a few seconds, so that a restart finds builds under
// way), filed under project; wait returns its result.
func pacedBuilds(t *testing.T, target, project string, builds, streams int, seed uint64) (wait func() *replay.Result) {
	t.Helper()
	recs, err := besrecord.Read(filepath.Join("..", "..", "loadtest", "fixtures", "bazel-build-10.besrec"))
	if err != nil {
		t.Fatal(err)
	}
	scripts, _ := replay.Scripts(recs)
	type outcome struct {
		res *replay.Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := replay.Run(context.Background(), replay.Config{Target: target, Scripts: scripts[:1], Streams: streams,
			Projects: []string{project}, Rate: float64(25 * streams), Events: int64(builds * scripts[0].Events()), Seed: seed})
		done <- outcome{res, err}
	}()
	return func() *replay.Result {
		t.Helper()
		o := <-done
		if o.err != nil {
			t.Fatal(o.err)
		}
		return o.res
	}
}

// checkBuildsProjected: every one of the load generator's builds
// completed, and the projection holds each tool event it had acknowledged
// once (the sum of event_count over project's invocations).
func checkBuildsProjected(t *testing.T, db, project string, builds int, res *replay.Result) {
	t.Helper()
	if len(res.Errors) > 0 || res.Failed > 0 || res.Invocations != int64(builds) {
		t.Fatalf("the load generator: %d of %d builds complete, %d failed, errors %v %v", res.Invocations, builds, res.Failed, res.Errors, res.ErrorSamples)
	}
	pool := testPool(t, db)
	var finished, events int64
	// Finished is not the end: a few events (the build's metrics, its
	// tool logs, the last progress) follow Bazel's BuildFinished, and
	// the projection may not have them yet when the last build finishes.
	ok := poll.True(func() bool {
		err := pool.QueryRow(context.Background(),
			"select count(*) filter (where status <> 'running'), coalesce(sum(event_count), 0) from invocations where project = $1", project).Scan(&finished, &events)
		return err == nil && finished == int64(builds) && events >= res.ToolEvents
	}, poll.Within(time.Minute))
	if !ok && finished != int64(builds) {
		t.Fatalf("%d of the load generator's %d builds projected as finished within a minute", finished, builds)
	}
	if events != res.ToolEvents {
		t.Fatalf("the projection holds %d tool events of the load generator's builds; it had %d acknowledged", events, res.ToolEvents)
	}
}

// TestRollingRestartOfEdges: two BES edges behind a TCP balancer, real
// Bazel and paced builds from the load generator (which resumes as Bazel
// does) going through it; the edges are restarted one after the other
// (SIGTERM, then started again) while the builds run. Bazel finishes as it
// would have and its projection matches its JSON; every build of the load
// generator completes, and the events it had acknowledged are projected
// once each.
func TestRollingRestartOfEdges(t *testing.T) {
	needBazel(t)
	db := testenv.Database(t)
	dev := newDev(t, db)
	dev.start()
	addrA, addrB := freePort(t), freePort(t)
	edges := []*devProcess{besEdge(t, dev, addrA), besEdge(t, dev, addrB)}
	bal, err := balancer.Start("127.0.0.1:0", addrA, addrB)
	if err != nil {
		t.Fatal(err)
	}
	defer bal.Close()

	const builds, streams = 16, 8
	waitLoad := pacedBuilds(t, bal.Addr(), "load", builds, streams, 3)
	run := newBazelRun(t, 10, bal.Addr())
	wait := run.start(t)

	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	poll.Until(t, "the builds' first events projected", func() bool { return lastSeen(pool, run.project, run.invocationID) >= 1 },
		poll.Within(2*time.Minute), poll.Every(10*time.Millisecond))
	atRestart := lastSeen(pool, run.project, run.invocationID)
	for i, e := range edges {
		began := time.Now()
		e.stop()
		e.start()
		t.Logf("edge %d restarted in %s", i+1, time.Since(began).Round(time.Millisecond))
	}

	code, out := wait()
	run.checkExit(t, code, out, " through a rolling restart of the edges", edges[0].output()+edges[1].output())
	run.checkProjection(t, db)
	if final := lastSeen(pool, run.project, run.invocationID); final <= atRestart {
		t.Errorf("Bazel sent nothing after the first restart began (%d events before, %d in all)", atRestart, final)
	}
	res := waitLoad()
	checkBuildsProjected(t, db, "load", builds, res)
	if res.Resumed == 0 {
		t.Fatalf("no stream of the load generator was broken by the restarts (retried %v): the restart was not tested", res.Retried)
	}
	ack := res.Ack.Summary()
	t.Logf("load generator: %d builds, %d streams resumed, retried %v; ack p50 %.1f ms, p99 %.1f ms, max %.1f ms",
		res.Invocations, res.Resumed, res.Retried, ack.P50MS, ack.P99MS, ack.MaxMS)
	served, failed := bal.Served()
	t.Logf("balancer: connections %v, %d found no edge up", served, failed)
	dev.stop()
}

// TestRollingRestartOfGateways: nodes of the fleet simulator on two
// gateways with reservations being placed, bound and cancelled; the
// gateways are restarted one after the other (SIGTERM, then started
// again). Nodes re-home to the gateway that is up, no node is marked
// unreachable, and no node is told to bind a GPU it holds for another
// allocation (binds.conflicts).
func TestRollingRestartOfGateways(t *testing.T) {
	db := testenv.Database(t)
	const grace = 10 * time.Second
	dev := fleetDev(t, db, "MILLRACE_PLACER_UNBIND_RETRY=1s", "MILLRACE_FLEET_UNREACHABLE_AFTER="+grace.String())
	b, err := os.ReadFile(filepath.Join(dev.fleetDir, "api-keys"))
	if err != nil {
		t.Fatal(err)
	}
	_, key, _ := strings.Cut(strings.TrimSpace(string(b)), "=")
	addrA, addrB := freePort(t), freePort(t)
	gws := []*devProcess{gateway(t, dev, "gw-a", addrA), gateway(t, dev, "gw-b", addrB)}
	cfg := fleetsim.Config{
		Gateways: []string{addrA, addrB}, ServerName: "localhost",
		Nodes: 24, NodePrefix: "roll-", Pool: "roll", GPUsPerNode: 4,
		CACert: filepath.Join(dev.fleetDir, "ca", "ca.crt"), CAKey: filepath.Join(dev.fleetDir, "ca", "ca.key"),
		Duration: 20 * time.Second, Ramp: time.Second, Settle: 5 * time.Second,
		ReservationsAddr: dev.resvAddr, APIKey: key, ReservationRate: 15, ReservationHold: 2 * time.Second,
		DatabaseURL: db, UnreachableAfter: grace, ProgressEvery: -1, Seed: 11,
	}
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	restarted := make(chan struct{})
	go func() {
		defer close(restarted)
		for _, g := range gws {
			time.Sleep(4 * time.Second) // where in the load each restart falls; nothing waits on it
			g.stop()
			g.start()
		}
	}()
	rep, err := fleetsim.Run(context.Background(), cfg, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	<-restarted
	traceConflicts(t, db, rep.Binds.ConflictSamples)
	t.Logf("binds %d, conflicts %d, unbinds %d; re-homes %d (p50 %.0f ms, p99 %.0f ms); unreachable marks %d",
		rep.Binds.Received, rep.Binds.Conflicts, rep.Binds.Unbinds, rep.Rehome.Count, rep.Rehome.P50MS, rep.Rehome.P99MS, rep.Liveness.UnreachableMarks)
	switch {
	case rep.Binds.Received == 0:
		t.Fatal("no binds: the reservations were not placed")
	case rep.Rehome.Count == 0:
		t.Fatal("no node re-homed: the restarts were not felt")
	case rep.Binds.Conflicts != 0:
		t.Fatalf("%d Binds met a GPU held for another allocation", rep.Binds.Conflicts)
	case rep.Liveness.UnreachableMarks != 0:
		t.Fatalf("%d nodes were marked unreachable while the gateways restarted", rep.Liveness.UnreachableMarks)
	case rep.DoubleBookings != nil && rep.DoubleBookings.Total != 0:
		t.Fatalf("double bookings at the end: %+v", *rep.DoubleBookings)
	}
}
