package kafka

import (
	"crypto/tls"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"time"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/tlsfiles"
)

// Options are the export's knobs as a process sets them: the brokers and
// routes, the producer's Config, how its TLS and SASL material is found,
// and how much each stream's consumer may have in flight. Its flags
// (RegisterFlags) are the export's, so that every command that exports,
// or asks what the export reads (RegisterRouteFlags), takes the same ones;
// Config checks them.
type Options struct {
	c Config
	// Brokers and Routes are --kafka-brokers and --kafka-routes as given:
	// whether the export runs at all (Brokers names one) and what it
	// reads, which a process decides on before it starts the export.
	Brokers, Routes               string
	partitions, replicationFactor int
	batchMaxBytes                 int
	tls                           bool
	tlsCA, tlsCert, tlsKey        string
	tlsServerName                 string
	saslPasswordFile              string
	// MaxInFlight is how many messages of one stream are sent and not yet
	// acknowledged by Kafka: the max ack pending of the stream's export
	// consumer, which the caller creates. Config refuses one below 1.
	MaxInFlight int
}

// RegisterFlags registers every flag of the export on fs, each with its
// MILLRACE_KAFKA_* variable.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	o.RegisterRouteFlags(fs)
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
	envflag.Int(fs, &o.MaxInFlight, "kafka-max-in-flight", "MILLRACE_KAFKA_MAX_IN_FLIGHT", 20000, "messages per stream sent and not yet acknowledged by Kafka (the consumer's max ack pending)")
}

// RegisterRouteFlags registers only the flags that say whether the export
// runs and what it reads: a process that does not export, but must not
// delete what the export has not sent (the compactor), registers these to
// ask Holders.
func (o *Options) RegisterRouteFlags(fs *flag.FlagSet) {
	envflag.String(fs, &o.Brokers, "kafka-brokers", "MILLRACE_KAFKA_BROKERS", "", "Kafka bootstrap brokers, host:port comma-separated (in dev: the export runs only when set)")
	envflag.String(fs, &o.Routes, "kafka-routes", "MILLRACE_KAFKA_ROUTES", DefaultRoutes, `subjects to topics: "subject.pattern.> -> topic" comma-separated; the first match takes a message, subjects no route takes are not exported`)
}

// Config checks the options and makes the exporter's configuration, and
// the filters of each stream to export (ByStream, with its streamsOf and
// names: this package sees no streams). A mistake in the flags is an
// envflag.UsageError; log receives the exporter's messages, and a warning
// now if SASL goes without TLS.
func (o Options) Config(streamsOf func(filter string) (map[string]string, bool), names []string, log *slog.Logger) (Config, map[string][]string, error) {
	cfg := o.c
	if cfg.Brokers = envflag.SplitList(o.Brokers); len(cfg.Brokers) == 0 {
		return cfg, nil, envflag.Usage("--kafka-brokers (MILLRACE_KAFKA_BROKERS) names no broker")
	}
	routes, err := ParseRoutes(o.Routes)
	if err != nil {
		return cfg, nil, envflag.Usage(err.Error())
	}
	filters, err := ByStream(routes, streamsOf, names)
	if err != nil {
		return cfg, nil, envflag.Usage(err.Error())
	}
	if o.partitions == 0 || o.replicationFactor == 0 || o.MaxInFlight < 1 || cfg.MaxBufferedRecords < 1 || o.batchMaxBytes < 1 {
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
		if log == nil {
			log = slog.Default()
		}
		log.Warn("SASL without TLS: the brokers see the credentials in clear (plain) or a replayable exchange; set --kafka-tls")
	}
	return cfg, filters, nil
}

// tlsConfig is the client TLS the flags ask for: nil (plaintext) unless
// one of them is set.
func (o Options) tlsConfig() (*tls.Config, error) {
	if !o.tls && o.tlsCA == "" && o.tlsCert == "" && o.tlsKey == "" {
		return nil, nil
	}
	c, err := tlsfiles.Client{CA: o.tlsCA, Cert: o.tlsCert, Key: o.tlsKey, ServerName: o.tlsServerName}.Config()
	if err != nil {
		return nil, fmt.Errorf("--kafka-tls-ca/--kafka-tls-cert/--kafka-tls-key: %w", err)
	}
	return c, nil
}

// HoldersHelp says in a flag's help what Holders answers for COMMITS, for
// the compactor's --compactor-hold, whose default it is.
func HoldersHelp(stream string) string {
	return "the Kafka export's consumer of " + stream + " (" + Durable(stream) + ") when --kafka-brokers is set and a --kafka-routes route reads " + stream + ", else none"
}

// Holders is the export's consumer of stream, Durable(stream), when
// Brokers names a broker (the export runs) and one of Routes reads stream
// (streamOf as for ByStream); else nil. Whatever deletes from stream (the
// compactor, from COMMITS) must not delete what that export has not sent.
// Routes that do not parse are an envflag.UsageError.
func (o Options) Holders(stream string, streamOf func(filter string) (string, bool)) ([]string, error) {
	if strings.Trim(o.Brokers, ", \t") == "" {
		return nil, nil
	}
	rs, err := ParseRoutes(o.Routes)
	if err != nil {
		return nil, envflag.Usage("--kafka-routes, which says whether the export holds the compactor back: " + err.Error())
	}
	if Reads(rs, stream, streamOf) {
		return []string{Durable(stream)}, nil
	}
	return nil, nil
}

// Description is the help of `millrace export kafka`, beside the flags
// it describes (RegisterFlags).
const Description = `Exports millrace's streams to Kafka with an idempotent producer (acks from
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
on --http-listen. See projectors/kafka/README.md.`
