package bes

import (
	"context"
	"io"
	"log/slog"
	"path/filepath"
	"runtime"
	"strconv"
	"testing"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/millrace/millrace/loadtest/besrecord"
	"github.com/millrace/millrace/schemas/envelope"
)

// The fuzz targets feed the edge's checks what a client may send: bytes off
// the wire, decoded into a request as gRPC does. Run one with
//
//	go test -run '^$' -fuzz FuzzToolStreamRequest ./services/bes/
//
// A plain `go test` runs their seed corpus: realistic requests, plus every
// request of the recordings of real Bazel builds in loadtest/fixtures.

const fuzzMaxEventBytes = 64 << 10

func fuzzServer() *Server {
	s, err := New(Config{MaxEventBytes: fuzzMaxEventBytes}, nil, nil, NewMetrics(nil), slog.New(slog.NewTextHandler(io.Discard, nil)))
	if err != nil {
		panic(err)
	}
	return s
}

// seedRequests are realistic tool stream requests, and a few that are not.
func seedRequests() []*buildpb.PublishBuildToolEventStreamRequest {
	id := defaultIDs()
	reqs := []*buildpb.PublishBuildToolEventStreamRequest{
		toolReq(id, 1),
		toolReq(id, 2),
		toolReq(id, 7),
		finishReq(id, 3),
		toolReqWith(id, 1, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: &anypb.Any{TypeUrl: "type.googleapis.com/build_event_stream.BuildEvent", Value: []byte{0xff, 0xff}}}}),
		toolReqWith(id, 1, attemptStarted(id).BuildEvent.Event),
		toolReqWith(id, 0, nil),
		{ProjectId: testProject},
		{},
	}
	noIDs := toolReq(id, 1)
	noIDs.OrderedBuildEvent.StreamId = nil
	keyAsProject := toolReq(id, 1)
	keyAsProject.ProjectId = alphaKey
	return append(reqs, noIDs, keyAsProject)
}

// recordedSeeds are the records of loadtest/fixtures/*.besrec, when another
// engineer has committed recordings of real Bazel builds.
func recordedSeeds(tb testing.TB) []besrecord.Record {
	_, file, _, _ := runtime.Caller(0)
	paths, _ := filepath.Glob(filepath.Join(filepath.Dir(file), "..", "..", "loadtest", "fixtures", "*.besrec"))
	const maxSeeds = 5000 // enough variety; keeps `go test` fast
	var recs []besrecord.Record
	for _, p := range paths {
		rs, err := besrecord.Read(p)
		if err != nil {
			tb.Logf("recording %s: %v (using the %d records before the error)", p, err, len(rs))
		}
		recs = append(recs, rs...)
		if len(recs) >= maxSeeds {
			return recs[:maxSeeds]
		}
	}
	return recs
}

func FuzzToolStreamRequest(f *testing.F) {
	for _, req := range seedRequests() {
		b, err := proto.Marshal(req)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	for _, rec := range recordedSeeds(f) {
		if rec.Stream == nil {
			continue
		}
		b, err := proto.Marshal(rec.Stream)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b)
	}
	s := fuzzServer()
	f.Fuzz(func(t *testing.T, data []byte) {
		var req buildpb.PublishBuildToolEventStreamRequest
		if err := proto.Unmarshal(data, &req); err != nil {
			return // gRPC would have refused it before the handler
		}
		checkToolRequest(t, s, &req)
	})
}

// checkToolRequest runs one request through the path the edge takes for the
// first request of a stream (start, then check) and asserts what may come
// out: a status INVALID_ARGUMENT, or an event fit to publish.
func checkToolRequest(t *testing.T, s *Server, req *buildpb.PublishBuildToolEventStreamRequest) {
	ts := &toolStream{s: s, project: "fuzz"}
	obe := req.GetOrderedBuildEvent()
	sid := obe.GetStreamId()
	if obe.GetSequenceNumber() > 1 && sid.GetBuildId() != "" && sid.GetInvocationId() != "" {
		// start would ask the backbone where the stream stands; take the
		// resume as accepted.
		ts.streamID, ts.projectID, ts.next = sid, req.GetProjectId(), obe.GetSequenceNumber()
	} else if err := ts.start(context.Background(), req); err != nil {
		wantInvalid(t, "start", err)
		return
	}

	err := ts.check(req)
	if err != nil {
		wantInvalid(t, "check", err)
		return
	}
	// Accepted: it must be something a consumer can take.
	if obe == nil {
		t.Fatal("accepted a request without ordered_build_event")
	}
	if size := proto.Size(obe); size > fuzzMaxEventBytes {
		t.Fatalf("accepted an event of %d bytes", size)
	}
	switch ev := obe.GetEvent().GetEvent().(type) {
	case *buildpb.BuildEvent_BazelEvent:
		if ev.BazelEvent.GetTypeUrl() == "" {
			t.Fatal("accepted a bazel_event without a type URL")
		}
		// What the edge lets through, any consumer can at least parse
		// as a message.
		if err := proto.Unmarshal(ev.BazelEvent.GetValue(), &emptypb.Empty{}); err != nil {
			t.Fatalf("accepted a bazel_event that does not parse: %v", err)
		}
	case *buildpb.BuildEvent_ComponentStreamFinished:
		if !ts.finished {
			t.Fatal("component_stream_finished did not finish the stream")
		}
	default:
		t.Fatalf("accepted a %T in a tool stream", ev)
	}
	if ts.next != obe.GetSequenceNumber()+1 {
		t.Fatalf("after event %d the stream expects %d", obe.GetSequenceNumber(), ts.next)
	}

	msg, err := s.message(ts.project, envelope.KindTool, obe, ts.streamID.GetInvocationId()+"/"+strconv.FormatInt(obe.GetSequenceNumber(), 10), "bes.fuzz.x")
	if err != nil {
		t.Fatalf("message: %v", err)
	}
	var back buildpb.OrderedBuildEvent
	if err := proto.Unmarshal(msg.Data, &back); err != nil {
		t.Fatalf("stored body does not decode: %v", err)
	}
	if !proto.Equal(&back, obe) {
		t.Fatal("stored body differs from the event")
	}
	if got := msg.Header.Get(envelope.Sequence); got != strconv.FormatInt(obe.GetSequenceNumber(), 10) {
		t.Fatalf("sequence header %q", got)
	}

	// The same request again is a repeat, and must be refused.
	wantInvalid(t, "repeat", ts.check(req))
}

func wantInvalid(t *testing.T, what string, err error) {
	t.Helper()
	st, ok := status.FromError(err)
	if !ok || st.Code() != codes.InvalidArgument || st.Message() == "" {
		t.Fatalf("%s: got %v, want a status INVALID_ARGUMENT with a message", what, err)
	}
}

func FuzzLifecycleRequest(f *testing.F) {
	id := defaultIDs()
	for _, req := range []*buildpb.PublishLifecycleEventRequest{
		enqueued(id), attemptStarted(id), attemptFinished(id), buildFinished(id), {},
	} {
		b, _ := proto.Marshal(req)
		f.Add(b)
	}
	for _, rec := range recordedSeeds(f) {
		if rec.Lifecycle != nil {
			b, _ := proto.Marshal(rec.Lifecycle)
			f.Add(b)
		}
	}
	s := fuzzServer()
	f.Fuzz(func(t *testing.T, data []byte) {
		var req buildpb.PublishLifecycleEventRequest
		if err := proto.Unmarshal(data, &req); err != nil {
			return
		}
		obe := req.GetBuildEvent()
		if err := checkLifecycle(obe); err != nil {
			wantInvalid(t, "checkLifecycle", err)
			return
		}
		if obe.GetStreamId().GetBuildId() == "" || obe.GetSequenceNumber() <= 0 {
			t.Fatalf("accepted lifecycle event %v", obe)
		}
		msg, err := s.message("fuzz", envelope.KindLifecycle, obe, "lc/x", "bes.fuzz.x")
		if err != nil {
			t.Fatalf("message: %v", err)
		}
		var back buildpb.OrderedBuildEvent
		if err := proto.Unmarshal(msg.Data, &back); err != nil || !proto.Equal(&back, obe) {
			t.Fatalf("stored body does not round-trip: %v", err)
		}
	})
}

// FuzzWellFormed: the edge's wire-format walk accepts exactly what the
// protobuf runtime can parse as a message (into unknown fields).
func FuzzWellFormed(f *testing.F) {
	f.Add(bazelEvent(1, "hello").GetValue())
	f.Add([]byte{0xff, 0xff})
	f.Add([]byte{0x00, 0x01})
	f.Add([]byte{0x0b, 0x08, 0x01, 0x0c}) // a group
	f.Add([]byte{0x0b, 0x08, 0x01, 0x14}) // a group closed by the wrong end
	f.Add(protowire.AppendTag(nil, protowire.MaxValidNumber, protowire.VarintType))
	f.Fuzz(func(t *testing.T, b []byte) {
		werr := wellFormed(b)
		perr := proto.Unmarshal(b, &emptypb.Empty{})
		if (werr == nil) != (perr == nil) {
			t.Fatalf("wellFormed: %v, proto.Unmarshal: %v", werr, perr)
		}
	})
}
