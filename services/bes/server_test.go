package bes

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
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
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The tests drive the edge the way Bazel 4.2.3 does (docs/design.md, "Bazel
// as a client"): one gRPC stream per invocation, every request sent before
// any ack is read, a half-close after ComponentStreamFinished, then one ack
// per request, in order. Everything runs in process against an embedded
// JetStream server.

const (
	testBuild      = "0b6a6a4c-6f4e-4c59-9a0e-000000000001"
	testInvocation = "5d1c9c1e-2a3b-4c5d-8e9f-000000000001"
	testProject    = "proj"
)

// backbone is one embedded JetStream server with the streams applied.
type backbone struct {
	ns     *server.Server
	nc     *nats.Conn
	js     jetstream.JetStream
	stream jetstream.Stream
}

// newBackbone starts NATS and connects to it. Publish futures time out after
// ackTimeout (streams.Open uses 30 s in production).
func newBackbone(t *testing.T, ackTimeout time.Duration) *backbone {
	t.Helper()
	return connectBackbone(t, testenv.NATS(t), ackTimeout)
}

func connectBackbone(t *testing.T, ns *server.Server, ackTimeout time.Duration) *backbone {
	t.Helper()
	nc, err := streams.Connect(ns.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc,
		jetstream.WithPublishAsyncMaxPending(streams.DefaultMaxPending),
		jetstream.WithPublishAsyncTimeout(ackTimeout))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	stream, err := js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	return &backbone{ns: ns, nc: nc, js: js, stream: stream}
}

// newServer is an edge with no backbone, for what needs none (redaction,
// the limits of a config).
func newServer(t testing.TB, cfg Config) *Server {
	t.Helper()
	s, err := New(cfg, nil, nil, NewMetrics(nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// edge is one BES edge serving gRPC on a loopback port, with a client.
type edge struct {
	srv    *Server
	g      *grpc.Server
	addr   string
	client buildpb.PublishBuildEventClient
	conn   *grpc.ClientConn
}

func startEdge(t *testing.T, b *backbone, cfg Config) *edge {
	t.Helper()
	srv, err := New(cfg, streams.NewPublisher(b.js, nil), b.stream, NewMetrics(nil), nil)
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
	conn, err := grpc.NewClient(lis.Addr().String(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallSendMsgSize(64<<20)))
	if err != nil {
		t.Fatal(err)
	}
	e := &edge{srv: srv, g: g, addr: lis.Addr().String(), client: buildpb.NewPublishBuildEventClient(conn), conn: conn}
	t.Cleanup(e.stop)
	return e
}

// stop closes the client and stops the server at once (a crash, as far as
// clients can tell); it may be called twice.
func (e *edge) stop() {
	e.conn.Close()
	e.g.Stop()
}

func (e *edge) openStreams() int {
	e.srv.mu.Lock()
	defer e.srv.mu.Unlock()
	return e.srv.open
}

// newTest is a backbone with one edge on the default configuration.
func newTest(t *testing.T, cfg Config) (*backbone, *edge) {
	t.Helper()
	b := newBackbone(t, 5*time.Second)
	return b, startEdge(t, b, cfg)
}

func testCtx(t *testing.T) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// --- requests as Bazel 4.2.3 builds them ---

type ids struct {
	build, invocation, project string
}

func defaultIDs() ids { return ids{build: testBuild, invocation: testInvocation, project: testProject} }

func (id ids) streamID() *buildpb.StreamId {
	return &buildpb.StreamId{BuildId: id.build, InvocationId: id.invocation, Component: buildpb.StreamId_TOOL}
}

// bazelEvent is a valid build_event_stream.BuildEvent in an Any, as Bazel
// packs it.
func bazelEvent(seq int64, stdout string) *anypb.Any {
	ev := &bep.BuildEvent{
		Id:       &bep.BuildEventId{Id: &bep.BuildEventId_Progress{Progress: &bep.BuildEventId_ProgressId{OpaqueCount: int32(seq)}}},
		Children: []*bep.BuildEventId{{Id: &bep.BuildEventId_Progress{Progress: &bep.BuildEventId_ProgressId{OpaqueCount: int32(seq + 1)}}}},
		Payload:  &bep.BuildEvent_Progress{Progress: &bep.Progress{Stdout: stdout}},
	}
	b, err := proto.Marshal(ev)
	if err != nil {
		panic(err)
	}
	return &anypb.Any{TypeUrl: bep.TypeURL, Value: b}
}

var eventTime = timestamppb.New(time.Date(2024, 5, 1, 12, 0, 0, 0, time.UTC))

func toolReq(id ids, seq int64) *buildpb.PublishBuildToolEventStreamRequest {
	return toolReqWith(id, seq, &buildpb.BuildEvent{
		EventTime: eventTime,
		Event:     &buildpb.BuildEvent_BazelEvent{BazelEvent: bazelEvent(seq, fmt.Sprintf("INFO: event %d\n", seq))},
	})
}

func toolReqWith(id ids, seq int64, ev *buildpb.BuildEvent) *buildpb.PublishBuildToolEventStreamRequest {
	req := &buildpb.PublishBuildToolEventStreamRequest{
		OrderedBuildEvent: &buildpb.OrderedBuildEvent{StreamId: id.streamID(), SequenceNumber: seq, Event: ev},
		ProjectId:         id.project,
	}
	if seq == 1 {
		req.NotificationKeywords = []string{"protocol_name=BEP", "invocation_id=" + id.invocation}
	}
	return req
}

func finishReq(id ids, seq int64) *buildpb.PublishBuildToolEventStreamRequest {
	return toolReqWith(id, seq, &buildpb.BuildEvent{
		EventTime: eventTime,
		Event: &buildpb.BuildEvent_ComponentStreamFinished{ComponentStreamFinished: &buildpb.BuildEvent_BuildComponentStreamFinished{
			Type: buildpb.BuildEvent_BuildComponentStreamFinished_FINISHED}},
	})
}

// invocation is events from..to and, when finish, ComponentStreamFinished
// after them.
func invocation(id ids, from, to int64, finish bool) []*buildpb.PublishBuildToolEventStreamRequest {
	var reqs []*buildpb.PublishBuildToolEventStreamRequest
	for seq := from; seq <= to; seq++ {
		reqs = append(reqs, toolReq(id, seq))
	}
	if finish {
		reqs = append(reqs, finishReq(id, to+1))
	}
	return reqs
}

func lifecycleReq(id ids, seq int64, ev *buildpb.BuildEvent) *buildpb.PublishLifecycleEventRequest {
	sid := &buildpb.StreamId{BuildId: id.build, InvocationId: id.invocation, Component: buildpb.StreamId_CONTROLLER}
	return &buildpb.PublishLifecycleEventRequest{
		ServiceLevel: buildpb.PublishLifecycleEventRequest_INTERACTIVE,
		BuildEvent:   &buildpb.OrderedBuildEvent{StreamId: sid, SequenceNumber: seq, Event: ev},
		ProjectId:    id.project,
	}
}

func enqueued(id ids) *buildpb.PublishLifecycleEventRequest {
	id.invocation = ""
	return lifecycleReq(id, 1, &buildpb.BuildEvent{EventTime: eventTime,
		Event: &buildpb.BuildEvent_BuildEnqueued_{BuildEnqueued: &buildpb.BuildEvent_BuildEnqueued{}}})
}

func attemptStarted(id ids) *buildpb.PublishLifecycleEventRequest {
	return lifecycleReq(id, 1, &buildpb.BuildEvent{EventTime: eventTime,
		Event: &buildpb.BuildEvent_InvocationAttemptStarted_{InvocationAttemptStarted: &buildpb.BuildEvent_InvocationAttemptStarted{AttemptNumber: 1}}})
}

func attemptFinished(id ids) *buildpb.PublishLifecycleEventRequest {
	return lifecycleReq(id, 2, &buildpb.BuildEvent{EventTime: eventTime,
		Event: &buildpb.BuildEvent_InvocationAttemptFinished_{InvocationAttemptFinished: &buildpb.BuildEvent_InvocationAttemptFinished{
			InvocationStatus: &buildpb.BuildStatus{Result: buildpb.BuildStatus_COMMAND_SUCCEEDED}}}})
}

func buildFinished(id ids) *buildpb.PublishLifecycleEventRequest {
	id.invocation = ""
	return lifecycleReq(id, 2, &buildpb.BuildEvent{EventTime: eventTime,
		Event: &buildpb.BuildEvent_BuildFinished_{BuildFinished: &buildpb.BuildEvent_BuildFinished{
			Status: &buildpb.BuildStatus{Result: buildpb.BuildStatus_COMMAND_SUCCEEDED}}}})
}

// --- a client that behaves like Bazel ---

// result is what one stream gave the client: the acks and how it ended
// (nil for OK).
type result struct {
	acks []*buildpb.PublishBuildToolEventStreamResponse
	err  error
}

func (r result) code() codes.Code { return status.Code(r.err) }

// publish sends every request, half-closes, then reads acks until the
// stream ends, as Bazel does.
func publish(ctx context.Context, t *testing.T, c buildpb.PublishBuildEventClient, reqs []*buildpb.PublishBuildToolEventStreamRequest) result {
	t.Helper()
	st, err := c.PublishBuildToolEventStream(ctx)
	if err != nil {
		return result{err: err}
	}
	for _, req := range reqs {
		if err := st.Send(req); err != nil {
			// io.EOF: the server already ended the stream; Recv tells why.
			break
		}
	}
	st.CloseSend()
	return readAcks(st)
}

func readAcks(st buildpb.PublishBuildEvent_PublishBuildToolEventStreamClient) result {
	var r result
	for {
		ack, err := st.Recv()
		if errors.Is(err, io.EOF) {
			return r
		}
		if err != nil {
			r.err = err
			return r
		}
		r.acks = append(r.acks, ack)
	}
}

// checkAcks asserts that the acks are exactly from..to, in order, each with
// the stream id sent.
func checkAcks(t *testing.T, id ids, acks []*buildpb.PublishBuildToolEventStreamResponse, from, to int64) {
	t.Helper()
	if want := int(to - from + 1); len(acks) != want {
		t.Fatalf("got %d acks, want %d (%d..%d)", len(acks), want, from, to)
	}
	checkAckPrefix(t, id, acks, from)
}

// checkAckPrefix asserts that acks run from, from+1, ... without a gap.
func checkAckPrefix(t *testing.T, id ids, acks []*buildpb.PublishBuildToolEventStreamResponse, from int64) {
	t.Helper()
	for i, ack := range acks {
		if want := from + int64(i); ack.GetSequenceNumber() != want {
			t.Fatalf("ack %d has sequence %d, want %d", i, ack.GetSequenceNumber(), want)
		}
		if !proto.Equal(ack.GetStreamId(), id.streamID()) {
			t.Fatalf("ack %d has stream id %v, want %v", i, ack.GetStreamId(), id.streamID())
		}
	}
}

func wantCode(t *testing.T, err error, want codes.Code, msgParts ...string) {
	t.Helper()
	if got := status.Code(err); got != want {
		t.Fatalf("got %v (%v), want %v", got, err, want)
	}
	for _, p := range msgParts {
		if !strings.Contains(status.Convert(err).Message(), p) {
			t.Errorf("message %q does not mention %q", status.Convert(err).Message(), p)
		}
	}
}

// --- what the backbone holds ---

// stored returns every message on subject, in stream order.
func (b *backbone) stored(t *testing.T, subject string) []*jetstream.RawStreamMsg {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var msgs []*jetstream.RawStreamMsg
	for seq := uint64(1); ; {
		m, err := b.stream.GetMsg(ctx, seq, jetstream.WithGetMsgSubject(subject))
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			return msgs
		}
		if err != nil {
			t.Fatalf("get %s from %d: %v", subject, seq, err)
		}
		msgs = append(msgs, m)
		seq = m.Sequence + 1
	}
}

// count is how many messages subject holds, from the stream's state.
func (b *backbone) count(t *testing.T, subject string) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := b.stream.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		t.Fatalf("stream info: %v", err)
	}
	return info.State.Subjects[subject]
}

// total is how many messages the BES stream holds.
func (b *backbone) total(t *testing.T) uint64 {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := b.stream.Info(ctx)
	if err != nil {
		t.Fatalf("stream info: %v", err)
	}
	return info.State.Msgs
}

func seqOf(t *testing.T, m *jetstream.RawStreamMsg) int64 {
	t.Helper()
	n, err := strconv.ParseInt(m.Header.Get(envelope.Sequence), 10, 64)
	if err != nil {
		t.Fatalf("message %d: bad %s header %q", m.Sequence, envelope.Sequence, m.Header.Get(envelope.Sequence))
	}
	return n
}

// toolSeqs returns the tool-event sequences stored on subject, in stream
// order.
func (b *backbone) toolSeqs(t *testing.T, subject string) []int64 {
	var seqs []int64
	for _, m := range b.stored(t, subject) {
		if m.Header.Get(envelope.Kind) == envelope.KindTool {
			seqs = append(seqs, seqOf(t, m))
		}
	}
	return seqs
}

// checkExactlyOnce asserts that subject holds tool events 1..n, each once,
// in order.
func checkExactlyOnce(t *testing.T, b *backbone, subject string, n int64) {
	t.Helper()
	seqs := b.toolSeqs(t, subject)
	if int64(len(seqs)) != n {
		t.Fatalf("%s holds %d tool events, want %d: %v", subject, len(seqs), n, seqs)
	}
	for i, s := range seqs {
		if s != int64(i+1) {
			t.Fatalf("%s: stored event %d has sequence %d, want %d (stored order %v)", subject, i, s, i+1, seqs)
		}
	}
}

// =====================================================================

func TestHappyPath(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	id := defaultIDs()
	reqs := invocation(id, 1, 500, true)

	r := publish(ctx, t, e.client, reqs)
	if r.err != nil {
		t.Fatalf("stream ended with %v", r.err)
	}
	checkAcks(t, id, r.acks, 1, 501)

	subject := "bes." + testProject + "." + id.invocation
	if got := subjects.BES(testProject, id.invocation); got != subject {
		t.Fatalf("subjects.BES = %q, want %q", got, subject)
	}
	if n := b.count(t, subject); n != 501 {
		t.Fatalf("stream holds %d messages on %s, want 501", n, subject)
	}
	if n := b.total(t); n != 501 {
		t.Fatalf("stream holds %d messages, want 501", n)
	}
	msgs := b.stored(t, subject)
	if len(msgs) != 501 {
		t.Fatalf("read %d messages, want 501", len(msgs))
	}
	for i, m := range msgs {
		seq := int64(i + 1)
		want := map[string]string{
			envelope.MsgID:        subjects.Token(testProject) + "/" + subjects.Token(id.invocation) + "/" + strconv.FormatInt(seq, 10),
			envelope.Schema:       envelope.SchemaBESv1,
			envelope.Kind:         envelope.KindTool,
			envelope.Project:      testProject,
			envelope.BuildID:      id.build,
			envelope.InvocationID: id.invocation,
			envelope.Sequence:     strconv.FormatInt(seq, 10),
		}
		for k, v := range want {
			if got := m.Header.Get(k); got != v {
				t.Fatalf("message %d: header %s = %q, want %q", i, k, got, v)
			}
		}
		var obe buildpb.OrderedBuildEvent
		if err := proto.Unmarshal(m.Data, &obe); err != nil {
			t.Fatalf("message %d: body does not decode: %v", i, err)
		}
		if !proto.Equal(&obe, reqs[i].GetOrderedBuildEvent()) {
			t.Fatalf("message %d: body %v, want %v", i, &obe, reqs[i].GetOrderedBuildEvent())
		}
	}
	// The bazel_event bytes survive untouched and decode as a BuildEvent.
	var obe buildpb.OrderedBuildEvent
	if err := proto.Unmarshal(msgs[7].Data, &obe); err != nil {
		t.Fatal(err)
	}
	var ev bep.BuildEvent
	if err := obe.GetEvent().GetBazelEvent().UnmarshalTo(&ev); err != nil {
		t.Fatalf("bazel_event: %v", err)
	}
	if got := ev.GetProgress().GetStdout(); got != "INFO: event 8\n" {
		t.Fatalf("event 8 stdout %q", got)
	}
	poll.Until(t, "streams to close", func() bool { return e.openStreams() == 0 })
}

func TestEmptyStream(t *testing.T) {
	b, e := newTest(t, Config{})
	r := publish(testCtx(t), t, e.client, nil)
	if r.err != nil || len(r.acks) != 0 {
		t.Fatalf("empty stream: %d acks, %v", len(r.acks), r.err)
	}
	if n := b.total(t); n != 0 {
		t.Fatalf("stream holds %d messages", n)
	}
}

func TestDefaultProject(t *testing.T) {
	b, e := newTest(t, Config{})
	id := defaultIDs()
	id.project = ""
	r := publish(testCtx(t), t, e.client, invocation(id, 1, 3, true))
	if r.err != nil {
		t.Fatal(r.err)
	}
	subject := subjects.BES("default", id.invocation)
	if n := b.count(t, subject); n != 4 {
		t.Fatalf("%s holds %d, want 4", subject, n)
	}
	if got := b.stored(t, subject)[0].Header.Get(envelope.Project); got != "default" {
		t.Fatalf("project header %q", got)
	}
}

func TestConcurrentStreams(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	const n, events = 16, 100
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for i := range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			id := defaultIDs()
			id.invocation = fmt.Sprintf("inv-%02d", i)
			id.project = fmt.Sprintf("p%d", i%3)
			r := publish(ctx, t, e.client, invocation(id, 1, events, true))
			if r.err != nil {
				errs <- fmt.Errorf("%s: %v", id.invocation, r.err)
				return
			}
			for j, ack := range r.acks {
				if ack.GetSequenceNumber() != int64(j+1) || ack.GetStreamId().GetInvocationId() != id.invocation {
					errs <- fmt.Errorf("%s: ack %d is %d of %s", id.invocation, j, ack.GetSequenceNumber(), ack.GetStreamId().GetInvocationId())
					return
				}
			}
			if len(r.acks) != events+1 {
				errs <- fmt.Errorf("%s: %d acks", id.invocation, len(r.acks))
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	if got := b.total(t); got != n*(events+1) {
		t.Fatalf("stream holds %d, want %d", got, n*(events+1))
	}
	checkExactlyOnce(t, b, subjects.BES("p1", "inv-04"), events+1)
}

func TestLifecycleEvents(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	id := defaultIDs()

	for _, req := range []*buildpb.PublishLifecycleEventRequest{enqueued(id), attemptStarted(id)} {
		if _, err := e.client.PublishLifecycleEvent(ctx, req); err != nil {
			t.Fatalf("lifecycle: %v", err)
		}
	}
	r := publish(ctx, t, e.client, invocation(id, 1, 10, true))
	if r.err != nil {
		t.Fatal(r.err)
	}
	checkAcks(t, id, r.acks, 1, 11)
	for _, req := range []*buildpb.PublishLifecycleEventRequest{attemptFinished(id), buildFinished(id)} {
		if _, err := e.client.PublishLifecycleEvent(ctx, req); err != nil {
			t.Fatalf("lifecycle: %v", err)
		}
	}
	// A lifecycle event sent twice (Bazel retries a unary call that failed
	// after the edge stored it) is stored once.
	if _, err := e.client.PublishLifecycleEvent(ctx, attemptFinished(id)); err != nil {
		t.Fatal(err)
	}

	buildSubject := subjects.BES(testProject, id.build)
	build := b.stored(t, buildSubject)
	if len(build) != 2 {
		t.Fatalf("%s holds %d messages, want 2 (enqueued, finished)", buildSubject, len(build))
	}
	for i, m := range build {
		checkLifecycleMsg(t, m, id.build, "", int64(i+1))
	}
	var obe buildpb.OrderedBuildEvent
	if err := proto.Unmarshal(build[0].Data, &obe); err != nil || obe.GetEvent().GetBuildEnqueued() == nil {
		t.Fatalf("first build-level message is %v (%v), want build_enqueued", &obe, err)
	}

	invSubject := subjects.BES(testProject, id.invocation)
	inv := b.stored(t, invSubject)
	if len(inv) != 1+11+1 {
		t.Fatalf("%s holds %d messages, want 13", invSubject, len(inv))
	}
	checkLifecycleMsg(t, inv[0], id.build, id.invocation, 1)
	if err := proto.Unmarshal(inv[0].Data, &obe); err != nil || obe.GetEvent().GetInvocationAttemptStarted() == nil {
		t.Fatalf("first invocation message is %v (%v), want invocation_attempt_started", &obe, err)
	}
	checkLifecycleMsg(t, inv[12], id.build, id.invocation, 2)
	for _, m := range inv[1:12] {
		if k := m.Header.Get(envelope.Kind); k != envelope.KindTool {
			t.Fatalf("message %d kind %q, want tool", m.Sequence, k)
		}
	}
}

func checkLifecycleMsg(t *testing.T, m *jetstream.RawStreamMsg, build, inv string, seq int64) {
	t.Helper()
	want := map[string]string{
		envelope.MsgID:        "lc/" + subjects.Token(testProject) + "/" + subjects.Token(build) + "/" + subjects.Token(inv) + "/" + strconv.FormatInt(seq, 10),
		envelope.Schema:       envelope.SchemaBESv1,
		envelope.Kind:         envelope.KindLifecycle,
		envelope.Project:      testProject,
		envelope.BuildID:      build,
		envelope.InvocationID: inv,
		envelope.Sequence:     strconv.FormatInt(seq, 10),
	}
	for k, v := range want {
		if got := m.Header.Get(k); got != v {
			t.Errorf("lifecycle message %d: header %s = %q, want %q", m.Sequence, k, got, v)
		}
	}
}

func TestLifecycleRejections(t *testing.T) {
	b, e := newTest(t, Config{MaxEventBytes: 64 << 10})
	ctx := testCtx(t)
	id := defaultIDs()

	noBuild := attemptStarted(id)
	noBuild.BuildEvent.StreamId.BuildId = ""
	seqZero := attemptStarted(id)
	seqZero.BuildEvent.SequenceNumber = 0
	notLifecycle := attemptStarted(id)
	notLifecycle.BuildEvent.Event = &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: bazelEvent(1, "x")}}
	noEvent := attemptStarted(id)
	noEvent.BuildEvent.Event = nil
	big := attemptStarted(id)
	big.BuildEvent.StreamId.InvocationId = strings.Repeat("i", 70<<10)

	for name, req := range map[string]*buildpb.PublishLifecycleEventRequest{
		"no build_event": {ProjectId: testProject},
		"no build id":    noBuild,
		"sequence 0":     seqZero,
		"bazel event":    notLifecycle,
		"no event":       noEvent,
		"oversized":      big,
	} {
		t.Run(name, func(t *testing.T) {
			_, err := e.client.PublishLifecycleEvent(ctx, req)
			wantCode(t, err, codes.InvalidArgument)
		})
	}
	if n := b.total(t); n != 0 {
		t.Fatalf("stream holds %d messages after refused lifecycle events", n)
	}
}

// TestResumeAfterBrokenStream is what Bazel does when a stream breaks (the
// edge restarted): it opens a new stream that starts at the first
// unacknowledged event, with no lifecycle events before it, and resends.
func TestResumeAfterBrokenStream(t *testing.T) {
	for _, restart := range []bool{false, true} {
		t.Run(fmt.Sprintf("restart=%v", restart), func(t *testing.T) {
			b := newBackbone(t, 5*time.Second)
			e := startEdge(t, b, Config{})
			ctx := testCtx(t)
			id := defaultIDs()
			subject := subjects.BES(testProject, id.invocation)

			// Send 1..100 and break the stream before reading any ack (but
			// after the edge stored them, so that the client may resume
			// at 40 as if it had read acks up to 39).
			sctx, cancel := context.WithCancel(ctx)
			st, err := e.client.PublishBuildToolEventStream(sctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, req := range invocation(id, 1, 100, false) {
				if err := st.Send(req); err != nil {
					t.Fatalf("send: %v", err)
				}
			}
			poll.Until(t, "100 events stored", func() bool { return b.count(t, subject) == 100 })
			cancel()
			if r := readAcks(st); status.Code(r.err) != codes.Canceled {
				t.Fatalf("cancelled stream ended with %v", r.err)
			}
			poll.Until(t, "the broken stream to close", func() bool { return e.openStreams() == 0 })

			if restart {
				e.stop()
				e = startEdge(t, b, Config{})
			}
			r := publish(ctx, t, e.client, invocation(id, 40, 100, true))
			if r.err != nil {
				t.Fatalf("resumed stream ended with %v", r.err)
			}
			checkAcks(t, id, r.acks, 40, 101)
			checkExactlyOnce(t, b, subject, 101)
		})
	}
}

// TestResumeFromStart: the stream breaks before the edge stored
// anything the client knows of, so Bazel resends everything from 1.
func TestResumeFromStart(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	id := defaultIDs()
	subject := subjects.BES(testProject, id.invocation)

	sctx, cancel := context.WithCancel(ctx)
	st, err := e.client.PublishBuildToolEventStream(sctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, req := range invocation(id, 1, 100, false) {
		if err := st.Send(req); err != nil {
			break
		}
	}
	cancel() // whatever the edge got so far may or may not be stored

	r := publish(ctx, t, e.client, invocation(id, 1, 100, true))
	if r.err != nil {
		t.Fatal(r.err)
	}
	checkAcks(t, id, r.acks, 1, 101)
	poll.Until(t, "the broken stream to close", func() bool { return e.openStreams() == 0 })
	checkExactlyOnce(t, b, subject, 101)
}

// TestResumeAfterFinish: the stream broke after every event was stored but
// before Bazel read the last acks; the resend of the whole tail, finish
// included, is acked and stored nothing new.
func TestResumeAfterFinish(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	id := defaultIDs()
	subject := subjects.BES(testProject, id.invocation)
	if r := publish(ctx, t, e.client, invocation(id, 1, 20, true)); r.err != nil {
		t.Fatal(r.err)
	}
	r := publish(ctx, t, e.client, invocation(id, 15, 20, true))
	if r.err != nil {
		t.Fatal(r.err)
	}
	checkAcks(t, id, r.acks, 15, 21)
	checkExactlyOnce(t, b, subject, 21)
}

func TestResumeWithGap(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	id := defaultIDs()
	subject := subjects.BES(testProject, id.invocation)

	// Store 1..100 (the first stream breaks before its finish).
	st, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, req := range invocation(id, 1, 100, false) {
		if err := st.Send(req); err != nil {
			t.Fatal(err)
		}
	}
	st.CloseSend()
	if r := readAcks(st); r.err != nil || len(r.acks) != 100 {
		t.Fatalf("first stream: %d acks, %v", len(r.acks), r.err)
	}

	r := publish(ctx, t, e.client, invocation(id, 150, 160, true))
	wantCode(t, r.err, codes.InvalidArgument, "150", "100")
	if len(r.acks) != 0 {
		t.Fatalf("got %d acks on a refused resume", len(r.acks))
	}
	if n := b.count(t, subject); n != 100 {
		t.Fatalf("%s holds %d, want 100", subject, n)
	}

	// A resume with a gap on an invocation the backbone never saw.
	other := id
	other.invocation = "never-seen"
	r = publish(ctx, t, e.client, invocation(other, 2, 5, true))
	wantCode(t, r.err, codes.InvalidArgument)
	if n := b.total(t); n != 100 {
		t.Fatalf("stream holds %d, want 100", n)
	}
}

func TestSequenceErrors(t *testing.T) {
	id := defaultIDs()
	bad := func(seqs ...int64) []*buildpb.PublishBuildToolEventStreamRequest {
		var reqs []*buildpb.PublishBuildToolEventStreamRequest
		for _, s := range seqs {
			reqs = append(reqs, toolReq(id, s))
		}
		return reqs
	}
	otherStream := func(build, inv string) *buildpb.PublishBuildToolEventStreamRequest {
		o := id
		o.build, o.invocation = build, inv
		return toolReq(o, 3)
	}
	otherProject := toolReq(id, 3)
	otherProject.ProjectId = "other"
	noOBE := &buildpb.PublishBuildToolEventStreamRequest{ProjectId: testProject}

	cases := []struct {
		name string
		reqs []*buildpb.PublishBuildToolEventStreamRequest
		// maxStored is the highest sequence that may be stored; every
		// sequence above it must not be.
		maxStored int64
	}{
		{"jump", append(bad(1, 2, 3, 5), finishReq(id, 6)), 3},
		{"repeat", bad(1, 2, 2, 3), 2},
		{"backwards", bad(1, 2, 3, 1), 3},
		{"zero first", bad(0, 1), 0},
		{"negative first", bad(-1), 0},
		{"after finish", append(invocation(id, 1, 2, true), toolReq(id, 4)), 3},
		{"finish twice", append(invocation(id, 1, 2, true), finishReq(id, 4)), 3},
		{"build id changes", append(bad(1, 2), otherStream("other-build", id.invocation)), 2},
		{"invocation id changes", append(bad(1, 2), otherStream(id.build, "other-inv")), 2},
		{"project id changes", append(bad(1, 2), otherProject), 2},
		{"no ordered_build_event", append(bad(1, 2), noOBE), 2},
		{"no ordered_build_event first", []*buildpb.PublishBuildToolEventStreamRequest{noOBE}, 0},
		{"no stream id first", []*buildpb.PublishBuildToolEventStreamRequest{{
			OrderedBuildEvent: &buildpb.OrderedBuildEvent{SequenceNumber: 1, Event: toolReq(id, 1).OrderedBuildEvent.Event},
			ProjectId:         testProject}}, 0},
	}
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			// One invocation per case, rewritten into each request.
			inv := fmt.Sprintf("seq-case-%d", i)
			var reqs []*buildpb.PublishBuildToolEventStreamRequest
			for _, r := range c.reqs {
				r = proto.Clone(r).(*buildpb.PublishBuildToolEventStreamRequest)
				if sid := r.GetOrderedBuildEvent().GetStreamId(); sid != nil && sid.InvocationId == id.invocation {
					sid.InvocationId = inv
				}
				reqs = append(reqs, r)
			}
			r := publish(ctx, t, e.client, reqs)
			wantCode(t, r.err, codes.InvalidArgument)
			cid := id
			cid.invocation = inv
			checkAckPrefix(t, cid, r.acks, 1)
			if int64(len(r.acks)) > c.maxStored {
				t.Fatalf("%d acks, at most %d expected", len(r.acks), c.maxStored)
			}
			for _, s := range b.toolSeqs(t, subjects.BES(testProject, inv)) {
				if s > c.maxStored {
					t.Fatalf("event %d was stored; nothing above %d may be", s, c.maxStored)
				}
			}
			if n := b.count(t, subjects.BES(testProject, "other-inv")); n != 0 {
				t.Fatalf("%d events stored under the changed invocation id", n)
			}
		})
	}
}

func TestOversizedEvent(t *testing.T) {
	const limit = 64 << 10
	b, e := newTest(t, Config{MaxEventBytes: limit})
	ctx := testCtx(t)
	id := defaultIDs()
	subject := subjects.BES(testProject, id.invocation)

	// Just under the limit is fine.
	fits := toolReqWith(id, 2, &buildpb.BuildEvent{EventTime: eventTime,
		Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: bazelEvent(2, strings.Repeat("o", limit-1024))}})
	if size := proto.Size(fits.OrderedBuildEvent); size > limit {
		t.Fatalf("test event of %d bytes is over the limit", size)
	}
	r := publish(ctx, t, e.client, []*buildpb.PublishBuildToolEventStreamRequest{toolReq(id, 1), fits, finishReq(id, 3)})
	if r.err != nil {
		t.Fatalf("event just under the limit: %v", r.err)
	}

	for _, size := range []int{100 << 10, 1 << 20} {
		t.Run(strconv.Itoa(size), func(t *testing.T) {
			inv := id
			inv.invocation = fmt.Sprintf("big-%d", size)
			big := toolReqWith(inv, 2, &buildpb.BuildEvent{EventTime: eventTime,
				Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: bazelEvent(2, strings.Repeat("x", size))}})
			r := publish(ctx, t, e.client, []*buildpb.PublishBuildToolEventStreamRequest{toolReq(inv, 1), big, finishReq(inv, 3)})
			if size < limit+64<<10 {
				// Below the gRPC receive limit: the edge's own check names
				// the limit.
				wantCode(t, r.err, codes.InvalidArgument, strconv.Itoa(limit))
			} else if c := status.Code(r.err); c != codes.InvalidArgument && c != codes.ResourceExhausted {
				// Above it gRPC refuses the message itself (see the report:
				// Bazel retries RESOURCE_EXHAUSTED).
				t.Fatalf("event of %d bytes: %v", size, r.err)
			} else {
				t.Logf("event of %d bytes (above the gRPC receive limit): %v", size, r.err)
			}
			for _, s := range b.toolSeqs(t, subjects.BES(testProject, inv.invocation)) {
				if s > 1 {
					t.Fatalf("event %d stored", s)
				}
			}
		})
	}
	if n := b.count(t, subject); n != 3 {
		t.Fatalf("%s holds %d, want 3", subject, n)
	}
}

func TestMalformedEvent(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	id := defaultIDs()
	withEvent := func(ev *buildpb.BuildEvent) []*buildpb.PublishBuildToolEventStreamRequest {
		return []*buildpb.PublishBuildToolEventStreamRequest{toolReq(id, 1), toolReqWith(id, 2, ev), finishReq(id, 3)}
	}
	anyOf := func(b []byte) *buildpb.BuildEvent {
		return &buildpb.BuildEvent{EventTime: eventTime,
			Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: &anypb.Any{TypeUrl: bep.TypeURL, Value: b}}}
	}
	whole := bazelEvent(2, "hello").Value
	cases := map[string]*buildpb.BuildEvent{
		"ff ff":              anyOf([]byte{0xff, 0xff}),
		"truncated":          anyOf(whole[:len(whole)-2]),
		"field zero":         anyOf([]byte{0x00, 0x01}),
		"end group":          anyOf([]byte{0x0c}),
		"empty type url":     {Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: &anypb.Any{Value: bazelEvent(2, "x").Value}}},
		"nil bazel_event":    {Event: &buildpb.BuildEvent_BazelEvent{}},
		"no event":           {EventTime: eventTime},
		"console output":     {Event: &buildpb.BuildEvent_ConsoleOutput_{ConsoleOutput: &buildpb.BuildEvent_ConsoleOutput{}}},
		"lifecycle in tools": attemptStarted(id).BuildEvent.Event,
	}
	for name, ev := range cases {
		t.Run(name, func(t *testing.T) {
			r := publish(ctx, t, e.client, withEvent(ev))
			wantCode(t, r.err, codes.InvalidArgument)
			checkAckPrefix(t, id, r.acks, 1)
		})
	}
	for _, s := range b.toolSeqs(t, subjects.BES(testProject, id.invocation)) {
		if s != 1 {
			t.Fatalf("event %d stored", s)
		}
	}
	// An Any whose bytes are well-formed protobuf of some other message is
	// accepted: the edge checks the wire format, not the schema.
	id.invocation = "other-any"
	r := publish(ctx, t, e.client, []*buildpb.PublishBuildToolEventStreamRequest{
		toolReqWith(id, 1, anyOf([]byte{0x08, 0x96, 0x01})), finishReq(id, 2)})
	if r.err != nil {
		t.Fatal(r.err)
	}
}

const alphaKey = "0123456789abcdef0123"

func TestAPIKeys(t *testing.T) {
	keys, err := ParseKeys("alpha=" + alphaKey)
	if err != nil {
		t.Fatal(err)
	}
	b, e := newTest(t, Config{Keys: keys})
	ctx := testCtx(t)
	withKey := func(key string) context.Context {
		return metadata.AppendToOutgoingContext(ctx, APIKeyHeader, key)
	}

	cases := []struct {
		name    string
		ctx     context.Context
		project string
		want    codes.Code // when OK, the events go to project alpha
	}{
		{"no key", ctx, "", codes.Unauthenticated},
		{"project name without key", ctx, "alpha", codes.Unauthenticated},
		{"key as project id", ctx, alphaKey, codes.OK},
		{"wrong key as project id", ctx, "0123456789abcdef0124", codes.Unauthenticated},
		{"key in metadata, project alpha", withKey(alphaKey), "alpha", codes.OK},
		{"key in metadata, no project", withKey(alphaKey), "", codes.OK},
		{"key in metadata, project beta", withKey(alphaKey), "beta", codes.PermissionDenied},
		{"wrong key in metadata", withKey("not-the-key-at-all-0000"), "alpha", codes.Unauthenticated},
		{"wrong key in metadata, key as project id", withKey("not-the-key-at-all-0000"), alphaKey, codes.Unauthenticated},
	}
	for i, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			id := ids{build: fmt.Sprintf("build-%d", i), invocation: fmt.Sprintf("inv-%d", i), project: c.project}
			subject := subjects.BES("alpha", id.invocation)

			r := publish(c.ctx, t, e.client, invocation(id, 1, 5, true))
			if c.want != codes.OK {
				wantCode(t, r.err, c.want)
				if len(r.acks) != 0 {
					t.Fatalf("%d acks", len(r.acks))
				}
			} else {
				if r.err != nil {
					t.Fatal(r.err)
				}
				checkAcks(t, id, r.acks, 1, 6)
			}

			_, lerr := e.client.PublishLifecycleEvent(c.ctx, attemptStarted(id))
			if c.want != codes.OK {
				wantCode(t, lerr, c.want)
			} else if lerr != nil {
				t.Fatal(lerr)
			}

			var want uint64
			if c.want == codes.OK {
				want = 7
			}
			if n := b.count(t, subject); n != want {
				t.Fatalf("%s holds %d, want %d", subject, n, want)
			}
		})
	}

	// The key never reaches the backbone: not in a subject, not in a header,
	// and everything went to project alpha.
	ctx2, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := b.stream.Info(ctx2, jetstream.WithSubjectFilter(">"))
	if err != nil {
		t.Fatal(err)
	}
	for subject := range info.State.Subjects {
		if strings.Contains(subject, alphaKey) {
			t.Errorf("subject %s contains the API key", subject)
		}
		if !strings.HasPrefix(subject, "bes.alpha.") {
			t.Errorf("subject %s is not under project alpha", subject)
		}
		for _, m := range b.stored(t, subject) {
			for k, vs := range m.Header {
				for _, v := range vs {
					if strings.Contains(v, alphaKey) {
						t.Errorf("message %d: header %s carries the API key", m.Sequence, k)
					}
				}
			}
			if got := m.Header.Get(envelope.Project); got != "alpha" {
				t.Errorf("message %d: project header %q", m.Sequence, got)
			}
		}
	}
	if len(info.State.Subjects) != 3 {
		t.Errorf("stream has subjects %v, want the 3 accepted invocations", info.State.Subjects)
	}
}

// TestAPIKeyNotInBody: a key given as --project_id must not reach the stored
// body either (the body is the OrderedBuildEvent; project_id is a field of
// the request around it).
func TestAPIKeyNotInBody(t *testing.T) {
	keys, err := ParseKeys("alpha=" + alphaKey)
	if err != nil {
		t.Fatal(err)
	}
	b, e := newTest(t, Config{Keys: keys})
	id := defaultIDs()
	id.project = alphaKey
	if r := publish(testCtx(t), t, e.client, invocation(id, 1, 3, true)); r.err != nil {
		t.Fatal(r.err)
	}
	for _, m := range b.stored(t, subjects.BES("alpha", id.invocation)) {
		if strings.Contains(string(m.Data), alphaKey) {
			t.Fatalf("message %d: body carries the API key", m.Sequence)
		}
	}
}

func TestMaxStreams(t *testing.T) {
	b, e := newTest(t, Config{MaxStreams: 1})
	ctx := testCtx(t)
	first := defaultIDs()
	second := defaultIDs()
	second.invocation = "second"

	// The first stream is open and holds the only slot.
	st, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(toolReq(first, 1)); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the first stream to be open", func() bool { return e.openStreams() == 1 })

	r := publish(ctx, t, e.client, invocation(second, 1, 3, true))
	wantCode(t, r.err, codes.ResourceExhausted)
	if n := b.count(t, subjects.BES(testProject, second.invocation)); n != 0 {
		t.Fatalf("refused stream stored %d events", n)
	}

	for _, req := range invocation(first, 2, 5, true) {
		if err := st.Send(req); err != nil {
			t.Fatal(err)
		}
	}
	st.CloseSend()
	if r := readAcks(st); r.err != nil || len(r.acks) != 6 {
		t.Fatalf("first stream: %d acks, %v", len(r.acks), r.err)
	}
	poll.Until(t, "the first stream to close", func() bool { return e.openStreams() == 0 })

	r = publish(ctx, t, e.client, invocation(second, 1, 3, true))
	if r.err != nil {
		t.Fatalf("after the first stream closed: %v", r.err)
	}
	checkAcks(t, second, r.acks, 1, 4)
}

func TestMaxStreamsPerProject(t *testing.T) {
	_, e := newTest(t, Config{MaxStreams: 4, MaxStreamsPerProject: 1})
	ctx := testCtx(t)
	a := defaultIDs()

	st, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(toolReq(a, 1)); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the first stream to be open", func() bool { return e.openStreams() == 1 })

	same := a
	same.invocation = "same-project"
	wantCode(t, publish(ctx, t, e.client, invocation(same, 1, 2, true)).err, codes.ResourceExhausted, testProject)

	other := a
	other.invocation, other.project = "other-project", "other"
	if r := publish(ctx, t, e.client, invocation(other, 1, 2, true)); r.err != nil {
		t.Fatalf("another project: %v", r.err)
	}
	st.CloseSend()
	if r := readAcks(st); r.err != nil {
		t.Fatal(r.err)
	}
}

// TestStreamsReleased: streams that end in every way give their slot back.
func TestStreamsReleased(t *testing.T) {
	_, e := newTest(t, Config{MaxStreams: 1})
	ctx := testCtx(t)
	id := defaultIDs()

	// Refused mid-stream.
	wantCode(t, publish(ctx, t, e.client, append(invocation(id, 1, 3, false), toolReq(id, 9))).err, codes.InvalidArgument)
	// Cancelled by the client.
	sctx, cancel := context.WithCancel(ctx)
	st, err := e.client.PublishBuildToolEventStream(sctx)
	if err != nil {
		t.Fatal(err)
	}
	st.Send(toolReq(id, 1))
	poll.Until(t, "the stream to open", func() bool { return e.openStreams() == 1 })
	cancel()
	poll.Until(t, "the cancelled stream to close", func() bool { return e.openStreams() == 0 })

	if r := publish(ctx, t, e.client, invocation(id, 1, 3, true)); r.err != nil {
		t.Fatalf("slot not released: %v", r.err)
	}
}

// TestBackboneDown: JetStream goes away mid-stream. The stream must end with
// UNAVAILABLE (Bazel retries it), and no event the backbone did not store may
// be acknowledged.
func TestBackboneDown(t *testing.T) {
	t.Parallel()
	ns := testenv.NATS(t)
	b := connectBackbone(t, ns, time.Second)
	e := startEdge(t, b, Config{})
	ctx := testCtx(t)
	id := defaultIDs()
	subject := subjects.BES(testProject, id.invocation)

	st, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, req := range invocation(id, 1, 50, false) {
		if err := st.Send(req); err != nil {
			t.Fatal(err)
		}
	}
	poll.Until(t, "50 events stored", func() bool { return b.count(t, subject) == 50 })
	ns.Shutdown()
	ns.WaitForShutdown()
	for _, req := range invocation(id, 51, 80, true) {
		if err := st.Send(req); err != nil {
			break
		}
	}
	st.CloseSend()
	r := readAcks(st)
	wantCode(t, r.err, codes.Unavailable)
	checkAckPrefix(t, id, r.acks, 1)
	if len(r.acks) > 50 {
		t.Fatalf("%d acks: events 51.. were acknowledged while the backbone was down", len(r.acks))
	}
	poll.Until(t, "the stream to close", func() bool { return e.openStreams() == 0 })

	// With the backbone still down a new stream is UNAVAILABLE too, never
	// INVALID_ARGUMENT or FAILED_PRECONDITION: its resume point cannot be
	// checked. Bazel's stream has no deadline, so this one has none either
	// (only a watchdog): the edge must give up on its own.
	nctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	watchdog := time.AfterFunc(20*time.Second, cancel)
	defer watchdog.Stop()
	start := time.Now()
	r = publish(nctx, t, e.client, invocation(id, int64(len(r.acks))+1, 80, true))
	if c := r.code(); c != codes.Unavailable {
		t.Fatalf("resume while the backbone is down: %v after %v, want UNAVAILABLE", r.err, time.Since(start))
	}
	_, err = e.client.PublishLifecycleEvent(nctx, attemptFinished(id))
	wantCode(t, err, codes.Unavailable)
}

// TestBackboneRestart: JetStream restarts mid-stream (same store); Bazel's
// retry resumes at the first unacknowledged event and the invocation ends
// up stored exactly once.
func TestBackboneRestart(t *testing.T) {
	t.Parallel()
	id := defaultIDs()
	seqs := backboneRestart(t, id, 1000)
	checkOnceEach(t, seqs, 1001)
	if !sorted(seqs) {
		// A known bug (TestBackboneRestartKeepsOrder): logged here so that
		// this test stays about exactly-once.
		t.Logf("events stored out of sequence order: %s", disorder(seqs))
	}
}

// TestBackboneRestartKeepsOrder: after a backbone restart the stream must
// hold an invocation's events in sequence order. It does not today: events
// published while the edge's NATS connection was reconnecting sit in the
// client's reconnect buffer and are stored after the restart, while the
// ones in flight at the disconnect were lost, so the resend of those lands
// after later events (7 runs in 10 here). See the report; the fix is
// nats.ReconnectBufSize(-1) on the edge's connection (0 runs in 10).
func TestBackboneRestartKeepsOrder(t *testing.T) {
	for run := range 5 {
		id := defaultIDs()
		id.invocation = fmt.Sprintf("order-%d", run)
		seqs := backboneRestart(t, id, 2000)
		checkOnceEach(t, seqs, 2001)
		if !sorted(seqs) {
			t.Fatalf("run %d: events stored out of sequence order: %s", run, disorder(seqs))
		}
	}
}

// backboneRestart streams events 1..n and a finish, with a client that
// reads acks as they come (as Bazel's gRPC client does), shuts JetStream
// down once some events are stored, restarts it on the same store and port,
// and resends from the first unacknowledged event until the edge takes the
// resend. It returns the tool-event sequences stored, in stream order.
func backboneRestart(t *testing.T, id ids, n int64) []int64 {
	t.Helper()
	dir := t.TempDir()
	ns := testenv.NATSAt(t, dir, -1)
	port := ns.Addr().(*net.TCPAddr).Port
	b := connectBackbone(t, ns, time.Second)
	e := startEdge(t, b, Config{})
	ctx := testCtx(t)
	subject := subjects.BES(id.project, id.invocation)

	st, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	acked := make(chan result, 1)
	go func() { acked <- readAcks(st) }()
	// The last tenth waits for the shutdown, so that the stream is still
	// open when the backbone goes.
	down := make(chan struct{})
	go func() {
		defer st.CloseSend()
		reqs := invocation(id, 1, n, true)
		tail := len(reqs) - len(reqs)/10 - 1
		for i, req := range reqs {
			if i == tail {
				<-down
			}
			if st.Send(req) != nil {
				return
			}
		}
	}()
	poll.Until(t, "some events stored", func() bool { return b.count(t, subject) >= uint64(n/4) })
	ns.Shutdown()
	ns.WaitForShutdown()
	close(down)
	r := <-acked
	wantCode(t, r.err, codes.Unavailable)
	checkAckPrefix(t, id, r.acks, 1)

	testenv.NATSAt(t, dir, port)
	poll.Until(t, "the edge to reconnect", func() bool { return b.nc.IsConnected() })

	// Every event acknowledged before the crash survived it.
	held := map[int64]bool{}
	for _, s := range b.toolSeqs(t, subject) {
		held[s] = true
	}
	for _, ack := range r.acks {
		if !held[ack.GetSequenceNumber()] {
			t.Fatalf("event %d was acknowledged but is not stored", ack.GetSequenceNumber())
		}
	}

	// Bazel retries from the first unacknowledged event.
	from := int64(len(r.acks)) + 1
	var res result
	poll.Until(t, "a retry to succeed", func() bool {
		res = publish(ctx, t, e.client, invocation(id, from, n, true))
		if res.err != nil && res.code() != codes.Unavailable {
			t.Fatalf("retry from %d: %v", from, res.err)
		}
		return res.err == nil
	})
	checkAcks(t, id, res.acks, from, n+1)
	return b.toolSeqs(t, subject)
}

func checkOnceEach(t *testing.T, seqs []int64, n int64) {
	t.Helper()
	seen := map[int64]int{}
	for _, s := range seqs {
		seen[s]++
	}
	for s := int64(1); s <= n; s++ {
		if seen[s] != 1 {
			t.Fatalf("event %d stored %d times", s, seen[s])
		}
	}
	if int64(len(seqs)) != n {
		t.Fatalf("%d events stored, want %d", len(seqs), n)
	}
}

func sorted(seqs []int64) bool {
	for i, s := range seqs {
		if s != int64(i+1) {
			return false
		}
	}
	return true
}

// disorder shows where seqs first leaves sequence order.
func disorder(seqs []int64) string {
	for i, s := range seqs {
		if s != int64(i+1) {
			return fmt.Sprintf("event %d stored where %d belongs: ...%v...", s, i+1, seqs[max(0, i-3):min(len(seqs), i+5)])
		}
	}
	return "in order"
}

// TestLongIDs: ids go into the subject, and a subject too long for the NATS
// control line (4 KiB) makes the server drop the edge's connection for good
// (nats.go does not reconnect after "maximum control line exceeded"): one
// request would take the edge off the backbone. Ids that long must be
// refused with INVALID_ARGUMENT before anything is published.
func TestLongIDs(t *testing.T) {
	long := strings.Repeat("x", 5000)
	cases := []struct {
		name string
		do   func(ctx context.Context, c buildpb.PublishBuildEventClient) error
	}{
		{"tool invocation id", func(ctx context.Context, c buildpb.PublishBuildEventClient) error {
			id := defaultIDs()
			id.invocation = long
			return publish(ctx, t, c, invocation(id, 1, 2, true)).err
		}},
		{"tool project id", func(ctx context.Context, c buildpb.PublishBuildEventClient) error {
			id := defaultIDs()
			id.project = long
			return publish(ctx, t, c, invocation(id, 1, 2, true)).err
		}},
		{"lifecycle build id", func(ctx context.Context, c buildpb.PublishBuildEventClient) error {
			id := defaultIDs()
			id.build = long
			_, err := c.PublishLifecycleEvent(ctx, enqueued(id))
			return err
		}},
		{"lifecycle invocation id", func(ctx context.Context, c buildpb.PublishBuildEventClient) error {
			id := defaultIDs()
			id.invocation = strings.Repeat("*", 1500) // 4.5 KiB once encoded
			_, err := c.PublishLifecycleEvent(ctx, attemptStarted(id))
			return err
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			b, e := newTest(t, Config{})
			ctx := testCtx(t)
			if err := c.do(ctx, e.client); status.Code(err) != codes.InvalidArgument {
				t.Errorf("got %v, want INVALID_ARGUMENT", err)
			}
			if b.nc.IsClosed() {
				t.Fatalf("the edge's NATS connection is closed: %v", b.nc.LastError())
			}
			id := defaultIDs()
			if r := publish(ctx, t, e.client, invocation(id, 1, 2, true)); r.err != nil {
				t.Fatalf("a normal stream afterwards: %v", r.err)
			}
		})
	}
}

// TestLargeInvocation streams a few thousand events with a client that reads
// acks while it sends, as Bazel's gRPC client does. (A client that reads no
// ack before it half-closes stalls after ~600 events: the acks fill its
// HTTP/2 receive window, the edge stops reading at MaxInFlight, and the
// client's sends block.)
func TestLargeInvocation(t *testing.T) {
	t.Parallel()
	b, e := newTest(t, Config{MaxInFlight: 64})
	ctx := testCtx(t)
	id := defaultIDs()
	const n = 3000
	st, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	acked := make(chan result, 1)
	go func() { acked <- readAcks(st) }()
	for _, req := range invocation(id, 1, n, true) {
		if err := st.Send(req); err != nil {
			t.Fatalf("send: %v", err)
		}
	}
	st.CloseSend()
	r := <-acked
	if r.err != nil {
		t.Fatal(r.err)
	}
	checkAcks(t, id, r.acks, 1, n+1)
	checkExactlyOnce(t, b, subjects.BES(testProject, id.invocation), n+1)
}

// TestSameInvocationTwoProjects: two projects that use the same invocation
// id each get their events stored. Nats-Msg-Id is <invocation>/<sequence>
// and deduplicates across the whole stream, so today the second project's
// events are acknowledged and dropped as duplicates of the first's.
func TestSameInvocationTwoProjects(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	for _, project := range []string{"alpha", "beta"} {
		id := defaultIDs()
		id.project = project
		if r := publish(ctx, t, e.client, invocation(id, 1, 3, true)); r.err != nil {
			t.Fatal(r.err)
		}
	}
	for _, project := range []string{"alpha", "beta"} {
		if n := b.count(t, subjects.BES(project, testInvocation)); n != 4 {
			t.Errorf("project %s holds %d events of the invocation, want 4", project, n)
		}
	}
}

// TestIDsThatHeadersMangle: NATS header values are trimmed and have CR/LF
// replaced by spaces, so ids that differ only there must not share a
// Nats-Msg-Id (Bazel's ids are UUIDs; other BES clients' need not be).
func TestIDsThatHeadersMangle(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	invs := []string{"inv x", "inv\nx", " inv x"}
	for _, inv := range invs {
		id := defaultIDs()
		id.invocation = inv
		if r := publish(ctx, t, e.client, invocation(id, 1, 2, true)); r.err != nil {
			t.Fatal(r.err)
		}
	}
	for _, inv := range invs {
		if n := b.count(t, subjects.BES(testProject, inv)); n != 3 {
			t.Errorf("invocation %q: %d events stored, want 3", inv, n)
		}
	}
}

// TestIDsNotText: an id that holds a NUL byte is refused before it is
// stored: the projection keeps ids as text, and would keep another id
// than the one the build's subject (and partition) were made of. (One that
// is not valid UTF-8 does not get through protobuf's own checks.)
func TestIDsNotText(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	for _, bad := range []string{"inv\x00x", "\x00"} {
		id := defaultIDs()
		id.invocation = bad
		r := publish(ctx, t, e.client, invocation(id, 1, 2, true))
		if status.Code(r.err) != codes.InvalidArgument || !strings.Contains(r.err.Error(), "not valid UTF-8 without NUL") {
			t.Errorf("invocation %q: %v, want INVALID_ARGUMENT", bad, r.err)
		}
		if n := b.count(t, subjects.BES(testProject, bad)); n != 0 {
			t.Errorf("invocation %q: %d events stored", bad, n)
		}
	}
}

func TestSubjectTokens(t *testing.T) {
	b, e := newTest(t, Config{})
	ctx := testCtx(t)
	id := ids{build: "build.with.dots", invocation: "inv*with>wild cards.and.dots", project: "a.b c"}
	if r := publish(ctx, t, e.client, invocation(id, 1, 2, true)); r.err != nil {
		t.Fatal(r.err)
	}
	if _, err := e.client.PublishLifecycleEvent(ctx, enqueued(id)); err != nil {
		t.Fatal(err)
	}
	ctx2, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	info, err := b.stream.Info(ctx2, jetstream.WithSubjectFilter(">"))
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]bool{}
	for subject := range info.State.Subjects {
		toks := strings.Split(subject, ".")
		if len(toks) != 3 || toks[0] != "bes" {
			t.Fatalf("subject %q is not bes.<project>.<id>", subject)
		}
		for _, tok := range toks[1:] {
			if strings.ContainsAny(tok, "*> \t\r\n") || tok == "" {
				t.Fatalf("subject %q has an unsafe token %q", subject, tok)
			}
		}
		project, ok1 := subjects.Untoken(toks[1])
		key, ok2 := subjects.Untoken(toks[2])
		if !ok1 || !ok2 {
			t.Fatalf("subject %q does not decode", subject)
		}
		if project != id.project {
			t.Fatalf("subject %q decodes to project %q", subject, project)
		}
		got[key] = true
		for _, m := range b.stored(t, subject) {
			if p := m.Header.Get(envelope.Project); p != id.project {
				t.Errorf("project header %q", p)
			}
			if v := m.Header.Get(envelope.BuildID); v != id.build {
				t.Errorf("build id header %q", v)
			}
		}
	}
	if !got[id.invocation] || !got[id.build] || len(got) != 2 {
		t.Fatalf("subjects decode to %v, want the invocation and the build", got)
	}
	if n := b.count(t, subjects.BES(id.project, id.invocation)); n != 3 {
		t.Fatalf("%d tool events stored", n)
	}
}
