package compactor

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/subjects"
)

// BenchmarkCompact: one pass over a world of N new documents (100-byte
// bodies; COMPACTOR_BENCH_DOCS, default 100,000) into a mem:// bucket, with
// JetStream embedded in the same process. Reports documents per second and
// per CPU-second of the process (the server's work included).
func BenchmarkCompact(b *testing.B) {
	n := 100_000
	if v, err := strconv.Atoi(os.Getenv("COMPACTOR_BENCH_DOCS")); err == nil && v > 0 {
		n = v
	}
	b.Run("new documents", func(b *testing.B) { benchCompact(b, n, 0) })
	// A compacted world, then updates of 20% of its documents: the pass
	// rewrites the shards they fall in and purges each one's older
	// version (one JetStream purge per document).
	b.Run("updates", func(b *testing.B) { benchCompact(b, n, n/5) })
}

func benchCompact(b *testing.B, n, updates int) {
	for range b.N {
		b.StopTimer()
		w := newWorld(b)
		body := make([]byte, 100)
		publish := func(i int) {
			msg := &nats.Msg{Subject: subjects.Commits(w.name, fmt.Sprintf("doc-%08d", i)), Data: body,
				Header: nats.Header{envelope.Kind: {envelope.KindPut}}}
			if _, err := w.js.PublishMsgAsync(msg); err != nil {
				b.Fatal(err)
			}
		}
		for i := range n {
			publish(i)
		}
		<-w.js.PublishAsyncComplete()
		changed := n
		if updates > 0 {
			if _, err := w.pass(w.store, 0); err != nil {
				b.Fatal(err)
			}
			for i := range updates {
				publish(i * (n / updates))
			}
			<-w.js.PublishAsyncComplete()
			changed = updates
		}
		cpu0, t0 := cpuTime(), time.Now()
		b.StartTimer()
		// As the compactor runner does: it knows how many versions wait.
		c := MustNew(Config{}, w.store)
		_, err := commitlog.FoldWorld(context.Background(), w.js, c, w.name, commitlog.FoldWaiting(changed))
		res := c.Last(w.name)
		b.StopTimer()
		if err != nil || res.Docs != n || res.DocsChanged != changed {
			b.Fatalf("%+v, %v", res, err)
		}
		wall, cpu := time.Since(t0).Seconds(), (cpuTime() - cpu0).Seconds()
		b.ReportMetric(float64(changed)/wall, "docs/s")
		b.ReportMetric(float64(changed)/cpu, "docs/CPU-s")
		b.ReportMetric(float64(res.Creates+res.Gets)/float64(changed), "bucket-ops/doc")
		b.ReportMetric(float64(res.Dropped)/float64(changed), "deletions/doc")
	}
}

func cpuTime() time.Duration {
	var ru syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &ru)
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
