package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/bep"
	commitspb "github.com/millrace/millrace/schemas/commits"
	"github.com/millrace/millrace/subjects"
)

// TestNATSNodeLoss: millrace on a three-node cluster of nats-server
// processes at NATS's stock settings, with R3 streams. dev starts although
// the servers' max_payload (1 MiB) is below its event limit, and says so.
// While real Bazel builds through it, two commit-log writers increment a
// document with compare-and-set and 50 GPU nodes report, the nodes leading
// the BES, COMMITS and FLEET_NODES streams are killed one after the other
// (SIGKILL) and, once another node leads, started again. Bazel finishes as
// it would have and the projection matches its JSON with nothing counted
// twice; commit-log writes went on while a node was down and the counter
// holds every acknowledged increment once; no node was marked unreachable.
func TestNATSNodeLoss(t *testing.T) {
	needBazel(t)
	cl := testenv.NATSProcesses(t, 3)
	db := testenv.Database(t)
	// The fleet's timings as TestFleetGatewayKilled's: heartbeats every
	// second, a node unreachable after 20 s of silence.
	const grace = 20 * time.Second
	dev := fleetDev(t, db, "MILLRACE_NATS_URL="+cl.URL(), "MILLRACE_NATS_REPLICAS=3",
		"MILLRACE_FLEET_SUSPECT_AFTER=8s", "MILLRACE_FLEET_UNREACHABLE_AFTER="+grace.String())
	if out := dev.output(); !strings.Contains(out, "BES event limit lowered") || !strings.Contains(out, "max_payload (1048576 bytes)") {
		t.Errorf("dev on a stock cluster did not warn that the event limit follows max_payload:\n%s", out)
	}

	writers, stopWriters := startCounterWriters(t, t.Context(), dev.commitsAddr, devCommitsKey(t, dev), 2)
	defer stopWriters()
	fleetPool := testPool(t, db)
	const nodes = 50
	startNodes(t, dev, nodes, dev.fleetAddr)
	waitUntil(t, "the nodes healthy in the projection", func() bool {
		return count(t, fleetPool, "select count(*) from fleet_nodes where state = 'healthy' and connected") == nodes
	})
	unreachable := watchUnreachable(fleetPool)

	run := newBazelRun(t, 10, dev.besAddr)
	wait := run.start(t)
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	poll.Until(t, "the build's first events projected", func() bool { return lastSeen(pool, run.project, run.invocationID) >= 1 },
		poll.Within(2*time.Minute), poll.Every(10*time.Millisecond))
	atKill := lastSeen(pool, run.project, run.invocationID)
	killLeader(t, cl, subjects.StreamBES, nil)
	t.Logf("with %d events projected", atKill)

	// Then the node leading the commit log: writes go on while it is
	// down, compare-and-set intact.
	killLeader(t, cl, subjects.StreamCommits, func() {
		from := time.Now()
		poll.Until(t, "commit log writes while a node is down", func() bool { return writers.ackedBetween(from, time.Now()) >= 3 },
			poll.Within(time.Minute), poll.Every(20*time.Millisecond))
	})

	// And the node leading the fleet's node reports: heartbeats wait for
	// the backbone; no node may be taken for unreachable.
	killLeader(t, cl, subjects.StreamFleetNodes, nil)
	lastKill := time.Now()

	code, out := wait()
	run.checkExit(t, code, out, " through the loss of a NATS node", dev.output())
	run.checkProjection(t, db)
	if final := lastSeen(pool, run.project, run.invocationID); final <= atKill {
		t.Fatalf("the build sent nothing after the node was killed (%d events at the kill, %d in all): the loss was not tested", atKill, final)
	}
	stopWriters()
	writers.check(t)
	// Let the projection's clock pass the grace since the last kill, so
	// that a false mark would have had time to happen.
	waitUntil(t, "the liveness clock past the grace since the last kill", func() bool {
		var clock time.Time
		fleetPool.QueryRow(context.Background(), "select liveness_time from fleet_clock").Scan(&clock)
		return clock.After(lastKill.Add(grace + 2*time.Second))
	})
	if worst := unreachable(); worst > 0 {
		t.Fatalf("%d nodes were marked unreachable while the backbone lost a node", worst)
	}
	if h := count(t, fleetPool, "select count(*) from fleet_nodes where state = 'healthy' and connected"); h != nodes {
		t.Fatalf("%d of %d nodes healthy after the node loss", h, nodes)
	}
	dev.stop()
}

// watchUnreachable watches the projection for nodes marked unreachable;
// the function it returns stops watching and says the most seen at once.
func watchUnreachable(pool *pgxpool.Pool) func() int {
	var (
		worst int
		stop  = make(chan struct{})
		wg    sync.WaitGroup
	)
	wg.Go(func() {
		for {
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			var u int
			if err := pool.QueryRow(context.Background(), "select count(*) from fleet_nodes where state = 'unreachable'").Scan(&u); err == nil {
				worst = max(worst, u)
			}
		}
	})
	return func() int { close(stop); wg.Wait(); return worst }
}

// killLeader kills the node leading stream, waits until another leads
// it, runs down (nil: nothing) while the node is away, and starts it again.
func killLeader(t *testing.T, cl *testenv.ProcessCluster, stream string, down func()) {
	t.Helper()
	ctx := t.Context()
	leader, err := cl.Leader(ctx, stream)
	if err != nil || leader < 0 {
		t.Fatalf("the %s stream's leader: %d, %v", stream, leader, err)
	}
	cl.Kill(leader)
	t.Logf("killed %s, the %s stream's leader", cl.Name(leader), stream)
	poll.Until(t, "another node to lead the "+stream+" stream", func() bool {
		i, err := cl.Leader(ctx, stream)
		return err == nil && i >= 0 && i != leader
	}, poll.Within(time.Minute), poll.Every(100*time.Millisecond))
	if down != nil {
		down()
	}
	cl.Start(leader)
}

// counterWriters increment one document of the commit log with
// compare-and-set, each increment resent with its request id until it has
// a definite answer, as a careful client does through an outage. A write
// whose answer was lost and that a re-read finds stored is its writer's.
type counterWriters struct {
	client commitspb.CommitsClient
	ctx    context.Context
	mu     sync.Mutex
	done   int // increments acknowledged
	times  []time.Time
	errs   []string // what a resend was answered with
}

func startCounterWriters(t *testing.T, ctx context.Context, addr, key string, n int) (*counterWriters, func()) {
	conn, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	w := &counterWriters{client: commitspb.NewCommitsClient(conn),
		ctx: metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+key)}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() { w.run(i, stop) })
	}
	t.Cleanup(func() { conn.Close() })
	var once sync.Once
	return w, func() { once.Do(func() { close(stop); wg.Wait() }) }
}

type counter struct {
	N  int    `json:"n"`
	By string `json:"by"`
}

func (w *counterWriters) run(id int, stop chan struct{}) {
	for attempt := 0; ; attempt++ {
		// Paced, so that the writers leave Bazel and the servers the CPU.
		select {
		case <-stop:
			return
		case <-time.After(10 * time.Millisecond):
		}
		var cur counter
		var version uint64
		d, err := w.client.Get(w.ctx, &commitspb.GetRequest{World: "cluster", Id: "counter"})
		switch {
		case status.Code(err) == codes.NotFound:
		case err != nil:
			w.failed(err)
			time.Sleep(50 * time.Millisecond)
			continue
		default:
			if err := json.Unmarshal(d.Body, &cur); err != nil {
				w.failed(err)
				return
			}
			version = d.Version
		}
		rid := fmt.Sprintf("w%d-%d", id, attempt)
		body, _ := json.Marshal(counter{N: cur.N + 1, By: rid})
		for {
			_, err := w.client.Put(w.ctx, &commitspb.PutRequest{World: "cluster", Id: "counter", Body: body, ExpectedVersion: &version, RequestId: rid})
			if err == nil {
				w.acked()
				break
			}
			if status.Code(err) == codes.FailedPrecondition {
				// Another writer's came first, or this one's did and its
				// answer was lost: the next read tells (by).
				if d, err := w.client.Get(w.ctx, &commitspb.GetRequest{World: "cluster", Id: "counter"}); err == nil {
					var now counter
					if json.Unmarshal(d.Body, &now) == nil && now.By == rid {
						w.acked()
					}
				}
				break
			}
			w.failed(err)
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
}

func (w *counterWriters) acked() {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.done++
	w.times = append(w.times, time.Now())
}

func (w *counterWriters) failed(err error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.errs = append(w.errs, status.Code(err).String())
}

// ackedBetween counts the increments acknowledged from a to b.
func (w *counterWriters) ackedBetween(a, b time.Time) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, t := range w.times {
		if !t.Before(a) && !t.After(b) {
			n++
		}
	}
	return n
}

// check: the document counts every acknowledged increment once.
func (w *counterWriters) check(t *testing.T) {
	t.Helper()
	d, err := w.client.Get(w.ctx, &commitspb.GetRequest{World: "cluster", Id: "counter"})
	if err != nil {
		t.Fatal(err)
	}
	var c counter
	if err := json.Unmarshal(d.Body, &c); err != nil {
		t.Fatal(err)
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if c.N != w.done {
		t.Fatalf("the counter reads %d after %d acknowledged increments (compare-and-set lost or doubled a write); resends were answered %v", c.N, w.done, w.errs)
	}
	t.Logf("commit log: %d increments, version %d; resends answered %v", c.N, d.Version, w.errs)
}

// TestNATSQuorumLoss: an edge on a three-node cluster that loses two nodes
// (the stream's leader kept, so that it takes events and can acknowledge
// none) answers a build's stream and a lifecycle event with UNAVAILABLE,
// which Bazel retries, within its publish timeout instead of holding them;
// without any node its /readyz says not ready; with the nodes back it is
// ready and stores again.
func TestNATSQuorumLoss(t *testing.T) {
	cl := testenv.NATSProcesses(t, 3)
	edge := &devProcess{t: t, args: []string{"serve", "bes"}, besAddr: freePort(t)}
	web := freePort(t)
	edge.env = append(os.Environ(), "MILLRACE_NATS_URL="+cl.URL(), "MILLRACE_NATS_REPLICAS=3",
		"MILLRACE_BES_LISTEN="+edge.besAddr, "MILLRACE_HTTP_LISTEN="+web, "MILLRACE_NATS_PUBLISH_TIMEOUT=3s")
	t.Cleanup(edge.kill)
	edge.start()
	ready := func() int {
		res, err := http.Get("http://" + web + "/readyz")
		if err != nil {
			return 0
		}
		res.Body.Close()
		return res.StatusCode
	}
	poll.Until(t, "the edge ready", func() bool { return ready() == http.StatusOK }, poll.Within(30*time.Second))
	conn, err := grpc.NewClient(edge.besAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := buildpb.NewPublishBuildEventClient(conn)
	if err := publishOne(t, client, "before"); err != nil {
		t.Fatalf("a stream on the whole cluster: %v", err)
	}

	leader, err := cl.Leader(t.Context(), subjects.StreamBES)
	if err != nil || leader < 0 {
		t.Fatalf("the BES stream's leader: %d, %v", leader, err)
	}
	cl.Kill((leader + 1) % 3)
	cl.Kill((leader + 2) % 3)
	begin := time.Now()
	err = publishOne(t, client, "no-quorum")
	if took := time.Since(begin); status.Code(err) != codes.Unavailable {
		t.Fatalf("a stream without quorum: %v after %s, want UNAVAILABLE", err, took)
	} else {
		t.Logf("without quorum the stream ended after %s: %v", took.Round(time.Millisecond), err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	_, err = client.PublishLifecycleEvent(ctx, &buildpb.PublishLifecycleEventRequest{ProjectId: "e2e", BuildEvent: &buildpb.OrderedBuildEvent{
		StreamId: &buildpb.StreamId{BuildId: "no-quorum", Component: buildpb.StreamId_CONTROLLER}, SequenceNumber: 1,
		Event: &buildpb.BuildEvent{EventTime: timestamppb.Now(), Event: &buildpb.BuildEvent_BuildEnqueued_{BuildEnqueued: &buildpb.BuildEvent_BuildEnqueued{}}}}})
	if status.Code(err) != codes.Unavailable {
		t.Fatalf("a lifecycle event without quorum: %v, want UNAVAILABLE", err)
	}

	cl.Kill(leader)
	poll.Until(t, "the edge not ready without a NATS server", func() bool { return ready() == http.StatusServiceUnavailable },
		poll.Within(30*time.Second))
	cl.Start(0, 1, 2)
	poll.Until(t, "the edge ready again", func() bool { return ready() == http.StatusOK }, poll.Within(60*time.Second))
	poll.Until(t, "a stream stored again", func() bool { return publishOne(t, client, "after") == nil }, poll.Within(60*time.Second))
}

// publishOne sends a build's stream of one event and its end, as Bazel
// would, and returns how the edge ended it (nil: every event acknowledged);
// a stream the edge holds for more than 20 s fails the test.
func publishOne(t *testing.T, client buildpb.PublishBuildEventClient, invocation string) error {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 20*time.Second)
	defer cancel()
	st, err := client.PublishBuildToolEventStream(ctx)
	if err != nil {
		return err
	}
	id := &buildpb.StreamId{BuildId: "b-" + invocation, InvocationId: invocation, Component: buildpb.StreamId_TOOL}
	ev, err := proto.Marshal(&bep.BuildEvent{
		Id:      &bep.BuildEventId{Id: &bep.BuildEventId_Progress{Progress: &bep.BuildEventId_ProgressId{}}},
		Payload: &bep.BuildEvent_Progress{Progress: &bep.Progress{Stdout: "hello"}}})
	if err != nil {
		t.Fatal(err)
	}
	for seq, e := range []*buildpb.BuildEvent{
		{EventTime: timestamppb.Now(), Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: &anypb.Any{TypeUrl: bep.TypeURL, Value: ev}}},
		{EventTime: timestamppb.Now(), Event: &buildpb.BuildEvent_ComponentStreamFinished{ComponentStreamFinished: &buildpb.BuildEvent_BuildComponentStreamFinished{
			Type: buildpb.BuildEvent_BuildComponentStreamFinished_FINISHED}}},
	} {
		if err := st.Send(&buildpb.PublishBuildToolEventStreamRequest{ProjectId: "e2e",
			OrderedBuildEvent: &buildpb.OrderedBuildEvent{StreamId: id, SequenceNumber: int64(seq + 1), Event: e}}); err != nil {
			break // the edge ended the stream; Recv says how
		}
	}
	st.CloseSend()
	for acked := 0; ; acked++ {
		if _, err := st.Recv(); err != nil {
			if status.Code(err) == codes.DeadlineExceeded {
				t.Fatalf("the edge held stream %s for 20 s without an answer", invocation)
			}
			if errors.Is(err, io.EOF) {
				if acked != 2 {
					return fmt.Errorf("stream %s ended after %d of 2 acks", invocation, acked)
				}
				return nil
			}
			return err
		}
	}
}
