// Command natsd runs a JetStream server on its own, configured as the one
// millrace embeds (streams.StartEmbedded), so that benchmarks can run NATS
// as a separate process and measure its CPU apart from the edge's:
//
//	natsd -listen 127.0.0.1:4224 -dir /tmp/nats -sync 1s
//	millrace serve bes --nats-url nats://127.0.0.1:4224
//
// It prints "ready <url>" on stdout once it accepts connections and stops on
// SIGINT or SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/millrace/millrace/streams"
)

type config struct {
	listen, dir, sync string
	maxPayload        int
}

func main() {
	var c config
	flag.StringVar(&c.listen, "listen", "127.0.0.1:4224", "client address (host:port; port 0 picks one)")
	flag.StringVar(&c.dir, "dir", "", "file store directory (required)")
	flag.StringVar(&c.sync, "sync", "1s", `fsync interval, or "always" to fsync every write`)
	flag.IntVar(&c.maxPayload, "max-payload", streams.DefaultMaxPayload, "largest message in bytes (the edge needs 4 MiB + 64 KiB)")
	flag.Parse()

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	err := run(ctx, c)
	stop()
	if err != nil {
		fmt.Fprintf(os.Stderr, "natsd: %v\n", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, c config) error {
	if c.dir == "" {
		return errors.New("-dir is required")
	}
	// Anonymous: the benchmarks connect without credentials; natsd
	// listens on loopback for the length of one benchmark.
	sc := streams.Config{DataDir: c.dir, Listen: c.listen, MaxPayload: int32(c.maxPayload), Anonymous: true}
	if c.sync == "always" {
		sc.SyncAlways = true
	} else {
		d, err := time.ParseDuration(c.sync)
		if err != nil || d <= 0 {
			return fmt.Errorf("-sync %q: want a duration like 1s, or always", c.sync)
		}
		sc.SyncInterval = d
	}
	ns, _, err := streams.StartEmbedded(sc)
	if err != nil {
		return err
	}
	fmt.Printf("ready %s\n", ns.ClientURL())
	<-ctx.Done()
	ns.Shutdown()
	ns.WaitForShutdown()
	return nil
}
