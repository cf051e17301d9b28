// Command besfloor is the floor under the BES edge's cost: a Build Event
// Service server with the edge's gRPC options and collector pacing that
// acknowledges every event as soon as gRPC has read it, and does nothing
// else (no JetStream, no decoding, no limits per project). The bench runs
// it under the same paced load as the edge (scenario grpc-floor) to show
// how much of the edge's CPU and memory per stream is gRPC's and the Go
// runtime's own, which no change to the edge can remove.
//
// Usage:
//
//	besfloor -listen 127.0.0.1:8985 -http 127.0.0.1:9090
//
// It serves /metrics (millrace_bes_streams_open, millrace_bes_events_total
// and the Go runtime's figures, as the edge names them) and /readyz on -http, and stops on
// SIGINT or SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/emptypb"

	"github.com/millrace/millrace/internal/gcpace"
	"github.com/millrace/millrace/services/bes"
)

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "besfloor:", err)
		os.Exit(1)
	}
}

func run() error {
	listen := flag.String("listen", "127.0.0.1:8985", "gRPC address for Bazel's --bes_backend")
	httpAddr := flag.String("http", "127.0.0.1:9090", "address of /metrics and /readyz")
	flag.Usage = func() {
		fmt.Fprintf(flag.CommandLine.Output(), "usage: besfloor [-listen addr] [-http addr]\n\n"+
			"A BES server that acknowledges every event at once, with the edge's gRPC\n"+
			"options and collector pacing: the floor under the edge's cost (bench scenario grpc-floor).\n\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() > 0 {
		flag.Usage()
		return fmt.Errorf("unexpected arguments %q", flag.Args())
	}
	// The edge's collector pacing (cmd/millrace paces every service with
	// its default headroom), so that the memory figures compare.
	gcpace.Start(gcpace.Config{})
	lis, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	hl, err := net.Listen("tcp", *httpAddr)
	if err != nil {
		lis.Close()
		return err
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	return serve(ctx, lis, hl)
}

// serve answers BES on lis and /metrics and /readyz on hl until ctx ends.
func serve(ctx context.Context, lis, hl net.Listener) error {
	// The edge's own options, taken from the edge: the same buffers,
	// windows, keepalive and receive limit.
	edge, err := bes.New(bes.Config{}, nil, nil, nil, slog.Default())
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	open := prometheus.NewGauge(prometheus.GaugeOpts{Name: "millrace_bes_streams_open", Help: "Build tool event streams open."})
	events := prometheus.NewCounter(prometheus.CounterOpts{Name: "millrace_bes_events_total", Help: "Build tool events acknowledged."})
	reg.MustRegister(open, events)

	g := grpc.NewServer(edge.ServerOptions()...)
	buildpb.RegisterPublishBuildEventServer(g, &floor{open: open, events: events})
	mux := http.NewServeMux()
	mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) { io.WriteString(w, "ok\n") })
	hs := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	go hs.Serve(hl)
	defer hs.Close()

	errC := make(chan error, 1)
	go func() { errC <- g.Serve(lis) }()
	select {
	case err := <-errC:
		return err
	case <-ctx.Done():
	}
	g.Stop()
	if err := <-errC; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}

// floor acknowledges each event as it comes: what a stream costs in gRPC
// alone.
type floor struct {
	buildpb.UnimplementedPublishBuildEventServer
	open   prometheus.Gauge
	events prometheus.Counter
}

func (*floor) PublishLifecycleEvent(context.Context, *buildpb.PublishLifecycleEventRequest) (*emptypb.Empty, error) {
	return &emptypb.Empty{}, nil
}

func (f *floor) PublishBuildToolEventStream(st buildpb.PublishBuildEvent_PublishBuildToolEventStreamServer) error {
	f.open.Inc()
	defer f.open.Dec()
	for {
		req, err := st.Recv()
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
		ev := req.GetOrderedBuildEvent()
		f.events.Inc()
		if err := st.Send(&buildpb.PublishBuildToolEventStreamResponse{StreamId: ev.GetStreamId(), SequenceNumber: ev.GetSequenceNumber()}); err != nil {
			return err
		}
	}
}
