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
	streamsOf := func(filter string) (map[string]string, bool) { return streams.StreamsOf(p.layout, filter) }
	cfg, filters, err := o.Config(streamsOf, streams.NamesIn(p.layout), log)
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
		Long:    kafka.Description,
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
