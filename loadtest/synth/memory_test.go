package synth_test

import (
	"context"
	"net"
	"runtime"
	"runtime/debug"
	"runtime/metrics"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/loadtest/synth"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/services/bes"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// liveHeap samples the heap's objects (live, and garbage not yet swept)
// while a piece of work runs, with collections made frequent (GOGC 10) so
// that garbage is a small part; it returns the highest sample less the
// one before.
type liveHeap struct {
	stop chan struct{}
	done sync.WaitGroup
	base uint64
	peak uint64
}

func readLive() uint64 {
	s := []metrics.Sample{{Name: "/memory/classes/heap/objects:bytes"}}
	metrics.Read(s)
	return s[0].Value.Uint64()
}

func sampleHeap() *liveHeap {
	runtime.GC()
	h := &liveHeap{stop: make(chan struct{}), base: readLive()}
	h.done.Add(1)
	go func() {
		defer h.done.Done()
		t := time.NewTicker(2 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-h.stop:
				return
			case <-t.C:
				h.peak = max(h.peak, readLive())
			}
		}
	}()
	return h
}

func (h *liveHeap) end() uint64 {
	close(h.stop)
	h.done.Wait()
	return max(h.peak, h.base) - h.base
}

// peaks sends one invocation of n events through a BES edge into JetStream
// and then through the builds projector into PostgreSQL, and returns the
// live heap each added at its highest (the rest of the process, NATS and
// the sender included, running alike in both).
func peaks(t *testing.T, n int) (edge, projector uint64) {
	ctx, cancel := context.WithTimeout(context.Background(), 8*time.Minute)
	defer cancel()
	ns := testenv.NATS(t)
	nc, err := streams.Connect(ns.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(streams.DefaultMaxPending))
	if err != nil {
		t.Fatal(err)
	}
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := bes.New(bes.Config{}, streams.NewPublisher(js, nil), stream, bes.NewMetrics(nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(srv.ServerOptions()...)
	srv.Register(g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	conn, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	b := synth.Build{Events: n, OutputBytes: outputBytes}
	ids := synth.IDs{Project: "acme", BuildID: "build-1", InvocationID: "inv-1"}

	h := sampleHeap()
	err = synth.Send(ctx, buildpb.NewPublishBuildEventClient(conn), ids, b)
	edge = h.end()
	conn.Close()
	g.Stop()
	if err != nil {
		t.Fatal(err)
	}

	pool, _ := testenv.Pool(t)
	p, err := builds.New(builds.Config{})
	if err != nil {
		t.Fatal(err)
	}
	r, err := streams.NewRunner(js, pool, p, streams.RunnerConfig{Stream: subjects.StreamBES, Filter: subjects.BESFilter,
		Batch: 5000, MaxWait: 50 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	info, err := stream.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	last := info.State.LastSeq
	h = sampleHeap()
	rctx, stop := context.WithCancel(ctx)
	ran := make(chan struct{})
	go func() { r.Run(rctx); close(ran) }()
	poll.Until(t, "the projector to apply the stream", func() bool {
		var pos uint64
		pool.QueryRow(ctx, `select stream_seq from consumer_positions where consumer = $1`, builds.ConsumerName).Scan(&pos)
		return pos >= last
	}, poll.Within(6*time.Minute), poll.Every(20*time.Millisecond))
	projector = h.end()
	stop()
	<-ran

	got, err := builds.Show(ctx, pool, ids.Project, ids.InvocationID)
	if err != nil {
		t.Fatal(err)
	}
	if code, _ := b.ExitCode(); got.Status != "failed" || got.ExitCode == nil || *got.ExitCode != code ||
		len(got.Targets) != b.Targets() || len(got.Tests) != b.Tests() {
		t.Fatalf("%d events: projected %s, exit %v, %d targets, %d tests; want failed, %d, %d and %d", n,
			got.Status, got.ExitCode, len(got.Targets), len(got.Tests), code, b.Targets(), b.Tests())
	}
	size, err := builds.OutputSizes(ctx, pool, ids.Project, ids.InvocationID)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%d events (%d targets, %d MB of output): edge %.1f MB, projector %.1f MB of heap at most",
		n, b.Targets(), (size.StdoutBytes+size.StderrBytes)>>20, float64(edge)/(1<<20), float64(projector)/(1<<20))
	return edge, projector
}

// outputBytes per progress event: 100,000 events carry 38 MB of console
// output, which a projector that held a build's output whole would hold
// (and more, with its compressed copy).
const outputBytes = 2000

// TestOneBuildInBoundedMemory: neither the edge nor the projector holds a
// build whole. One invocation of 100,000 events costs each at most 16 MB
// more live heap than one of 10,000 events: what does not grow with the
// build (a batch of 5,000 events, NATS's cache of the stream's blocks,
// which this process holds too, the pages of the output fold). Holding the
// output alone would be 34 MB more.
func TestOneBuildInBoundedMemory(t *testing.T) {
	if testing.Short() {
		t.Skip("streams 110,000 events")
	}
	defer debug.SetGCPercent(debug.SetGCPercent(10))
	const slack = 16 << 20
	smallEdge, smallProj := peaks(t, 10_000)
	largeEdge, largeProj := peaks(t, 100_000)
	if largeEdge > smallEdge+slack {
		t.Errorf("edge: %.1f MB at 100,000 events, %.1f MB at 10,000: it grows with the build", float64(largeEdge)/(1<<20), float64(smallEdge)/(1<<20))
	}
	if largeProj > smallProj+slack {
		t.Errorf("projector: %.1f MB at 100,000 events, %.1f MB at 10,000: it grows with the build", float64(largeProj)/(1<<20), float64(smallProj)/(1<<20))
	}
}
