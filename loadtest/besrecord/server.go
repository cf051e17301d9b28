package besrecord

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"time"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/emptypb"
)

// Service implements google.devtools.build.v1.PublishBuildEvent by appending every request to a Writer
// and acknowledging it. It interprets nothing beyond what the protocol needs, so that a recording holds
// exactly what the client sent.
//
// Every request is written before it is acknowledged: a client that saw an ack knows the request is in
// the recording. Bazel does not wait for acks while it sends, so acking each event as it arrives costs
// nothing.
type Service struct {
	buildpb.UnimplementedPublishBuildEventServer

	mu    sync.Mutex
	w     *Writer
	stats Stats
}

// Stats counts what a Service has recorded.
type Stats struct {
	Lifecycle int // PublishLifecycleEvent requests
	Streams   int // PublishBuildToolEventStream calls
	Events    int // stream requests (bazel_event and ComponentStreamFinished alike)
}

// NewService returns a Service that records to w. Writes to w are serialised.
func NewService(w io.Writer) *Service { return &Service{w: NewWriter(w)} }

// Stats returns the counts so far.
func (s *Service) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.stats
}

// PublishLifecycleEvent records the request and returns OK.
func (s *Service) PublishLifecycleEvent(ctx context.Context, req *buildpb.PublishLifecycleEventRequest) (*emptypb.Empty, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.w.WriteLifecycle(req); err != nil {
		// UNAVAILABLE, not FAILED_PRECONDITION: Bazel retries the former and gives up on the latter.
		return nil, status.Errorf(codes.Unavailable, "recorder cannot store the event: %v", err)
	}
	s.stats.Lifecycle++
	return &emptypb.Empty{}, nil
}

// PublishBuildToolEventStream records each request and acknowledges it, in order, with the stream id and
// sequence number it carried: that pair is what Bazel checks an ack against.
//
// Within one call the sequence numbers must be consecutive. The first one may be anything, because Bazel
// resumes on a new call from its first unacknowledged event after an error.
func (s *Service) PublishBuildToolEventStream(stream buildpb.PublishBuildEvent_PublishBuildToolEventStreamServer) error {
	s.mu.Lock()
	s.stats.Streams++
	s.mu.Unlock()

	var last int64 // 0: nothing received yet (Bazel numbers from 1)
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			// The client half-closed. Everything it sent has been acked, so OK is the right answer.
			return nil
		}
		if err != nil {
			return err
		}
		obe := req.GetOrderedBuildEvent()
		if obe == nil || obe.GetStreamId() == nil {
			return status.Error(codes.InvalidArgument, "ordered_build_event with a stream_id is required")
		}
		seq := obe.GetSequenceNumber()
		if last != 0 && seq != last+1 {
			return status.Errorf(codes.InvalidArgument, "sequence_number %d after %d: events must be consecutive within a stream", seq, last)
		}
		last = seq

		s.mu.Lock()
		err = s.w.WriteStream(req)
		if err == nil {
			s.stats.Events++
		}
		s.mu.Unlock()
		if err != nil {
			return status.Errorf(codes.Unavailable, "recorder cannot store the event: %v", err)
		}

		if err := stream.Send(&buildpb.PublishBuildToolEventStreamResponse{
			StreamId:       obe.GetStreamId(),
			SequenceNumber: seq,
		}); err != nil {
			return err
		}
	}
}

// Recorder is a running gRPC server with a Service that records to a file.
type Recorder struct {
	*Service
	lis  net.Listener
	srv  *grpc.Server
	file *os.File
	done chan error // Serve's result

	closeOnce sync.Once
	closeErr  error
}

// maxMessageSize lets the server take any event Bazel may send; gRPC's default of 4 MiB is below what a
// build with a huge command line or captured output can produce.
const maxMessageSize = 64 << 20

// Start listens on addr (host:port; port 0 picks a free one), creates or truncates the file at out, and
// serves until Close.
func Start(addr, out string) (*Recorder, error) {
	f, err := os.Create(out)
	if err != nil {
		return nil, err
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		f.Close()
		return nil, err
	}
	r := &Recorder{
		Service: NewService(f),
		lis:     lis,
		srv:     grpc.NewServer(grpc.MaxRecvMsgSize(maxMessageSize)),
		file:    f,
		done:    make(chan error, 1),
	}
	buildpb.RegisterPublishBuildEventServer(r.srv, r.Service)
	go func() { r.done <- r.srv.Serve(lis) }()
	return r, nil
}

// Addr is the address the server listens on, as host:port; Bazel takes it as --bes_backend=grpc://ADDR.
func (r *Recorder) Addr() string { return r.lis.Addr().String() }

// closeGrace bounds how long Close waits for calls in flight before it cuts them.
const closeGrace = 10 * time.Second

// Close stops accepting calls, waits up to a few seconds for calls in flight, and closes the file.
// Calling it again returns the first call's result.
func (r *Recorder) Close() error {
	r.closeOnce.Do(func() { r.closeErr = r.close() })
	return r.closeErr
}

func (r *Recorder) close() error {
	stopped := make(chan struct{})
	go func() { r.srv.GracefulStop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(closeGrace):
		r.srv.Stop()
		<-stopped
	}
	serveErr := <-r.done
	if errors.Is(serveErr, grpc.ErrServerStopped) {
		serveErr = nil
	}
	closeErr := r.file.Close()
	if serveErr != nil {
		return fmt.Errorf("besrecord: serve: %w", serveErr)
	}
	return closeErr
}
