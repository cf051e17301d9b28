package main

import (
	"context"
	"flag"
	"sync"

	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/streams"
)

// kafka exports the streams to Kafka: one export runner per stream the
// routes read, started once the topics are there. The configuration is
// checked now, before anything starts.
func (p *process) kafka(o kafka.Options) (supervise.Component, error) {
	log := p.log.With("component", "kafka-export")
	cfg, filters, err := o.Config(streams.StreamOf, streams.Names(), log)
	if err != nil {
		return supervise.Component{}, err
	}
	var exp *kafka.Exporter
	return supervise.Component{
		Name: "kafka export",
		Start: func(context.Context) (err error) {
			exp, err = kafka.New(cfg, kafka.NewMetrics(p.t.reg))
			return err
		},
		Run: func(ctx context.Context) error {
			defer exp.Close()
			if exp.WaitTopics(ctx) != nil {
				return nil // stopped before the topics were there
			}
			m := streams.NewExportMetrics(p.t.reg)
			var wg sync.WaitGroup
			for stream, fs := range filters {
				r, _ := streams.NewExportRunner(p.bb.JS, exp, streams.ExportConfig{Stream: stream, Filters: fs,
					Durable: kafka.Durable(stream), MaxInFlight: o.MaxInFlight, Metrics: p.t.sm, Logger: log}, m) // o.Config refused a MaxInFlight below 1
				wg.Add(1)
				go func() {
					defer wg.Done()
					r.Run(ctx)
				}()
			}
			wg.Wait()
			return nil
		},
	}, nil
}

func exportKafkaCommand() command {
	return command{
		Name:    "export kafka",
		Summary: "copy streams to Kafka topics (nothing lost, order kept per subject)",
		Long: `Exports millrace's streams to Kafka with an idempotent producer (acks from
every in-sync replica). --kafka-routes maps subject patterns to topics; each
stream a route reads gets a durable JetStream consumer
("export-kafka-<stream>") whose ack floor is the export's position: a
message is acknowledged on the stream only after Kafka acknowledged its
record and every record before it. A broker outage pauses the export (the
producer retries; once --kafka-max-buffered-records wait, reading stops)
and it resumes where it stopped; a restarted exporter starts at once from
the last acknowledged message.

Each record's key is the message's subject (one invocation, node, pool or
document), so Kafka's key hashing keeps each entity's records on one
partition, in stream order. Headers: Millrace-Subject, Millrace-Stream,
Millrace-Seq (the stream sequence) and the message's own headers
(Millrace-Schema, Millrace-Kind, Nats-Msg-Id...). A record is sent twice only
after a failure or a crash, with the same Millrace-Stream and Millrace-Seq:
consumers deduplicate on them. Topics are created (kadm) with
--kafka-partitions and --kafka-replication-factor unless
--kafka-create-topics=false. TLS (--kafka-tls*) and SASL PLAIN or SCRAM
(--kafka-sasl-*) for real clusters.

One process exports each stream: it holds the lease "export.<consumer>" in
the JetStream key-value bucket millrace_leases; others started beside it
stand by and take over within --nats-lease-ttl of its end. Metrics
(millrace_consumer_*{kind="export"}, millrace_export_*, millrace_kafka_*)
on --http-listen. See projectors/kafka/README.md.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				ko kafka.Options
			)
			po.register(fs, "127.0.0.1:8088", "HTTP address: /metrics, /healthz, /readyz",
				"how long the whole shutdown may take: the export stops at once, and what Kafka has not acknowledged yet is sent again at the next start")
			ko.RegisterFlags(fs)
			return po.run("export kafka", "millrace-export-kafka", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				k, err := p.kafka(ko)
				return []supervise.Component{k}, nil, err
			})
		},
	}
}
