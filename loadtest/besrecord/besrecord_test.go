package besrecord

import (
	"bytes"
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
)

func startRecorder(t *testing.T) (*Recorder, buildpb.PublishBuildEventClient, string) {
	t.Helper()
	out := filepath.Join(t.TempDir(), "rec.besrec")
	rec, err := Start("127.0.0.1:0", out)
	if err != nil {
		t.Fatal(err)
	}
	conn, err := grpc.NewClient(rec.Addr(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return rec, buildpb.NewPublishBuildEventClient(conn), out
}

func streamReq(inv string, seq int64, last bool) *buildpb.PublishBuildToolEventStreamRequest {
	ev := &buildpb.BuildEvent{}
	if last {
		ev.Event = &buildpb.BuildEvent_ComponentStreamFinished{ComponentStreamFinished: &buildpb.BuildEvent_BuildComponentStreamFinished{
			Type: buildpb.BuildEvent_BuildComponentStreamFinished_FINISHED,
		}}
	} else {
		ev.Event = &buildpb.BuildEvent_BazelEvent{BazelEvent: &anypb.Any{
			TypeUrl: "type.googleapis.com/build_event_stream.BuildEvent",
			Value:   []byte{byte(seq)},
		}}
	}
	return &buildpb.PublishBuildToolEventStreamRequest{
		OrderedBuildEvent: &buildpb.OrderedBuildEvent{
			StreamId:       &buildpb.StreamId{BuildId: "b", InvocationId: inv, Component: buildpb.StreamId_TOOL},
			SequenceNumber: seq,
			Event:          ev,
		},
		ProjectId: "proj",
	}
}

// TestRecordAndRead plays Bazel's part of the protocol (lifecycle, then a stream sent without waiting for
// acks, half-closed, then the acks read in order) and checks the recording round-trips.
func TestRecordAndRead(t *testing.T) {
	rec, client, out := startRecorder(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	life := &buildpb.PublishLifecycleEventRequest{
		ServiceLevel: buildpb.PublishLifecycleEventRequest_INTERACTIVE,
		BuildEvent: &buildpb.OrderedBuildEvent{
			StreamId:       &buildpb.StreamId{BuildId: "b", Component: buildpb.StreamId_CONTROLLER},
			SequenceNumber: 1,
			Event:          &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BuildEnqueued_{BuildEnqueued: &buildpb.BuildEvent_BuildEnqueued{}}},
		},
		ProjectId: "proj",
	}
	if _, err := client.PublishLifecycleEvent(ctx, life); err != nil {
		t.Fatal(err)
	}

	stream, err := client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var sent []*buildpb.PublishBuildToolEventStreamRequest
	for seq := int64(1); seq <= 4; seq++ {
		req := streamReq("inv", seq, seq == 4)
		if err := stream.Send(req); err != nil {
			t.Fatal(err)
		}
		sent = append(sent, req)
	}
	if err := stream.CloseSend(); err != nil {
		t.Fatal(err)
	}
	for seq := int64(1); seq <= 4; seq++ {
		ack, err := stream.Recv()
		if err != nil {
			t.Fatalf("ack %d: %v", seq, err)
		}
		if ack.GetSequenceNumber() != seq || ack.GetStreamId().GetInvocationId() != "inv" {
			t.Fatalf("ack %d = %v", seq, ack)
		}
	}
	if _, err := stream.Recv(); err != io.EOF {
		t.Fatalf("after the last ack: got %v, want io.EOF (status OK)", err)
	}

	if got := rec.Stats(); got != (Stats{Lifecycle: 1, Streams: 1, Events: 4}) {
		t.Errorf("Stats = %+v", got)
	}
	if err := rec.Close(); err != nil {
		t.Fatal(err)
	}

	recs, err := Read(out)
	if err != nil {
		t.Fatal(err)
	}
	if len(recs) != 5 {
		t.Fatalf("got %d records, want 5", len(recs))
	}
	if !proto.Equal(recs[0].Lifecycle, life) || recs[0].Stream != nil {
		t.Errorf("record 0 = %v", recs[0])
	}
	for i, want := range sent {
		if !proto.Equal(recs[i+1].Stream, want) {
			t.Errorf("record %d = %v, want %v", i+1, recs[i+1].Stream, want)
		}
		if recs[i+1].OrderedBuildEvent().GetSequenceNumber() != int64(i+1) {
			t.Errorf("record %d has the wrong sequence number", i+1)
		}
	}
}

// TestResumeMidSequence: after an error Bazel opens a new stream that starts at its first unacknowledged
// event, so a stream need not start at 1; a gap inside one stream is refused.
func TestResumeMidSequence(t *testing.T) {
	rec, client, _ := startRecorder(t)
	defer rec.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()

	stream, err := client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, seq := range []int64{7, 8, 10} {
		if err := stream.Send(streamReq("inv", seq, false)); err != nil {
			t.Fatal(err)
		}
	}
	stream.CloseSend()
	for _, seq := range []int64{7, 8} {
		ack, err := stream.Recv()
		if err != nil || ack.GetSequenceNumber() != seq {
			t.Fatalf("ack: %v, %v; want %d", ack, err, seq)
		}
	}
	_, err = stream.Recv()
	if status.Code(err) != codes.InvalidArgument {
		t.Fatalf("gap: got %v, want InvalidArgument", err)
	}
}

func TestReaderErrors(t *testing.T) {
	var buf bytes.Buffer
	w := NewWriter(&buf)
	if err := w.Write(Record{Stream: streamReq("inv", 1, false)}); err != nil {
		t.Fatal(err)
	}
	if err := w.Write(Record{}); err == nil {
		t.Error("Write of an empty record succeeded")
	}
	whole := buf.Bytes()

	t.Run("torn", func(t *testing.T) {
		rd := NewReader(bytes.NewReader(whole[:len(whole)-1]))
		if _, err := rd.Next(); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("got %v, want io.ErrUnexpectedEOF", err)
		}
	})
	t.Run("kind only", func(t *testing.T) {
		rd := NewReader(bytes.NewReader(whole[:1]))
		if _, err := rd.Next(); !errors.Is(err, io.ErrUnexpectedEOF) {
			t.Fatalf("got %v, want io.ErrUnexpectedEOF", err)
		}
	})
	t.Run("bad kind", func(t *testing.T) {
		rd := NewReader(bytes.NewReader([]byte{'X', 0}))
		if _, err := rd.Next(); err == nil || errors.Is(err, io.EOF) {
			t.Fatalf("got %v, want an error about the kind byte", err)
		}
	})
	t.Run("concatenated", func(t *testing.T) {
		path := filepath.Join(t.TempDir(), "two.besrec")
		if err := os.WriteFile(path, append(append([]byte{}, whole...), whole...), 0o644); err != nil {
			t.Fatal(err)
		}
		recs, err := Read(path)
		if err != nil || len(recs) != 2 {
			t.Fatalf("Read = %d records, %v", len(recs), err)
		}
	})
}
