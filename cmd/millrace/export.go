package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/internal/tlsfiles"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/streams"
)

// kafkaOptions configure the Kafka export.
type kafkaOptions struct {
	c                             kafka.Config
	brokers, routes               string
	partitions, replicationFactor int
	batchMaxBytes                 int
	tls                           bool
	tlsCA, tlsCert, tlsKey        string
	tlsServerName                 string
	saslPasswordFile              string
	maxInFlight                   int
}

func (o *kafkaOptions) register(fs *flag.FlagSet) {
	o.registerRoutes(fs)
	envflag.String(fs, &o.c.ClientID, "kafka-client-id", "MILLRACE_KAFKA_CLIENT_ID", "millrace-export", "client id the producer shows the brokers")
	envflag.Bool(fs, &o.c.CreateTopics, "kafka-create-topics", "MILLRACE_KAFKA_CREATE_TOPICS", true, "create missing topics with --kafka-partitions and --kafka-replication-factor; false: only check they exist")
	envflag.SignedInt(fs, &o.partitions, "kafka-partitions", "MILLRACE_KAFKA_PARTITIONS", 12, "partitions of created topics (-1: the brokers' default)")
	envflag.SignedInt(fs, &o.replicationFactor, "kafka-replication-factor", "MILLRACE_KAFKA_REPLICATION_FACTOR", -1, "replication factor of created topics (-1: the brokers' default)")
	envflag.Duration(fs, &o.c.Linger, "kafka-linger", "MILLRACE_KAFKA_LINGER", 10*time.Millisecond, "how long a partition's batch waits for more records before it is sent (a backlog fills batches sooner)")
	envflag.Size(fs, &o.batchMaxBytes, "kafka-batch-max-bytes", "MILLRACE_KAFKA_BATCH_MAX_BYTES", 1<<20, "largest batch per partition (keep under the brokers' message.max.bytes)")
	envflag.Int(fs, &o.c.MaxBufferedRecords, "kafka-max-buffered-records", "MILLRACE_KAFKA_MAX_BUFFERED_RECORDS", 50000, "records waiting for Kafka's ack before export pauses")
	envflag.String(fs, &o.c.Compression, "kafka-compression", "MILLRACE_KAFKA_COMPRESSION", "lz4", "batch compression: none, gzip, snappy, lz4 or zstd")
	envflag.Bool(fs, &o.tls, "kafka-tls", "MILLRACE_KAFKA_TLS", false, "connect to the brokers over TLS (implied by --kafka-tls-ca or --kafka-tls-cert)")
	envflag.String(fs, &o.tlsCA, "kafka-tls-ca", "MILLRACE_KAFKA_TLS_CA", "", "PEM CA bundle the brokers' certificates must chain to (default: the system's)")
	envflag.String(fs, &o.tlsCert, "kafka-tls-cert", "MILLRACE_KAFKA_TLS_CERT", "", "PEM client certificate for mutual TLS (with --kafka-tls-key)")
	envflag.String(fs, &o.tlsKey, "kafka-tls-key", "MILLRACE_KAFKA_TLS_KEY", "", "PEM private key of --kafka-tls-cert")
	envflag.String(fs, &o.tlsServerName, "kafka-tls-server-name", "MILLRACE_KAFKA_TLS_SERVER_NAME", "", "name to verify the brokers' certificates against (default: the broker host)")
	envflag.String(fs, &o.c.SASLMechanism, "kafka-sasl-mechanism", "MILLRACE_KAFKA_SASL_MECHANISM", "", "SASL: plain, scram-sha-256 or scram-sha-512 (empty: none); use with TLS")
	envflag.String(fs, &o.c.SASLUser, "kafka-sasl-user", "MILLRACE_KAFKA_SASL_USER", "", "SASL user")
	envflag.String(fs, &o.c.SASLPassword, "kafka-sasl-password", "MILLRACE_KAFKA_SASL_PASSWORD", "", "SASL password (prefer --kafka-sasl-password-file)")
	envflag.String(fs, &o.saslPasswordFile, "kafka-sasl-password-file", "MILLRACE_KAFKA_SASL_PASSWORD_FILE", "", "file holding the SASL password")
	envflag.Int(fs, &o.maxInFlight, "kafka-max-in-flight", "MILLRACE_KAFKA_MAX_IN_FLIGHT", 20000, "messages per stream sent and not yet acknowledged by Kafka (the consumer's max ack pending)")
}

// registerRoutes registers the options that say whether the export runs
// and what it reads: `project compactor` registers only these, to know
// whether the export of COMMITS holds its deletions back.
func (o *kafkaOptions) registerRoutes(fs *flag.FlagSet) {
	envflag.String(fs, &o.brokers, "kafka-brokers", "MILLRACE_KAFKA_BROKERS", "", "Kafka bootstrap brokers, host:port comma-separated (in dev: the export runs only when set)")
	envflag.String(fs, &o.routes, "kafka-routes", "MILLRACE_KAFKA_ROUTES", kafka.DefaultRoutes, `subjects to topics: "subject.pattern.> -> topic" comma-separated; the first match takes a message, subjects no route takes are not exported`)
}

// config builds the exporter's configuration and the streams to export.
func (o *kafkaOptions) config(log *slog.Logger) (kafka.Config, map[string][]string, error) {
	cfg := o.c
	if cfg.Brokers = envflag.SplitList(o.brokers); len(cfg.Brokers) == 0 {
		return cfg, nil, envflag.Usage("--kafka-brokers (MILLRACE_KAFKA_BROKERS) names no broker")
	}
	routes, err := kafka.ParseRoutes(o.routes)
	if err != nil {
		return cfg, nil, envflag.Usage(err.Error())
	}
	filters, err := kafka.ByStream(routes, streams.StreamOf, streams.Names())
	if err != nil {
		return cfg, nil, envflag.Usage(err.Error())
	}
	if o.partitions == 0 || o.replicationFactor == 0 || o.maxInFlight < 1 || cfg.MaxBufferedRecords < 1 || o.batchMaxBytes < 1 {
		return cfg, nil, envflag.Usage("--kafka-partitions and --kafka-replication-factor are -1 or positive; max in flight, max buffered records and batch max bytes are positive")
	}
	cfg.Routes, cfg.Logger = routes, log
	cfg.Partitions, cfg.ReplicationFactor, cfg.BatchMaxBytes = int32(o.partitions), int16(o.replicationFactor), int32(o.batchMaxBytes)
	if cfg.TLS, err = o.tlsConfig(); err != nil {
		return cfg, nil, err
	}
	if o.saslPasswordFile != "" {
		b, err := os.ReadFile(o.saslPasswordFile)
		if err != nil {
			return cfg, nil, fmt.Errorf("--kafka-sasl-password-file: %w", err)
		}
		cfg.SASLPassword = strings.TrimSpace(string(b))
	}
	if cfg.SASLMechanism != "" && cfg.TLS == nil {
		log.Warn("SASL without TLS: the brokers see the credentials in clear (plain) or a replayable exchange; set --kafka-tls")
	}
	return cfg, filters, nil
}

func (o *kafkaOptions) tlsConfig() (*tls.Config, error) {
	if !o.tls && o.tlsCA == "" && o.tlsCert == "" && o.tlsKey == "" {
		return nil, nil
	}
	c, err := tlsfiles.Client{CA: o.tlsCA, Cert: o.tlsCert, Key: o.tlsKey, ServerName: o.tlsServerName}.Config()
	if err != nil {
		return nil, fmt.Errorf("--kafka-tls-ca/--kafka-tls-cert/--kafka-tls-key: %w", err)
	}
	return c, nil
}

// kafka exports the streams to Kafka: one export runner per stream the
// routes read, started once the topics are there. The configuration is
// checked now, before anything starts.
func (p *process) kafka(o kafkaOptions) (supervise.Component, error) {
	log := p.log.With("component", "kafka-export")
	cfg, filters, err := o.config(log)
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
					Durable: kafka.Durable(stream), MaxInFlight: o.maxInFlight, Metrics: p.t.sm, Logger: log}, m) // o.config refused a MaxInFlight below 1
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
		name:    "export kafka",
		summary: "copy streams to Kafka topics (nothing lost, order kept per subject)",
		long: `Exports millrace's streams to Kafka with an idempotent producer (acks from
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
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				ko kafkaOptions
			)
			po.register(fs, "127.0.0.1:8088", "HTTP address: /metrics, /healthz, /readyz",
				"how long the whole shutdown may take: the export stops at once, and what Kafka has not acknowledged yet is sent again at the next start")
			ko.register(fs)
			return po.run("export kafka", "millrace-export-kafka", func(p *process) ([]supervise.Component, []supervise.Component, error) {
				k, err := p.kafka(ko)
				return []supervise.Component{k}, nil, err
			})
		},
	}
}
