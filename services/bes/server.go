package bes

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/grpclimit"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// APIKeyHeader is the gRPC metadata key that carries an API key (newer
// Bazel: --bes_header=x-millrace-api-key=KEY). Bazel 4.2.3 has no
// --bes_header, so the key may also be given as --project_id.
const APIKeyHeader = "x-millrace-api-key"

// Server implements google.devtools.build.v1.PublishBuildEvent.
type Server struct {
	buildpb.UnimplementedPublishBuildEventServer

	cfg    Config
	pub    *streams.Publisher
	stream jetstream.Stream
	// layout is where builds' events go (subjects.BESLayout), parts the
	// partitions' streams when it has several (UseLayout).
	layout subjects.BESLayout
	parts  []jetstream.Stream
	log    *slog.Logger
	m      *Metrics
	opts   []grpc.ServerOption

	mu         sync.Mutex
	open       int
	perProject map[string]int
	// unauthenticated counts streams waiting for their first request; it
	// is capped at MaxStreams too, so that streams that never say who they
	// are cannot pile up behind the first-message deadline, and per client
	// address (pendingByAddr) at MaxPendingPerAddr, so that one host's
	// cannot fill that cap for everyone.
	unauthenticated int
	pendingByAddr   map[string]int
}

// New makes the edge. stream is the BES stream, used to find where a
// resumed stream left off (nil: not resumed; tests); New checks
// MaxEventBytes against its largest message.
func New(cfg Config, pub *streams.Publisher, stream jetstream.Stream, m *Metrics, log *slog.Logger) (*Server, error) {
	var maxMsg int64
	if stream != nil {
		maxMsg = int64(stream.CachedInfo().Config.MaxMsgSize)
	}
	if err := cfg.Validate(maxMsg); err != nil {
		return nil, err
	}
	cfg = cfg.withDefaults()
	opts, err := grpclimit.ServerOptions(grpclimit.Config{MaxStreamsPerConn: uint32(cfg.MaxStreamsPerConn)})
	if err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.Default()
	}
	return &Server{cfg: cfg, pub: pub, stream: stream, m: m, log: log, perProject: map[string]int{},
		opts: append(opts, grpc.MaxRecvMsgSize(max(cfg.MaxEventBytes, cfg.asked)+streams.HeaderRoom),
			grpc.ReadBufferSize(bufferBytes), grpc.WriteBufferSize(bufferBytes), grpc.SharedWriteBuffer(true),
			grpc.StaticStreamWindowSize(windowBytes), grpc.StaticConnWindowSize(windowBytes))}, nil
}

// Register adds the service to a gRPC server.
func (s *Server) Register(g *grpc.Server) { buildpb.RegisterPublishBuildEventServer(g, s) }

// ServerOptions are the gRPC options the edge needs: a receive limit a
// little above the event limit, so that an oversized event reaches the
// handler and gets a clear INVALID_ARGUMENT rather than a transport error;
// the streams one connection may hold; the handshake deadline and the
// keepalive every millrace server has (which finds clients that vanished
// without closing their streams); and the buffers and flow-control windows
// below.
func (s *Server) ServerOptions() []grpc.ServerOption { return slices.Clone(s.opts) }

// Each Bazel client holds its own connection, mostly idle (an event every
// few hundred milliseconds), so the edge holds thousands of them.
//   - bufferBytes: gRPC's default read buffer is 32 KiB per connection,
//     live for the connection's life, and so is its write buffer; a
//     Bazel event is a few hundred bytes to a few KiB (a larger one is read
//     straight into its message) and an ack some forty bytes, so 4 KiB
//     holds a hundred acks per write.
//   - SharedWriteBuffer: the write buffer goes back to a pool after each
//     flush instead of staying with the connection.
//   - windowBytes: a static window turns off gRPC's bandwidth estimation,
//     which on a paced stream sent a PING (and read its ack) after nearly
//     every event received. 1 MiB per stream is far above what a stream on
//     loopback or a LAN needs to be read at full speed, and a larger event
//     still arrives whole (gRPC widens the window for a message that
//     exceeds it).
const (
	bufferBytes = 4 << 10
	windowBytes = 1 << 20
)

// MaxIDBytes bounds project, build and invocation ids: they become subject
// tokens, and a subject beyond NATS's 4 KiB control line would cost the
// edge its connection. Bazel's ids are 36-byte UUIDs.
const MaxIDBytes = 512

func checkIDs(ids ...string) error {
	for _, id := range ids {
		if len(id) > MaxIDBytes {
			return status.Errorf(codes.InvalidArgument, "millrace: an id of %d bytes is longer than the limit of %d", len(id), MaxIDBytes)
		}
		// The projector stores ids as text, which holds neither: it would
		// store another id than the one the build's subject and partition
		// were made of (subjects.BESLayout).
		if !utf8.ValidString(id) || strings.IndexByte(id, 0) >= 0 {
			return status.Errorf(codes.InvalidArgument, "millrace: the id %q is not valid UTF-8 without NUL bytes", id)
		}
	}
	return nil
}

// authorize returns the project a request may publish to.
func (s *Server) authorize(ctx context.Context, projectID string) (string, error) {
	if s.cfg.Keys.Len() == 0 {
		if projectID == "" {
			return s.cfg.DefaultProject, nil
		}
		return projectID, nil
	}
	if md, ok := metadata.FromIncomingContext(ctx); ok {
		if v := md.Get(APIKeyHeader); len(v) > 0 && v[0] != "" {
			project, ok := s.cfg.Keys.Project(v[0])
			if !ok {
				return "", status.Error(codes.Unauthenticated, "millrace: the API key in "+APIKeyHeader+" is not valid")
			}
			if projectID != "" && projectID != project {
				return "", status.Errorf(codes.PermissionDenied, "millrace: this API key may publish to project %q, not to %q", project, projectID)
			}
			return project, nil
		}
	}
	if projectID != "" {
		if project, ok := s.cfg.Keys.Project(projectID); ok {
			return project, nil
		}
	}
	return "", status.Error(codes.Unauthenticated,
		"millrace: this server requires an API key: pass it as --project_id=KEY (Bazel 4) or --bes_header="+APIKeyHeader+"=KEY")
}

// enter counts a stream of the client at addr that has not authenticated
// yet; leave undoes it.
func (s *Server) enter(addr string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.unauthenticated >= s.cfg.MaxStreams {
		return status.Errorf(codes.ResourceExhausted, "millrace: %d streams are waiting to send their first event; retry later", s.unauthenticated)
	}
	if s.pendingByAddr[addr] >= s.cfg.MaxPendingPerAddr {
		return status.Errorf(codes.ResourceExhausted, "millrace: your address holds %d streams that have not sent their first event; retry later", s.pendingByAddr[addr])
	}
	if s.pendingByAddr == nil {
		s.pendingByAddr = map[string]int{}
	}
	s.unauthenticated++
	s.pendingByAddr[addr]++
	return nil
}

func (s *Server) leave(addr string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.unauthenticated--
	if s.pendingByAddr[addr]--; s.pendingByAddr[addr] <= 0 {
		delete(s.pendingByAddr, addr)
	}
}

// clientAddr is the IP a stream comes from ("" when unknown).
func clientAddr(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ""
	}
	if host, _, err := net.SplitHostPort(p.Addr.String()); err == nil {
		return host
	}
	return p.Addr.String()
}

func (s *Server) acquire(project string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.open >= s.cfg.MaxStreams {
		return status.Errorf(codes.ResourceExhausted, "millrace: the server is at its limit of %d open build event streams; retry later", s.cfg.MaxStreams)
	}
	if s.perProject[project] >= s.cfg.MaxStreamsPerProject {
		return status.Errorf(codes.ResourceExhausted, "millrace: project %q is at its limit of %d open build event streams; retry later", project, s.cfg.MaxStreamsPerProject)
	}
	s.open++
	s.perProject[project]++
	s.m.streamsOpen.Set(float64(s.open))
	return nil
}

func (s *Server) release(project string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.open--
	if s.perProject[project]--; s.perProject[project] == 0 {
		delete(s.perProject, project)
	}
	s.m.streamsOpen.Set(float64(s.open))
}

// PublishLifecycleEvent stores one lifecycle event and returns once it is
// stored.
func (s *Server) PublishLifecycleEvent(ctx context.Context, req *buildpb.PublishLifecycleEventRequest) (*emptypb.Empty, error) {
	project, err := s.authorize(ctx, req.GetProjectId())
	if err != nil {
		s.m.rejected("lifecycle", status.Code(err))
		return nil, err
	}
	obe := req.GetBuildEvent()
	if err := checkIDs(project, obe.GetStreamId().GetBuildId(), obe.GetStreamId().GetInvocationId()); err != nil {
		s.m.rejected("lifecycle", codes.InvalidArgument)
		return nil, err
	}
	if err := checkLifecycle(obe); err != nil {
		s.m.rejected("lifecycle", codes.InvalidArgument)
		return nil, err
	}
	if size := proto.Size(obe); size > s.cfg.MaxEventBytes {
		s.m.rejected("lifecycle", codes.InvalidArgument)
		return nil, status.Errorf(codes.InvalidArgument, "millrace: lifecycle event of %d bytes exceeds the limit of %d bytes (%s)", size, s.cfg.MaxEventBytes, s.cfg.raise())
	}
	sid := obe.GetStreamId()
	key := sid.GetInvocationId()
	if key == "" {
		key = sid.GetBuildId() // build-level events (enqueued, finished) name no invocation
	}
	msg, err := s.message(project, envelope.KindLifecycle, obe,
		"lc/"+subjects.Token(project)+"/"+subjects.Token(sid.GetBuildId())+"/"+subjects.Token(sid.GetInvocationId())+"/"+strconv.FormatInt(obe.GetSequenceNumber(), 10),
		s.layout.Subject(project, key))
	if err != nil {
		return nil, err
	}
	if err := s.pub.Publish(ctx, msg); err != nil {
		s.m.rejected("lifecycle", codes.Unavailable)
		return nil, unavailable(err)
	}
	s.m.events.WithLabelValues("lifecycle").Inc()
	return &emptypb.Empty{}, nil
}

func checkLifecycle(obe *buildpb.OrderedBuildEvent) error {
	switch {
	case obe == nil:
		return status.Error(codes.InvalidArgument, "millrace: lifecycle request has no build_event")
	case obe.GetStreamId().GetBuildId() == "":
		return status.Error(codes.InvalidArgument, "millrace: lifecycle event has no stream_id.build_id")
	case obe.GetSequenceNumber() <= 0:
		return status.Errorf(codes.InvalidArgument, "millrace: lifecycle event has sequence number %d; they start at 1", obe.GetSequenceNumber())
	}
	switch obe.GetEvent().GetEvent().(type) {
	case *buildpb.BuildEvent_BuildEnqueued_, *buildpb.BuildEvent_BuildFinished_,
		*buildpb.BuildEvent_InvocationAttemptStarted_, *buildpb.BuildEvent_InvocationAttemptFinished_:
		return nil
	default:
		return status.Errorf(codes.InvalidArgument, "millrace: %T is not a lifecycle event", obe.GetEvent().GetEvent())
	}
}

func (s *Server) message(project, kind string, obe *buildpb.OrderedBuildEvent, msgID, subject string) (*nats.Msg, error) {
	if err := s.redact(obe); err != nil { // before anything is stored: see redaction.go
		return nil, err
	}
	data, err := proto.Marshal(obe)
	if err != nil {
		return nil, status.Errorf(codes.InvalidArgument, "millrace: cannot encode event: %v", err)
	}
	sid := obe.GetStreamId()
	msg := &nats.Msg{Subject: subject, Data: data, Header: nats.Header{
		envelope.MsgID:        {msgID},
		envelope.Schema:       {envelope.SchemaBESv1},
		envelope.Kind:         {kind},
		envelope.Project:      {project},
		envelope.BuildID:      {sid.GetBuildId()},
		envelope.InvocationID: {sid.GetInvocationId()},
		envelope.Sequence:     {strconv.FormatInt(obe.GetSequenceNumber(), 10)},
	}}
	return msg, nil
}

func unavailable(err error) error {
	return status.Errorf(codes.Unavailable, "millrace: could not store the event, retry: %v", err)
}

// inflight is one event published and not yet acknowledged to the client.
type inflight struct {
	future   *streams.Future
	streamID *buildpb.StreamId
	seq      int64
	received time.Time
}

// PublishBuildToolEventStream receives one invocation's events, publishes
// each and acks each once stored, in order.
func (s *Server) PublishBuildToolEventStream(stream buildpb.PublishBuildEvent_PublishBuildToolEventStreamServer) error {
	ctx, cancel := context.WithCancel(stream.Context())
	defer cancel()

	// A key in the headers is checked before anything is read: a client
	// with a wrong one holds nothing. Bazel 4 sends its key in the first
	// request instead, which must come within FirstMessageTimeout.
	authed, err := s.preauthorize(ctx)
	if err != nil {
		s.m.rejected("stream", status.Code(err))
		return err
	}
	addr := clientAddr(ctx)
	if !authed {
		if err := s.enter(addr); err != nil {
			s.m.rejected("stream", codes.ResourceExhausted)
			return err
		}
	}
	first, err := s.recvFirst(stream)
	if !authed {
		s.leave(addr)
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			return nil
		}
		if status.Code(err) == codes.DeadlineExceeded {
			s.m.rejected("stream", codes.DeadlineExceeded)
		}
		return err
	}
	project, err := s.authorize(ctx, first.GetProjectId())
	if err != nil {
		s.m.rejected("stream", status.Code(err))
		return err
	}
	if err := s.acquire(project); err != nil {
		s.m.rejected("stream", codes.ResourceExhausted)
		return err
	}
	defer s.release(project)

	ts := &toolStream{s: s, project: project}
	if err := ts.start(ctx, first); err != nil {
		s.m.rejected("stream", status.Code(err))
		return err
	}

	acks := newAckQueue(s.cfg.MaxInFlight)
	recvDone := make(chan error, 1)
	go func() {
		err := ts.receive(ctx, stream, first, acks)
		acks.close()
		recvDone <- err
	}()
	return s.ack(ctx, cancel, stream, ts, acks, recvDone)
}

// ack runs in the stream's handler while another goroutine receives (a
// Recv ends only when the handler returns): it acks each event once
// stored, in order, and watches the receiver and the client's silence. It
// returns nil when the client half-closed and all it sent is acked, or the
// error that ends the stream. Acking here rather than in a goroutine of its
// own saves each open stream a goroutine's stack.
func (s *Server) ack(ctx context.Context, cancel context.CancelFunc, stream buildpb.PublishBuildEvent_PublishBuildToolEventStreamServer,
	ts *toolStream, acks *ackQueue, recvDone <-chan error) error {
	idle := time.NewTimer(s.cfg.IdleTimeout)
	defer idle.Stop()
	var head inflight // the oldest event not acked, while storing is true
	storing := false
	for {
		if !storing {
			in, ok, done := acks.tryPop()
			if done {
				if recvDone == nil {
					return nil // the client half-closed and everything is acked
				}
				return s.received(<-recvDone)
			}
			head, storing = in, ok
		}
		var more <-chan struct{}
		var stored <-chan *jetstream.PubAck
		var failed <-chan error
		if storing {
			stored, failed = head.future.Ok(), head.future.Err()
		} else {
			more = acks.ready
		}
		select {
		case <-more:
		case ack := <-stored:
			head.future.Stored(ack)
			if err := stream.Send(&buildpb.PublishBuildToolEventStreamResponse{StreamId: head.streamID, SequenceNumber: head.seq}); err != nil {
				return err
			}
			s.m.ackSeconds.Observe(time.Since(head.received).Seconds())
			head, storing = inflight{}, false
		case err := <-failed:
			// Returning ends the stream, and with it the receiver's Recv.
			err = head.future.Failed(err)
			s.log.Warn("event not stored; client will retry", "invocation", head.streamID.GetInvocationId(), "seq", head.seq, "err", err)
			return unavailable(err)
		case err := <-recvDone:
			if err != nil {
				cancel()
				return s.received(err)
			}
			recvDone = nil // half-closed: ack the rest
		case <-idle.C:
			if !s.silent(ts, idle) {
				continue
			}
			cancel()
			s.m.rejected("stream", codes.DeadlineExceeded)
			return status.Errorf(codes.DeadlineExceeded,
				"millrace: the stream of invocation %s sent nothing for %s; closed (the client may resume it)", ts.streamID.GetInvocationId(), s.cfg.IdleTimeout)
		case <-ctx.Done():
			return status.FromContextError(ctx.Err()).Err()
		}
	}
}

// received is how the stream ends once its receiver returned err.
func (s *Server) received(err error) error {
	if err != nil {
		s.m.rejected("stream", status.Code(err))
	}
	return err
}

// silent reports whether the client has sent nothing for IdleTimeout; if
// not (the edge is busy with a request, or the client sent meanwhile), it
// sets idle to look again one timeout after the edge last began to wait.
func (s *Server) silent(ts *toolStream, idle *time.Timer) bool {
	waiting := ts.waitingSince.Load()
	if waiting != 0 && time.Since(time.Unix(0, waiting)) >= s.cfg.IdleTimeout {
		return true
	}
	next := s.cfg.IdleTimeout
	if waiting != 0 {
		next -= time.Since(time.Unix(0, waiting))
	}
	idle.Reset(max(next, time.Millisecond))
	return false
}

// preauthorize refuses a stream whose headers carry a key that is not
// valid, before its first request is read. It reports whether they carry a
// valid one: such a stream is authenticated and does not count among the
// streams waiting to say who they are.
func (s *Server) preauthorize(ctx context.Context) (bool, error) {
	if s.cfg.Keys.Len() == 0 {
		return false, nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get(APIKeyHeader); len(v) > 0 && v[0] != "" {
		_, err := s.authorize(ctx, "")
		return err == nil, err
	}
	return false, nil
}

// recvFirst reads a stream's first request, or gives up after
// FirstMessageTimeout. When it gives up the handler returns, which ends
// the stream and with it the Recv still waiting.
func (s *Server) recvFirst(stream buildpb.PublishBuildEvent_PublishBuildToolEventStreamServer) (*buildpb.PublishBuildToolEventStreamRequest, error) {
	type received struct {
		req *buildpb.PublishBuildToolEventStreamRequest
		err error
	}
	ch := make(chan received, 1)
	go func() {
		req, err := stream.Recv()
		ch <- received{req, err}
	}()
	t := time.NewTimer(s.cfg.FirstMessageTimeout)
	defer t.Stop()
	select {
	case r := <-ch:
		return r.req, r.err
	case <-t.C:
		return nil, status.Errorf(codes.DeadlineExceeded, "millrace: no build event within %s of opening the stream", s.cfg.FirstMessageTimeout)
	}
}

// toolStream checks one stream's requests.
type toolStream struct {
	s       *Server
	project string
	// projectID is the first request's project_id, as sent (it may be an
	// API key: never logged). Bazel repeats it on every request.
	projectID   string
	streamID    *buildpb.StreamId
	subject     string
	stored      jetstream.Stream // the stream of subject
	msgIDPrefix string
	next        int64 // sequence expected next
	finished    bool
	// waitingSince is when the edge began to wait for the client's next
	// request (UnixNano), 0 while it is busy with one: the idle timeout
	// counts only the client's silence.
	waitingSince atomic.Int64
}

// start checks the first request and finds where the stream stands: a
// stream that starts above 1 resumes one that broke (the edge may have
// restarted), and must continue right after what the backbone holds.
func (t *toolStream) start(ctx context.Context, first *buildpb.PublishBuildToolEventStreamRequest) error {
	obe := first.GetOrderedBuildEvent()
	sid := obe.GetStreamId()
	if sid.GetInvocationId() == "" || sid.GetBuildId() == "" {
		return status.Error(codes.InvalidArgument, "millrace: the stream's first event has no stream_id.build_id and invocation_id")
	}
	if err := checkIDs(t.project, sid.GetBuildId(), sid.GetInvocationId()); err != nil {
		return err
	}
	// Msg-Ids name the project too, so that two projects (tenants) using
	// the same invocation id never deduplicate each other's events, and
	// use subject tokens, which NATS header handling leaves intact.
	t.msgIDPrefix = subjects.Token(t.project) + "/" + subjects.Token(sid.GetInvocationId()) + "/"
	t.streamID = sid
	t.projectID = first.GetProjectId()
	t.subject = t.s.layout.Subject(t.project, sid.GetInvocationId())
	t.stored = t.s.streamOf(t.project, sid.GetInvocationId())
	seq := obe.GetSequenceNumber()
	if seq <= 0 {
		return status.Errorf(codes.InvalidArgument, "millrace: sequence number %d is impossible; streams start at 1", seq)
	}
	t.next = seq
	if seq == 1 {
		return nil
	}
	stored, err := t.lastStored(ctx)
	if err != nil {
		return err
	}
	if seq > stored+1 {
		return status.Errorf(codes.InvalidArgument,
			"millrace: invocation %s resumes at event %d but only events up to %d were stored: events %d-%d are missing",
			sid.GetInvocationId(), seq, stored, stored+1, seq-1)
	}
	return nil
}

// UseLayout makes the edge publish builds' events by a partitioned layout
// l, finding where a resumed stream left off in its partition's stream,
// parts[p]. Without it the edge publishes to the one stream BES.
func (s *Server) UseLayout(l subjects.BESLayout, parts []jetstream.Stream) error {
	if len(parts) != l.N() {
		return fmt.Errorf("bes: %d streams for %d partitions", len(parts), l.N())
	}
	s.layout, s.parts = l, parts
	return nil
}

// streamOf is the stream that holds a build's events.
func (s *Server) streamOf(project, invocation string) jetstream.Stream {
	if len(s.parts) == 0 {
		return s.stream
	}
	return s.parts[s.layout.Partition(project, invocation)]
}

// lastStored is the highest tool-event sequence the backbone holds for the
// stream's invocation (0 if none).
func (t *toolStream) lastStored(ctx context.Context) (int64, error) {
	// Bazel sets no deadline of its own: bound the lookup so that a client
	// hears UNAVAILABLE (and retries) while the backbone is away.
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	msg, err := t.stored.GetLastMsgForSubject(ctx, t.subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return 0, nil
	}
	if err != nil {
		return 0, unavailable(err)
	}
	if msg.Header.Get(envelope.Kind) != envelope.KindTool {
		return 0, nil // the invocation's lifecycle start: no tool event yet
	}
	n, err := strconv.ParseInt(msg.Header.Get(envelope.Sequence), 10, 64)
	if err != nil {
		return 0, status.Errorf(codes.Internal, "millrace: stored event has a bad %s header", envelope.Sequence)
	}
	return n, nil
}

// receive reads, checks and publishes requests until the client
// half-closes (nil) or a request is refused (a status error).
func (t *toolStream) receive(ctx context.Context, stream buildpb.PublishBuildEvent_PublishBuildToolEventStreamServer,
	req *buildpb.PublishBuildToolEventStreamRequest, acks *ackQueue) error {
	for {
		received := time.Now()
		if err := t.check(req); err != nil {
			return err
		}
		obe := req.GetOrderedBuildEvent()
		msg, err := t.s.message(t.project, envelope.KindTool, obe,
			t.msgIDPrefix+strconv.FormatInt(obe.GetSequenceNumber(), 10), t.subject)
		if err != nil {
			return err
		}
		f, err := t.s.pub.PublishAsync(msg)
		if err != nil {
			return unavailable(err)
		}
		t.s.m.events.WithLabelValues("tool").Inc()
		t.s.m.bytes.Add(float64(len(msg.Data)))
		if err := acks.push(ctx, inflight{future: f, streamID: obe.GetStreamId(), seq: obe.GetSequenceNumber(), received: received}); err != nil {
			return status.FromContextError(err).Err()
		}
		t.waitingSince.Store(time.Now().UnixNano())
		req, err = stream.Recv()
		t.waitingSince.Store(0)
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// check refuses what would fail again on a retry: a gap or repeat in the
// sequence, a change of stream or project, an event after the stream's
// end, an oversized or malformed event.
func (t *toolStream) check(req *buildpb.PublishBuildToolEventStreamRequest) error {
	obe := req.GetOrderedBuildEvent()
	if obe == nil {
		return status.Error(codes.InvalidArgument, "millrace: request has no ordered_build_event")
	}
	if size := proto.Size(obe); size > t.s.cfg.MaxEventBytes {
		return status.Errorf(codes.InvalidArgument, "millrace: event %d is %d bytes, over the limit of %d bytes (%s)",
			obe.GetSequenceNumber(), size, t.s.cfg.MaxEventBytes, t.s.cfg.raise())
	}
	sid := obe.GetStreamId()
	if sid.GetBuildId() != t.streamID.GetBuildId() || sid.GetInvocationId() != t.streamID.GetInvocationId() {
		return status.Error(codes.InvalidArgument, "millrace: the stream_id changed within one stream")
	}
	if p := req.GetProjectId(); p != "" && p != t.projectID {
		return status.Error(codes.InvalidArgument, "millrace: the project_id changed within one stream")
	}
	if t.finished {
		return status.Errorf(codes.InvalidArgument, "millrace: event %d follows component_stream_finished", obe.GetSequenceNumber())
	}
	if seq := obe.GetSequenceNumber(); seq != t.next {
		return status.Errorf(codes.InvalidArgument, "millrace: expected event %d of invocation %s, got %d", t.next, t.streamID.GetInvocationId(), seq)
	}
	switch ev := obe.GetEvent().GetEvent().(type) {
	case *buildpb.BuildEvent_BazelEvent:
		if ev.BazelEvent == nil || ev.BazelEvent.GetTypeUrl() == "" {
			return status.Errorf(codes.InvalidArgument, "millrace: event %d has an empty bazel_event", obe.GetSequenceNumber())
		}
		if err := wellFormed(ev.BazelEvent.GetValue()); err != nil {
			return status.Errorf(codes.InvalidArgument, "millrace: event %d: bazel_event is not a protocol buffer: %v", obe.GetSequenceNumber(), err)
		}
	case *buildpb.BuildEvent_ComponentStreamFinished:
		t.finished = true
	default:
		return status.Errorf(codes.InvalidArgument, "millrace: event %d: %T does not belong in a build tool event stream", obe.GetSequenceNumber(), ev)
	}
	t.next++
	return nil
}

// wellFormed walks protobuf wire format without decoding it, so malformed
// bytes are refused at the edge for a few nanoseconds per byte.
func wellFormed(b []byte) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		if !num.IsValid() {
			return fmt.Errorf("invalid field number %d", num)
		}
		b = b[n:]
		m := protowire.ConsumeFieldValue(num, typ, b)
		if m < 0 {
			return protowire.ParseError(m)
		}
		b = b[m:]
	}
	return nil
}
