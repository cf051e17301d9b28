package commitsload

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/projectors/compactor"
)

// runFold runs one compactor pass per world in this process, as
// `millrace project compactor` would: commitlog.FoldWorld reads the world's
// versions over NATS, the compactor writes the bucket, and the versions it
// folded that are not their document's last are deleted from the stream.
func runFold(ctx context.Context, cfg Config, led *ledger, out *printer) (*Fold, error) {
	worlds := led.worlds
	nc, err := nats.Connect(cfg.NATSURL, nats.Name("millrace-commitsload"), nats.Timeout(10*time.Second))
	if err != nil {
		return nil, fmt.Errorf("fold: NATS %s: %w", cfg.NATSURL, err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return nil, fmt.Errorf("fold: %w", err)
	}
	store := cfg.Bucket
	if store == nil {
		bk, err := bucket.Open(ctx, cfg.BucketURL)
		if err != nil {
			return nil, fmt.Errorf("fold: bucket %s: %w", cfg.BucketURL, err)
		}
		defer bk.Close()
		store = bk
	}
	c := compactor.MustNew(compactor.Config{}, store)

	f := &Fold{}
	cpu0, t0 := selfCPU(), time.Now()
	for _, world := range worlds {
		// What the compactor runner knows: the versions it saw waiting
		// (the acknowledged ones after the checkpoint).
		covered, err := c.Covered(ctx, world)
		if err != nil {
			return f, fmt.Errorf("fold %s: %w", world, err)
		}
		waiting := 0
		for _, a := range led.acks {
			if led.worlds[a.world] == world && a.version > covered {
				waiting++
			}
		}
		start := time.Now()
		st, err := commitlog.FoldWorld(ctx, js, c, world, commitlog.FoldWaiting(waiting))
		if err != nil {
			return f, fmt.Errorf("fold %s: %w", world, err)
		}
		fw := FoldWorld{PassS: round(time.Since(start).Seconds(), 3)}
		if r := c.Last(world); r != nil && st.Versions > 0 {
			fw.Result = *r
		} else {
			fw.World = world // nothing new to fold
		}
		f.Worlds = append(f.Worlds, fw)
		f.Versions += fw.Versions
		f.DocsChanged += fw.DocsChanged
		f.Docs += fw.Docs
		f.Dropped += st.Dropped
		f.BucketGets += fw.Gets
		f.BucketCreates += fw.Creates
		out.printf("commitsload: folded %s: %d versions, %d documents changed (%d in all), %d dropped from the stream, %d bucket gets + %d creates in %.1fs\n",
			world, fw.Versions, fw.DocsChanged, fw.Docs, st.Dropped, fw.Gets, fw.Creates, fw.PassS)
	}
	wall, cpu := time.Since(t0), selfCPU()-cpu0
	f.Seconds = round(wall.Seconds(), 3)
	f.VersionsPerS = per(float64(f.Versions), wall)
	f.DocsPerS = per(float64(f.DocsChanged), wall)
	f.CPUS = round(cpu.Seconds(), 2)
	f.DocsPerCPUS = per(float64(f.DocsChanged), cpu)
	if f.DocsChanged > 0 {
		f.BucketOpsPerDoc = round(float64(f.BucketGets+f.BucketCreates)/float64(f.DocsChanged), 5)
		f.DeletionsPerDoc = round(float64(f.Dropped)/float64(f.DocsChanged), 3)
	}
	return f, nil
}
