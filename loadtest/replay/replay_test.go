package replay

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"sync"
	"testing"
	"time"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/millrace/millrace/loadtest/besrecord"
)

// recording makes a recording of builds that Bazel could have sent: each
// with lifecycle events and one stream of n events, the first build's stream
// retried once from event 3 (as Bazel does after an error).
func recording(builds, n int) []besrecord.Record {
	var recs []besrecord.Record
	life := func(build, inv string, seq int64, ev *buildpb.BuildEvent) besrecord.Record {
		c := buildpb.StreamId_CONTROLLER
		return besrecord.Record{Lifecycle: &buildpb.PublishLifecycleEventRequest{
			ServiceLevel: buildpb.PublishLifecycleEventRequest_INTERACTIVE,
			BuildEvent: &buildpb.OrderedBuildEvent{
				StreamId:       &buildpb.StreamId{BuildId: build, InvocationId: inv, Component: c},
				SequenceNumber: seq, Event: ev,
			},
			ProjectId: "recorded",
		}}
	}
	for b := range builds {
		build, inv := fmt.Sprintf("build-%d", b), fmt.Sprintf("inv-%d", b)
		recs = append(recs,
			life(build, "", 1, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BuildEnqueued_{BuildEnqueued: &buildpb.BuildEvent_BuildEnqueued{}}}),
			life(build, inv, 1, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_InvocationAttemptStarted_{InvocationAttemptStarted: &buildpb.BuildEvent_InvocationAttemptStarted{AttemptNumber: 1}}}))
		ev := func(seq int64) besrecord.Record {
			e := &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: &anypb.Any{
				TypeUrl: "type.googleapis.com/build_event_stream.BuildEvent", Value: []byte{0x0a, 0x02, 'h', byte(seq)},
			}}}
			if seq == int64(n) {
				e.Event = &buildpb.BuildEvent_ComponentStreamFinished{ComponentStreamFinished: &buildpb.BuildEvent_BuildComponentStreamFinished{
					Type: buildpb.BuildEvent_BuildComponentStreamFinished_FINISHED,
				}}
			}
			req := &buildpb.PublishBuildToolEventStreamRequest{
				OrderedBuildEvent: &buildpb.OrderedBuildEvent{
					StreamId:       &buildpb.StreamId{BuildId: build, InvocationId: inv, Component: buildpb.StreamId_TOOL},
					SequenceNumber: seq, Event: e,
				},
				ProjectId: "recorded",
			}
			if seq == 1 {
				req.NotificationKeywords = []string{"command_name=build"}
			}
			return besrecord.Record{Stream: req}
		}
		for seq := 1; seq <= n; seq++ {
			recs = append(recs, ev(int64(seq)))
			if b == 0 && seq == 5 {
				for again := 3; again <= 5; again++ {
					recs = append(recs, ev(int64(again)))
				}
			}
		}
		recs = append(recs,
			life(build, inv, 2, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_InvocationAttemptFinished_{InvocationAttemptFinished: &buildpb.BuildEvent_InvocationAttemptFinished{}}}),
			life(build, "", 2, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BuildFinished_{BuildFinished: &buildpb.BuildEvent_BuildFinished{}}}))
	}
	return recs
}

func TestScripts(t *testing.T) {
	recs := recording(2, 10)
	recs = append(recs, besrecord.Record{Stream: &buildpb.PublishBuildToolEventStreamRequest{OrderedBuildEvent: &buildpb.OrderedBuildEvent{
		StreamId: &buildpb.StreamId{BuildId: "cut", InvocationId: "cut"}, SequenceNumber: 1,
		Event: &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: &anypb.Any{TypeUrl: "x"}}},
	}}})
	scripts, skipped := Scripts(recs)
	if len(scripts) != 2 || len(skipped) != 1 {
		t.Fatalf("got %d scripts, %d skipped (%v); want 2 and 1", len(scripts), len(skipped), skipped)
	}
	for _, s := range scripts {
		if got := s.Events(); got != 14 {
			t.Errorf("build %s: %d events, want 14 (10 tool + 4 lifecycle; the retry undone)", s.BuildID, got)
		}
	}

	// The hand-made encoding is the recorded request with new ids.
	ts := scripts[0].Streams[0]
	ids, err := newStreamIDs("B", "I", "P", ts.component)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range ts.Requests {
		var got buildpb.PublishBuildToolEventStreamRequest
		if err := proto.Unmarshal(ts.request(i, ids), &got); err != nil {
			t.Fatal(err)
		}
		want = proto.CloneOf(want)
		want.OrderedBuildEvent.StreamId = &buildpb.StreamId{BuildId: "B", InvocationId: "I", Component: buildpb.StreamId_TOOL}
		want.ProjectId = "P"
		if !proto.Equal(&got, want) {
			t.Fatalf("request %d:\n got %v\nwant %v", i, &got, want)
		}
	}
}

// TestRun replays against the recorder (which acks every event at once) and
// checks that what arrived is the recording under fresh ids.
func TestRun(t *testing.T) {
	out := filepath.Join(t.TempDir(), "replayed.besrec")
	rec, err := besrecord.Start("127.0.0.1:0", out)
	if err != nil {
		t.Fatal(err)
	}
	scripts, _ := Scripts(recording(3, 20))
	var mu sync.Mutex
	done := map[string]bool{}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := Run(ctx, Config{
		Target: rec.Addr(), Scripts: scripts, Streams: 4, Conns: 2, Projects: []string{"p0", "p1"},
		Events: 24 * 10,
		OnStreamDone: func(d StreamDone) {
			mu.Lock()
			defer mu.Unlock()
			if d.LastSequence != 20 || d.LastAck.IsZero() {
				t.Errorf("done %+v", d)
			}
			done[d.InvocationID] = true
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}
	if len(res.Errors) != 0 || res.Failed != 0 {
		t.Fatalf("errors: %v %v", res.Errors, res.ErrorSamples)
	}
	if res.Invocations != 10 || len(done) != 10 || res.Events() != 240 || res.Ack.Count() != 200 {
		t.Fatalf("invocations %d (%d done), events %d, acks %d; want 10, 240, 200", res.Invocations, len(done), res.Events(), res.Ack.Count())
	}
	got, err := besrecord.Read(out)
	if err != nil {
		t.Fatal(err)
	}
	replayed, skipped := Scripts(got)
	if len(replayed) != 10 || len(skipped) != 0 {
		t.Fatalf("the server saw %d complete builds (%v skipped), want 10", len(replayed), skipped)
	}
	for _, s := range replayed {
		inv := s.Streams[0].InvocationID
		if !done[inv] {
			t.Errorf("the stream of invocation %s was not reported done", inv)
		}
		if len(inv) != 36 || s.BuildID == "build-0" {
			t.Errorf("ids were not replaced: build %s invocation %s", s.BuildID, inv)
		}
		if p := s.Streams[0].Requests[0].GetProjectId(); p != "p0" && p != "p1" {
			t.Errorf("project %q", p)
		}
		if s.Before[1].GetBuildEvent().GetStreamId().GetInvocationId() != inv {
			t.Errorf("lifecycle invocation id not rewritten")
		}
	}
}

// TestRunPaced stops a paced run mid-invocation: streams half-close early
// and every event sent is acknowledged, without errors.
func TestRunPaced(t *testing.T) {
	rec, err := besrecord.Start("127.0.0.1:0", filepath.Join(t.TempDir(), "paced.besrec"))
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Close()
	scripts, _ := Scripts(recording(2, 200))
	res, err := Run(context.Background(), Config{
		Target: rec.Addr(), Scripts: scripts, Streams: 5, Rate: 500, Warmup: 200 * time.Millisecond, Duration: 700 * time.Millisecond,
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Errors) != 0 || res.Truncated != 5 {
		t.Fatalf("errors %v, truncated %d (want 5)", res.ErrorSamples, res.Truncated)
	}
	if res.ToolEvents != res.ToolEventsSent || res.Ack.Count() == 0 || res.WarmupAck.Count() == 0 {
		t.Fatalf("acked %d of %d sent; %d acks measured, %d in warm-up", res.ToolEvents, res.ToolEventsSent, res.Ack.Count(), res.WarmupAck.Count())
	}
	// 500 events/s for 0.5 s after the warm-up: allow for jitter and timers.
	if rate := float64(res.WindowEvents) / res.Window.Seconds(); rate < 300 || rate > 700 {
		t.Errorf("paced at %.0f events/s, want about 500", rate)
	}
}

func TestHistogram(t *testing.T) {
	var h Histogram
	for i := 1; i <= 1000; i++ {
		h.Record(time.Duration(i) * time.Millisecond)
	}
	for _, c := range []struct {
		q    float64
		want time.Duration
	}{{0.5, 500 * time.Millisecond}, {0.99, 990 * time.Millisecond}, {1, time.Second}} {
		got := h.Quantile(c.q)
		if got < c.want || float64(got) > float64(c.want)*1.02 {
			t.Errorf("q%.2f = %v, want %v (+2%%)", c.q, got, c.want)
		}
	}
	for v := uint64(0); v < 1<<20; v += 7 {
		i := bucket(v)
		if v > bucketHigh(i) || (i > 0 && v <= bucketHigh(i-1)) {
			t.Fatalf("value %d in bucket %d [%d, %d]", v, i, bucketHigh(i-1)+1, bucketHigh(i))
		}
	}
}

// breakingServer acknowledges events as a BES server does but ends the
// first stream of every invocation with UNAVAILABLE after three acks, and
// the first lifecycle call with UNAVAILABLE too; a later stream of an
// invocation that does not start at its first unacknowledged event, or an
// event out of order, is refused with FAILED_PRECONDITION.
type breakingServer struct {
	buildpb.UnimplementedPublishBuildEventServer
	mu         sync.Mutex
	lifecycles int
	acked      map[string]int64 // invocation -> last acknowledged sequence
	resumedAt  []int64          // first sequence of each resumed stream
	refuse     codes.Code       // when set, every first stream ends with it instead
}

func (s *breakingServer) PublishLifecycleEvent(context.Context, *buildpb.PublishLifecycleEventRequest) (*emptypb.Empty, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.lifecycles++; s.lifecycles == 1 {
		return nil, status.Error(codes.Unavailable, "first lifecycle call refused")
	}
	return &emptypb.Empty{}, nil
}

func (s *breakingServer) PublishBuildToolEventStream(st buildpb.PublishBuildEvent_PublishBuildToolEventStreamServer) error {
	first, resumed := true, false
	acks := 0
	for {
		req, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		obe := req.GetOrderedBuildEvent()
		inv, seq := obe.GetStreamId().GetInvocationId(), obe.GetSequenceNumber()
		s.mu.Lock()
		last, known := s.acked[inv]
		if first && known {
			s.resumedAt = append(s.resumedAt, seq)
			resumed = true
		}
		s.mu.Unlock()
		if seq != last+1 {
			return status.Errorf(codes.FailedPrecondition, "invocation %s: sequence %d after %d", inv, seq, last)
		}
		if !resumed && acks == 3 {
			if s.refuse != codes.OK {
				return status.Error(s.refuse, "refused")
			}
			return status.Error(codes.Unavailable, "stream broken")
		}
		first = false
		if err := st.Send(&buildpb.PublishBuildToolEventStreamResponse{StreamId: obe.GetStreamId(), SequenceNumber: seq}); err != nil {
			return err
		}
		acks++
		s.mu.Lock()
		s.acked[inv] = seq
		s.mu.Unlock()
	}
}

func serveBreaking(t *testing.T, s *breakingServer) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	buildpb.RegisterPublishBuildEventServer(g, s)
	go g.Serve(l)
	t.Cleanup(g.Stop)
	return l.Addr().String()
}

// TestRunResumes: a broken stream is resumed, as Bazel resumes it, on a new
// stream from its first unacknowledged event after a backoff, and a
// refused lifecycle call is tried again; the invocations complete and only
// the retries count what happened. A refusal Bazel does not retry
// (FAILED_PRECONDITION) fails the invocation.
func TestRunResumes(t *testing.T) {
	s := &breakingServer{acked: map[string]int64{}}
	scripts, _ := Scripts(recording(2, 10))
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	res, err := Run(ctx, Config{Target: serveBreaking(t, s), Scripts: scripts, Streams: 2, Events: 24 * 2, Backoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Errors) != 0 || res.Failed != 0 || res.Invocations != 4 {
		t.Fatalf("invocations %d, failed %d, errors %v %v; want 4 complete", res.Invocations, res.Failed, res.Errors, res.ErrorSamples)
	}
	if res.Resumed != 4 || res.Retried["stream Unavailable"] != 4 || res.Retried["lifecycle Unavailable"] != 1 {
		t.Fatalf("resumed %d, retried %v; want 4 streams resumed and one lifecycle call retried", res.Resumed, res.Retried)
	}
	if res.ToolEvents != 40 || res.ToolEventsSent != 40 {
		t.Fatalf("%d tool events acknowledged of %d sent, want 40 each (resends are not new events)", res.ToolEvents, res.ToolEventsSent)
	}
	s.mu.Lock()
	for _, seq := range s.resumedAt {
		if seq != 4 {
			t.Errorf("a stream resumed at sequence %d, want 4 (after the 3 acknowledged)", seq)
		}
	}
	s.mu.Unlock()

	refusing := &breakingServer{acked: map[string]int64{}, refuse: codes.FailedPrecondition, lifecycles: 1}
	res, err = Run(ctx, Config{Target: serveBreaking(t, refusing), Scripts: scripts, Events: 1, Backoff: 10 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if res.Failed != 1 || res.Resumed != 0 || res.Errors["stream FailedPrecondition"] != 1 {
		t.Fatalf("a FAILED_PRECONDITION stream: failed %d, resumed %d, errors %v; want it failed, not retried", res.Failed, res.Resumed, res.Errors)
	}
}

// TestRunSeries: with SeriesStep the acks are also kept by when their
// events were sent, every ack in one step or another.
func TestRunSeries(t *testing.T) {
	rec, err := besrecord.Start("127.0.0.1:0", filepath.Join(t.TempDir(), "series.besrec"))
	if err != nil {
		t.Fatal(err)
	}
	defer rec.Close()
	scripts, _ := Scripts(recording(2, 40))
	res, err := Run(context.Background(), Config{Target: rec.Addr(), Scripts: scripts, Streams: 2, Rate: 200, Events: 4 * 44,
		SeriesStep: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.AckSeries) < 3 {
		t.Fatalf("%d steps of 100 ms in a run of %s", len(res.AckSeries), res.Elapsed)
	}
	all := Between(res.AckSeries, 100*time.Millisecond, 0, res.Elapsed)
	if all.Count() != uint64(res.ToolEvents) {
		t.Fatalf("the series holds %d acks, the run %d", all.Count(), res.ToolEvents)
	}
	if first := Between(res.AckSeries, 100*time.Millisecond, 0, 50*time.Millisecond); first.Count() != res.AckSeries[0].Count() {
		t.Fatalf("the first 50 ms: %d acks, want the first step's %d", first.Count(), res.AckSeries[0].Count())
	}
}
