package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"slices"
	"sync"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// scPartitionLayout measures the two ways of giving a projector's
// instances a partition each of the BES stream, on the current server: a
// partition token put into the subject by the stream's subject transform
// (one stream, each consumer filtered to its token), against one stream
// per partition (each consumer reads its whole stream). An older server
// read a filter narrower than its stream 3-4× slower.
const scPartitionLayout = "partition-layout"

type partitionConfig struct {
	messages, partitions, size, invocations, rounds int
}

func (c *partitionConfig) register(fs *flag.FlagSet) {
	fs.IntVar(&c.messages, "partition-messages", 400_000, "partition-layout: messages stored in each layout")
	fs.IntVar(&c.partitions, "partition-partitions", 4, "partition-layout: partitions (one consumer each, read at once)")
	fs.IntVar(&c.size, "partition-size", 800, "partition-layout: message bytes (a BES event's mean)")
	fs.IntVar(&c.invocations, "partition-invocations", 2_000, "partition-layout: invocations the messages are spread over (bes.<project>.<invocation>)")
	fs.IntVar(&c.rounds, "partition-rounds", 3, "partition-layout: rounds, the layouts taking turns; each figure is the median of the rounds")
}

func (c *partitionConfig) validate() error {
	errs := negatives(map[string]float64{"partition-messages": float64(c.messages), "partition-size": float64(c.size), "partition-invocations": float64(c.invocations)})
	if c.rounds < 1 {
		errs = append(errs, fmt.Errorf("-partition-rounds %d: at least 1", c.rounds))
	}
	if c.partitions < 1 {
		errs = append(errs, fmt.Errorf("-partition-partitions %d: at least 1", c.partitions))
	}
	return errors.Join(errs...)
}

// partitionReport is what partition-layout measured, one entry a layout.
type partitionReport struct {
	Messages   int `json:"messages"`
	Partitions int `json:"partitions"`
	Bytes      int `json:"message_bytes"`
	Rounds     int `json:"rounds"`
	// Layouts hold each figure's median over the rounds.
	Layouts []partitionLayout `json:"layouts"`
	// ReadCPURatio is the transform's server CPU per message read over a
	// stream per partition's; ReadRateRatio a stream per partition's read
	// rate over the transform's; StoreCPURatio the store's CPU, as the first.
	ReadCPURatio  float64 `json:"read_cpu_ratio"`
	ReadRateRatio float64 `json:"read_rate_ratio"`
	StoreCPURatio float64 `json:"store_cpu_ratio"`
}

type partitionLayout struct {
	Name string `json:"name"`
	// Publish: the server's CPU per 100k messages stored, and the rate.
	PublishCPUPer100k float64 `json:"publish_server_cpu_s_per_100k"`
	PublishPerS       float64 `json:"publish_messages_per_s"`
	// Read: every partition's consumer fetching at once to the end.
	ReadCPUPer100k float64 `json:"read_server_cpu_s_per_100k"`
	ReadPerS       float64 `json:"read_messages_per_s"`
	// Skew is the largest partition's share over the even share.
	Skew float64 `json:"partition_skew"`
}

func (b *bench) partitionScenario(ctx context.Context, rep *scenarioReport) error {
	c := b.cfg.partition
	rep.Description = fmt.Sprintf("%d messages of %d B in %d partitions, on natsd: a subject transform's partition token in one stream against a stream per partition; the server's CPU to store and to read them with one consumer a partition", c.messages, c.size, c.partitions)
	dir, err := mkdir(b.tmp, scPartitionLayout)
	if err != nil {
		return err
	}
	if !b.cfg.keep {
		defer os.RemoveAll(dir)
	}
	natsd, url, err := b.startNATSD(ctx, dir)
	if err != nil {
		return err
	}
	defer natsd.stop(stopGrace)
	nc, err := nats.Connect(url)
	if err != nil {
		return err
	}
	defer nc.Close()
	js, err := jetstream.New(nc, jetstream.WithPublishAsyncMaxPending(4096))
	if err != nil {
		return err
	}
	pr := &partitionReport{Messages: c.messages, Partitions: c.partitions, Bytes: c.size, Rounds: c.rounds}
	runs := map[string][]partitionLayout{}
	layouts := []string{"transform", "streams"}
	for round := range c.rounds {
		for _, layout := range layouts {
			l, err := b.partitionLayout(ctx, js, natsd, layout, round, c)
			if err != nil {
				return fmt.Errorf("%s: %w", layout, err)
			}
			runs[layout] = append(runs[layout], l)
			fmt.Printf("  round %d %-9s store %7.0f msgs/s, %.2f server CPU-s/100k; read %7.0f msgs/s, %.2f server CPU-s/100k; skew %.2f\n",
				round+1, l.Name, l.PublishPerS, l.PublishCPUPer100k, l.ReadPerS, l.ReadCPUPer100k, l.Skew)
		}
	}
	for _, layout := range layouts {
		pr.Layouts = append(pr.Layouts, medianLayout(runs[layout]))
	}
	t, st := pr.Layouts[0], pr.Layouts[1]
	pr.ReadCPURatio = round(t.ReadCPUPer100k/st.ReadCPUPer100k, 2)
	pr.ReadRateRatio = round(st.ReadPerS/t.ReadPerS, 2)
	pr.StoreCPURatio = round(t.PublishCPUPer100k/st.PublishCPUPer100k, 2)
	rep.Partition = pr
	fmt.Printf("  medians: the transform's filtered reads cost %.2fx the server CPU of a stream per partition and ran %.2fx slower; storing %.2fx\n",
		pr.ReadCPURatio, pr.ReadRateRatio, pr.StoreCPURatio)
	// Figures, not targets, but for the partitions' balance: the choice
	// they inform is written down in docs/design.md ("Partitions").
	rep.Checks = append(rep.Checks,
		below(scPartitionLayout+": the largest partition over the even share", t.Skew, 1.2, "x", "the transform's hash of project and invocation"))
	return nil
}

// medianOf is the median of a figure of rounds.
func medianOf[T any](rounds []T, figure func(T) float64) float64 {
	v := make([]float64, len(rounds))
	for i, r := range rounds {
		v[i] = figure(r)
	}
	slices.Sort(v)
	if len(v)%2 == 1 {
		return v[len(v)/2]
	}
	return (v[len(v)/2-1] + v[len(v)/2]) / 2
}

// medianLayout takes each figure's median over the rounds.
func medianLayout(ls []partitionLayout) partitionLayout {
	med := func(f func(partitionLayout) float64) float64 { return medianOf(ls, f) }
	return partitionLayout{Name: ls[0].Name,
		PublishCPUPer100k: med(func(l partitionLayout) float64 { return l.PublishCPUPer100k }),
		PublishPerS:       med(func(l partitionLayout) float64 { return l.PublishPerS }),
		ReadCPUPer100k:    med(func(l partitionLayout) float64 { return l.ReadCPUPer100k }),
		ReadPerS:          med(func(l partitionLayout) float64 { return l.ReadPerS }),
		Skew:              med(func(l partitionLayout) float64 { return l.Skew }),
	}
}

// partitionLayout stores the messages in one layout and reads them back.
func (b *bench) partitionLayout(ctx context.Context, js jetstream.JetStream, natsd *proc, layout string, turn int, c partitionConfig) (partitionLayout, error) {
	l := partitionLayout{Name: layout}
	prefix := fmt.Sprintf("p%s%d", layout[:1], turn)
	var streams []string
	switch layout {
	case "transform":
		// bes.<project>.<invocation> → bes.<partition>.<project>.<invocation>
		name := fmt.Sprintf("PT%d", turn)
		_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{prefix + ".*.*"}, Storage: jetstream.FileStorage,
			SubjectTransform: &jetstream.SubjectTransformConfig{Source: prefix + ".*.*",
				Destination: fmt.Sprintf("%s.{{partition(%d,1,2)}}.{{wildcard(1)}}.{{wildcard(2)}}", prefix, c.partitions)}})
		if err != nil {
			return l, err
		}
		streams = []string{name}
	case "streams":
		for i := range c.partitions {
			name := fmt.Sprintf("PS%d_%d", turn, i)
			if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{fmt.Sprintf("%s.%d.*.*", prefix, i)}, Storage: jetstream.FileStorage}); err != nil {
				return l, err
			}
			streams = append(streams, name)
		}
	}
	body := make([]byte, c.size)
	cpu0, _ := natsd.cpu()
	begin := time.Now()
	for i := range c.messages {
		inv := i % c.invocations
		subject := fmt.Sprintf("%s.proj%d.inv%d", prefix, inv%7, inv)
		if layout == "streams" {
			// The publisher computes the partition; a transform on the
			// account could do it for unchanged publishers.
			subject = fmt.Sprintf("%s.%d.proj%d.inv%d", prefix, inv%c.partitions, inv%7, inv)
		}
		if _, err := js.PublishAsync(subject, body); err != nil {
			return l, err
		}
	}
	select {
	case <-js.PublishAsyncComplete():
	case <-ctx.Done():
		return l, ctx.Err()
	}
	wall := time.Since(begin)
	cpu1, _ := natsd.cpu()
	l.PublishPerS = round(float64(c.messages)/wall.Seconds(), 0)
	l.PublishCPUPer100k = round((cpu1-cpu0).Seconds()*100_000/float64(c.messages), 3)

	counts := make([]int, c.partitions)
	var wg sync.WaitGroup
	errs := make([]error, c.partitions)
	cpu0, _ = natsd.cpu()
	begin = time.Now()
	for p := range c.partitions {
		wg.Go(func() {
			stream, filter := streams[0], fmt.Sprintf("%s.%d.>", prefix, p)
			if layout == "streams" {
				stream, filter = streams[p], ""
			}
			cons, err := js.CreateConsumer(ctx, stream, jetstream.ConsumerConfig{Durable: fmt.Sprintf("read%d", p), FilterSubject: filter,
				AckPolicy: jetstream.AckAllPolicy, MaxAckPending: 10_000})
			if err != nil {
				errs[p] = err
				return
			}
			for {
				info, err := cons.Info(ctx)
				if err != nil {
					errs[p] = err
					return
				}
				if info.NumPending == 0 && info.NumAckPending == 0 {
					return
				}
				batch, err := cons.Fetch(1000, jetstream.FetchMaxWait(time.Second))
				if err != nil {
					errs[p] = err
					return
				}
				var last jetstream.Msg
				for m := range batch.Messages() {
					counts[p]++
					last = m
				}
				if last != nil {
					last.Ack()
				}
			}
		})
	}
	wg.Wait()
	wall = time.Since(begin)
	cpu1, _ = natsd.cpu()
	if err := errors.Join(errs...); err != nil {
		return l, err
	}
	total, most := 0, 0
	for _, n := range counts {
		total, most = total+n, max(most, n)
	}
	if total != c.messages {
		return l, fmt.Errorf("read %d of %d messages (%v)", total, c.messages, counts)
	}
	l.ReadPerS = round(float64(total)/wall.Seconds(), 0)
	l.ReadCPUPer100k = round((cpu1-cpu0).Seconds()*100_000/float64(total), 3)
	l.Skew = round(float64(most)/(float64(total)/float64(c.partitions)), 3)
	return l, nil
}
