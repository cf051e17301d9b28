// Command besrecord is a Build Event Service that records whatever Bazel sends to a file, for fixtures:
//
//	besrecord -listen 127.0.0.1:1985 -out build.besrec &
//	bazel build //... --bes_backend=grpc://127.0.0.1:1985 --bes_lifecycle_events
//
// It acknowledges every event and stops on SIGINT or SIGTERM. The file format is described in package
// github.com/millrace/millrace/loadtest/besrecord.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/signal"
	"syscall"

	"github.com/millrace/millrace/loadtest/besrecord"
)

type config struct {
	listen string
	out    string
}

func main() {
	var cfg config
	flag.StringVar(&cfg.listen, "listen", "127.0.0.1:1985", "gRPC address to listen on (host:port; port 0 picks one)")
	flag.StringVar(&cfg.out, "out", "", "file to write the recording to (created or truncated; required)")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg); err != nil {
		log.Printf("besrecord: %v", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, cfg config) error {
	if cfg.out == "" {
		return errors.New("-out is required")
	}
	rec, err := besrecord.Start(cfg.listen, cfg.out)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "besrecord: recording to %s; point Bazel at --bes_backend=grpc://%s\n", cfg.out, rec.Addr())
	<-ctx.Done()
	err = rec.Close()
	s := rec.Stats()
	fmt.Fprintf(os.Stderr, "besrecord: %d lifecycle events, %d streams, %d stream events\n", s.Lifecycle, s.Streams, s.Events)
	return err
}
