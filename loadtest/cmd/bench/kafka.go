package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace/millrace/loadtest/replay"
	"github.com/millrace/millrace/subjects"
)

// besLabel selects the export metrics of the BES stream, the one this
// scenario exports.
const besLabel = `stream="` + subjects.StreamBES + `"`

// The Kafka export scenario: `millrace export kafka` reading the BES
// stream of `millrace serve bes` (JetStream embedded in the edge) into a
// kfake cluster in this process (a real broker's CPU would not be the
// exporter's either).
const scKafkaExport = "kafka-export"

// kafkaConfig sizes the scenario (flags of the bench).
type kafkaConfig struct {
	events         int64
	streams        int
	window, warmup time.Duration
	timeout        time.Duration
}

func (c *kafkaConfig) register(fs *flag.FlagSet) {
	fs.Int64Var(&c.events, "kafka-events", 200_000, "kafka-export: build events stored before the exporter starts (the drain measured in messages per CPU-second)")
	fs.IntVar(&c.streams, "kafka-fill-streams", 64, "kafka-export: concurrent invocations of the fill")
	fs.DurationVar(&c.window, "kafka-duration", 30*time.Second, "kafka-export: measured time of the paced replay (at -paced-rate over -paced-streams, the BES benchmark's)")
	fs.DurationVar(&c.warmup, "kafka-warmup", 10*time.Second, "kafka-export: warm-up of the paced replay (its delays count too)")
	fs.DurationVar(&c.timeout, "kafka-timeout", 5*time.Minute, "kafka-export: longest wait for the export to catch up")
}

// kafkaReport is the scenario's figures.
type kafkaReport struct {
	DrainMessages      uint64  `json:"drain_messages"`
	DrainSeconds       float64 `json:"drain_s"`
	DrainMessagesPerS  float64 `json:"drain_messages_per_s"`
	ExporterCPUS       float64 `json:"drain_exporter_cpu_s"`
	MessagesPerCPUS    float64 `json:"drain_messages_per_exporter_cpu_s"`
	EdgeJetStreamCPUS  float64 `json:"drain_edge_and_jetstream_cpu_s"`
	KafkaAndBenchCPUS  float64 `json:"drain_kfake_and_bench_cpu_s"`
	PacedRate          float64 `json:"paced_events_per_s"`
	PacedStreams       int     `json:"paced_streams"`
	PacedEvents        int64   `json:"paced_events"`
	PacedExporterCPUS  float64 `json:"paced_exporter_cpu_s"`
	DelayP50MS         float64 `json:"paced_delay_p50_ms"`
	DelayP99MS         float64 `json:"paced_delay_p99_ms"`
	DelayP999MS        float64 `json:"paced_delay_p999_ms"`
	ProduceP99MS       float64 `json:"paced_produce_p99_ms"`
	StreamMessages     uint64  `json:"stream_messages"`
	KafkaRecords       int64   `json:"kafka_records"`
	ExportErrors       float64 `json:"export_errors"`
	ExporterMaxRSSKiB  int64   `json:"exporter_max_rss_kib,omitempty"`
	DelayMeasuredBy    string  `json:"delay_measured_by"`
	ThroughputMeasured string  `json:"throughput_measured_by"`
}

func (b *bench) kafkaScenario(ctx context.Context, rep *scenarioReport) error {
	kc := b.cfg.kafka
	rep.Description = "`millrace export kafka` copies the BES stream of `millrace serve bes` (embedded JetStream) to a kfake cluster in the bench process: a drain of a filled stream, then a paced replay at the BES benchmark's rate"
	dir, err := mkdir(b.tmp, scKafkaExport)
	if err != nil {
		return err
	}
	if !b.cfg.keep {
		defer os.RemoveAll(dir)
	}
	k, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		return err
	}
	defer k.Close()
	e, err := b.startEdge(ctx, dir, "")
	if err != nil {
		return err
	}
	defer e.p.stop(stopGrace)

	fmt.Printf("  filling BES: %d events, %d streams\n", kc.events, kc.streams)
	if _, err := replay.Run(ctx, replay.Config{Target: e.bes, Scripts: b.scripts, Streams: kc.streams, Projects: projectsFor(kc.streams), Events: kc.events, Seed: 1}); err != nil {
		return err
	}
	_, last, _, err := streamState(ctx, e.natsURL)
	if err != nil {
		return err
	}

	web, err := freeAddr()
	if err != nil {
		return err
	}
	env := append(natsEnv(e.natsURL),
		"MILLRACE_KAFKA_BROKERS="+k.ListenAddrs()[0],
		"MILLRACE_KAFKA_ROUTES=bes.> -> millrace.bes",
		"MILLRACE_KAFKA_PARTITIONS=12",
		"MILLRACE_HTTP_LISTEN="+web,
	)
	metrics := "http://" + web + "/metrics"
	exp, err := startProc("exporter", b.cfg.bin, []string{"export", "kafka"}, env, filepath.Join(dir, "exporter.log"))
	if err != nil {
		return err
	}
	defer exp.stop(stopGrace)
	cpu := func(p *proc) time.Duration { c, _ := p.cpu(); return c }
	x0, e0, s0, t0 := cpu(exp), cpu(e.p), selfCPU(), time.Now()
	if err := waitReady(ctx, exp, "http://"+web+"/readyz", readyTimeout); err != nil {
		return err
	}
	// The export's position: the ack floor of its consumer, on the process
	// that leads it (the only one here). Binaries from before the consumer
	// core name it millrace_export_position{stream}: read either, so that
	// the A/B mode compares across the rename.
	position := func() uint64 {
		s := scrape(metrics)
		return uint64(max(s.sum("millrace_consumer_position", `kind="export"`, `consumer="export-kafka-bes"`),
			s.sum("millrace_export_position", `stream="BES"`)))
	}
	wait := func(seq uint64) error {
		deadline := time.Now().Add(kc.timeout)
		for position() < seq {
			if exp.exited() {
				return fmt.Errorf("the exporter exited: %v\n%s", exp.exitErr(), exp.tail(20))
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("the export reached %d of %d within %s", position(), seq, kc.timeout)
			}
			select {
			case <-ctx.Done():
				return ctx.Err()
			case <-time.After(50 * time.Millisecond):
			}
		}
		return nil
	}
	fmt.Printf("  draining %d messages into Kafka\n", last)
	if err := wait(last); err != nil {
		return err
	}
	wall := time.Since(t0)
	r := &kafkaReport{DrainMessages: last, DrainSeconds: round(wall.Seconds(), 2),
		DrainMessagesPerS:  round(float64(last)/wall.Seconds(), 0),
		ExporterCPUS:       round((cpu(exp) - x0).Seconds(), 2),
		EdgeJetStreamCPUS:  round((cpu(e.p) - e0).Seconds(), 2),
		KafkaAndBenchCPUS:  round((selfCPU() - s0).Seconds(), 2),
		DelayMeasuredBy:    "millrace_export_delay_seconds (JetStream's store time to Kafka's ack, per message; upper bounds of factor-2 buckets), over the warm-up and the window",
		ThroughputMeasured: "the exporter process's CPU (utime+stime) from its start until its position reached the stream's last message",
	}
	if r.ExporterCPUS > 0 {
		r.MessagesPerCPUS = round(float64(last)/r.ExporterCPUS, 0)
	}
	fmt.Printf("  drained %d messages in %.1f s: %.0f messages/s, %.2f exporter CPU-s (%.0f messages per CPU-second)\n",
		last, wall.Seconds(), r.DrainMessagesPerS, r.ExporterCPUS, r.MessagesPerCPUS)

	// Paced: the BES benchmark's rate, the exporter keeping up.
	r.PacedRate, r.PacedStreams = b.cfg.pacedRate, b.cfg.pacedStreams
	before, x1 := scrape(metrics), cpu(exp)
	fmt.Printf("  %d streams at %.0f events/s: %s warm-up, then %s\n", r.PacedStreams, r.PacedRate, kc.warmup, kc.window)
	res, err := replay.Run(ctx, replay.Config{Target: e.bes, Scripts: b.scripts, Streams: r.PacedStreams, Projects: projectsFor(r.PacedStreams),
		Rate: r.PacedRate, Warmup: kc.warmup, WarmupPhase: b.cfg.warmupPhase, Duration: kc.warmup + kc.window, Seed: 2})
	if err != nil {
		return err
	}
	r.PacedEvents = res.Events()
	_, last, _, err = streamState(ctx, e.natsURL)
	if err != nil {
		return err
	}
	if err := wait(last); err != nil {
		return err
	}
	d := scrape(metrics).delta(before)
	r.PacedExporterCPUS = round((cpu(exp) - x1).Seconds(), 2)
	r.DelayP50MS = d.quantileMS("millrace_export_delay_seconds", 0.5, besLabel)
	r.DelayP99MS = d.quantileMS("millrace_export_delay_seconds", 0.99, besLabel)
	r.DelayP999MS = d.quantileMS("millrace_export_delay_seconds", 0.999, besLabel)
	r.ProduceP99MS = d.quantileMS("millrace_kafka_produce_seconds", 0.99, `topic="millrace.bes"`)
	s := scrape(metrics)
	r.ExportErrors = s.sum("millrace_consumer_batches_total", `kind="export"`, `result="error"`) + s.sum("millrace_export_errors_total")
	r.StreamMessages = last

	// Every message is in Kafka: the topic's end offsets add up to at
	// least the stream (more only with resends after a failure).
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.ListenAddrs()...))
	if err != nil {
		return err
	}
	defer cl.Close()
	ends, err := kadm.NewClient(cl).ListEndOffsets(ctx, "millrace.bes")
	if err != nil {
		return err
	}
	ends.Each(func(o kadm.ListedOffset) { r.KafkaRecords += o.Offset })
	rep.Kafka = r
	fmt.Printf("  paced: delay p50 %.0f ms, p99 %.0f ms, p99.9 %.0f ms; %d stream messages, %d Kafka records\n",
		r.DelayP50MS, r.DelayP99MS, r.DelayP999MS, r.StreamMessages, r.KafkaRecords)

	rep.Checks = append(rep.Checks,
		atLeast(scKafkaExport+": exported messages per CPU-second of the exporter (drain)", r.MessagesPerCPUS, 50000, "messages/CPU-s", ""),
		below(fmt.Sprintf("%s: export delay p99 while the BES edge ingests %.0f events/s", scKafkaExport, r.PacedRate), r.DelayP99MS, 1000, "ms", ""),
		atLeast(scKafkaExport+": Kafka records per stream message (nothing lost)", float64(r.KafkaRecords)/float64(max(r.StreamMessages, 1)), 1, "records/message", ""),
	)
	return nil
}
