package bes

import (
	"bytes"
	"strings"
	"testing"
	"time"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/millrace/millrace/schemas/bep"
	"github.com/millrace/millrace/services/bes/redact"
	"github.com/millrace/millrace/subjects"
)

// commandLineEvent is an unstructured_command_line event carrying secrets
// as Bazel would.
func commandLineEvent(t testing.TB, args ...string) *buildpb.BuildEvent {
	b, err := proto.Marshal(&bep.BuildEvent{
		Id:      &bep.BuildEventId{Id: &bep.BuildEventId_UnstructuredCommandLine{UnstructuredCommandLine: &bep.BuildEventId_UnstructuredCommandLineId{}}},
		Payload: &bep.BuildEvent_UnstructuredCommandLine{UnstructuredCommandLine: &bep.UnstructuredCommandLine{Args: args}},
	})
	if err != nil {
		t.Fatal(err)
	}
	return &buildpb.BuildEvent{EventTime: eventTime, Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: &anypb.Any{TypeUrl: bep.TypeURL, Value: b}}}
}

var secretArgs = []string{"build", "--remote_header=Authorization=Bearer SECRET1", "--action_env=TOKEN=SECRET2",
	"--build_metadata=URL=https://u:SECRET4@host", "--client_env=GH=ghp_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78", "//..."}

// TestEdgeRedactsBeforeStoring: what JetStream holds has the flags and not
// their secrets, and is still a valid event.
func TestEdgeRedactsBeforeStoring(t *testing.T) {
	for _, off := range []bool{false, true} {
		b, e := newTest(t, Config{NoRedaction: off})
		id := defaultIDs()
		reqs := []*buildpb.PublishBuildToolEventStreamRequest{toolReq(id, 1), toolReqWith(id, 2, commandLineEvent(t, secretArgs...)), finishReq(id, 3)}
		if r := publish(testCtx(t), t, e.client, reqs); r.err != nil {
			t.Fatalf("stream ended with %v", r.err)
		}
		msgs := b.stored(t, subjects.BES(testProject, id.invocation))
		if len(msgs) != 3 {
			t.Fatalf("stored %d messages, want 3", len(msgs))
		}
		data := msgs[1].Data
		secrets := []string{"SECRET1", "SECRET2", "SECRET4", "ghp_Ab12"}
		if off {
			for _, s := range secrets {
				if !bytes.Contains(data, []byte(s)) {
					t.Fatalf("NoRedaction: %q is not stored as sent", s)
				}
			}
			continue
		}
		for _, s := range secrets {
			if bytes.Contains(data, []byte(s)) {
				t.Errorf("the stored event holds %q", s)
			}
		}
		var obe buildpb.OrderedBuildEvent
		if err := proto.Unmarshal(data, &obe); err != nil {
			t.Fatal(err)
		}
		var ev bep.BuildEvent
		if err := obe.GetEvent().GetBazelEvent().UnmarshalTo(&ev); err != nil {
			t.Fatalf("stored bazel_event: %v", err)
		}
		want := []string{"build", "--remote_header=Authorization=" + redact.Marker, "--action_env=TOKEN=" + redact.Marker,
			"--build_metadata=URL=" + redact.Marker, "--client_env=GH=" + redact.Marker, "//..."}
		if got := ev.GetUnstructuredCommandLine().GetArgs(); strings.Join(got, " ") != strings.Join(want, " ") {
			t.Errorf("stored args %q, want %q", got, want)
		}
		// An event with nothing to hide is stored byte for byte.
		if !proto.Equal(mustDecode(t, msgs[0].Data), reqs[0].GetOrderedBuildEvent()) {
			t.Error("a clean event was changed")
		}
	}
}

func mustDecode(t *testing.T, b []byte) *buildpb.OrderedBuildEvent {
	var obe buildpb.OrderedBuildEvent
	if err := proto.Unmarshal(b, &obe); err != nil {
		t.Fatal(err)
	}
	return &obe
}

// BenchmarkEdgeEvent is the edge's own work per event of the recorded real
// builds (check, redact, encode; not gRPC nor JetStream), with redaction on
// and off:
//
//	go test -run '^$' -bench EdgeEvent -benchmem ./services/bes/
func BenchmarkEdgeEvent(b *testing.B) {
	var reqs []*buildpb.PublishBuildToolEventStreamRequest
	for _, rec := range recordedSeeds(b) {
		if rec.Stream != nil && rec.Stream.GetOrderedBuildEvent().GetEvent().GetBazelEvent() != nil {
			reqs = append(reqs, rec.Stream)
		}
	}
	if len(reqs) == 0 {
		b.Skip("no recordings in loadtest/fixtures")
	}
	for _, off := range []bool{true, false} {
		name := "redaction=on"
		if off {
			name = "redaction=off"
		}
		b.Run(name, func(b *testing.B) {
			s := newServer(b, Config{NoRedaction: off})
			// The edge redacts in place: give each iteration the bytes as
			// received again.
			orig := make([][]byte, len(reqs))
			for j, r := range reqs {
				orig[j] = r.GetOrderedBuildEvent().GetEvent().GetBazelEvent().GetValue()
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				k := i % len(reqs)
				req := reqs[k]
				req.GetOrderedBuildEvent().GetEvent().GetBazelEvent().Value = orig[k]
				ts := &toolStream{s: s, project: "p", streamID: req.GetOrderedBuildEvent().GetStreamId(), projectID: req.GetProjectId(), next: req.GetOrderedBuildEvent().GetSequenceNumber()}
				if err := ts.check(req); err != nil {
					b.Fatal(err)
				}
				if _, err := s.message("p", "tool", req.GetOrderedBuildEvent(), "id", "bes.p.i"); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkEdgeEventAB interleaves blocks of the recorded events through an
// edge with redaction off and one with it on, and reports the fastest
// block of each (ns per event) and the overhead: on a shared machine the
// minimum of many short blocks is what the work itself costs.
//
//	go test -run '^$' -bench EdgeEventAB ./services/bes/
func BenchmarkEdgeEventAB(b *testing.B) {
	var reqs []*buildpb.PublishBuildToolEventStreamRequest
	for _, rec := range recordedSeeds(b) {
		if rec.Stream != nil && rec.Stream.GetOrderedBuildEvent().GetEvent().GetBazelEvent() != nil {
			reqs = append(reqs, rec.Stream)
		}
	}
	if len(reqs) == 0 {
		b.Skip("no recordings in loadtest/fixtures")
	}
	orig := make([][]byte, len(reqs))
	for j, r := range reqs {
		orig[j] = r.GetOrderedBuildEvent().GetEvent().GetBazelEvent().GetValue()
	}
	block := func(s *Server) time.Duration {
		start := time.Now()
		for k, req := range reqs {
			req.GetOrderedBuildEvent().GetEvent().GetBazelEvent().Value = orig[k]
			ts := &toolStream{s: s, project: "p", streamID: req.GetOrderedBuildEvent().GetStreamId(), projectID: req.GetProjectId(), next: req.GetOrderedBuildEvent().GetSequenceNumber()}
			if err := ts.check(req); err != nil {
				b.Fatal(err)
			}
			if _, err := s.message("p", "tool", req.GetOrderedBuildEvent(), "id", "bes.p.i"); err != nil {
				b.Fatal(err)
			}
		}
		return time.Since(start)
	}
	off := newServer(b, Config{NoRedaction: true})
	on := newServer(b, Config{})
	bestOff, bestOn := time.Duration(1<<62), time.Duration(1<<62)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		bestOff = min(bestOff, block(off))
		bestOn = min(bestOn, block(on))
	}
	n := float64(len(reqs))
	b.ReportMetric(float64(bestOff.Nanoseconds())/n, "off-ns/event")
	b.ReportMetric(float64(bestOn.Nanoseconds())/n, "on-ns/event")
	b.ReportMetric(100*(float64(bestOn)/float64(bestOff)-1), "overhead-%")
	b.ReportMetric(0, "ns/op")
}

// TestEdgeRefusesEventThatGrowsPastLimit: markers can be longer than what
// they replace; an event that would grow past the size limit is refused
// (INVALID_ARGUMENT, it would be on every retry) and not stored.
func TestEdgeRefusesEventThatGrowsPastLimit(t *testing.T) {
	b, e := newTest(t, Config{MaxEventBytes: 4096})
	id := defaultIDs()
	grows := commandLineEvent(t, strings.Repeat("a://b@ ", 500)) // 3.5 KB, 7.5 KB redacted
	reqs := []*buildpb.PublishBuildToolEventStreamRequest{toolReq(id, 1), toolReqWith(id, 2, grows), finishReq(id, 3)}
	r := publish(testCtx(t), t, e.client, reqs)
	wantCode(t, r.err, codes.InvalidArgument, "once its secrets are redacted", "4096")
	// The first event's publish may still be in flight when the stream
	// ends with the refusal: wait for every publish the edge made, then
	// count what was stored.
	select {
	case <-b.js.PublishAsyncComplete():
	case <-testCtx(t).Done():
		t.Fatal("the edge's publishes did not complete")
	}
	if n := b.count(t, subjects.BES(testProject, id.invocation)); n != 1 {
		t.Fatalf("stored %d events, want the 1 before the refused one", n)
	}
}
