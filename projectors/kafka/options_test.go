package kafka

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The export holds deletions from COMMITS back only when it runs (a
// broker is named) and a route reads COMMITS; routes that do not parse
// are a usage error then, and nobody's business when it does not run.
func TestHolders(t *testing.T) {
	want := []string{"export-kafka-commits"}
	for _, c := range []struct {
		brokers, routes string
		want            []string
	}{
		{"", DefaultRoutes, nil},
		{" , ", DefaultRoutes, nil},
		{"", "nonsense", nil},
		{"k1:9092,k2:9092", DefaultRoutes, want},
		{"k1:9092", "bes.> -> builds", nil},
		{"k1:9092", "bes.> -> builds, commits.w.> -> w", want},
	} {
		got, err := Options{Brokers: c.brokers, Routes: c.routes}.Holders(subjects.StreamCommits, streams.StreamOf)
		if err != nil || !slices.Equal(got, c.want) || (got == nil) != (c.want == nil) {
			t.Errorf("%q, %q: %#v, %v; want %#v", c.brokers, c.routes, got, err, c.want)
		}
	}
	_, err := Options{Brokers: "k1:9092", Routes: "nonsense"}.Holders(subjects.StreamCommits, streams.StreamOf)
	if !errors.As(err, new(envflag.UsageError)) || !strings.HasPrefix(err.Error(), "--kafka-routes, which says whether the export holds the compactor back: ") {
		t.Fatalf("routes that do not parse: %v", err)
	}
	if h := HoldersHelp(subjects.StreamCommits); !strings.Contains(h, "(export-kafka-commits)") {
		t.Fatalf("HoldersHelp does not name the consumer: %q", h)
	}
}

func parseOptions(t *testing.T, args ...string) Options {
	t.Helper()
	envflagtest.Clean(t)
	var o Options
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	o.RegisterFlags(fs)
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return o
}

// Options.Config refuses what the flags may not say, as usage errors that
// name the flag, and otherwise makes the exporter's configuration and the
// filters per stream.
func TestOptionsConfig(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{nil, "--kafka-brokers (MILLRACE_KAFKA_BROKERS) names no broker"},
		{[]string{"--kafka-brokers", "k1:9092", "--kafka-routes", "nonsense"}, "kafka: route"},
		{[]string{"--kafka-brokers", "k1:9092", "--kafka-routes", "> -> everything"}, "no millrace stream holds"},
		{[]string{"--kafka-brokers", "k1:9092", "--kafka-partitions", "0"}, "--kafka-partitions and --kafka-replication-factor are -1 or positive"},
		{[]string{"--kafka-brokers", "k1:9092", "--kafka-max-in-flight", "0"}, "max in flight, max buffered records and batch max bytes are positive"},
	} {
		o := parseOptions(t, c.args...)
		if _, _, err := o.Config(oneStream, streams.Names(), nil); !errors.As(err, new(envflag.UsageError)) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%q: %v; want a usage error with %q", c.args, err, c.want)
		}
	}
	pw := filepath.Join(t.TempDir(), "pw")
	if err := os.WriteFile(pw, []byte("secret\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	o := parseOptions(t, "--kafka-brokers", "k1:9092, k2:9092", "--kafka-routes", "bes.> -> b, commits.> -> c", "--kafka-sasl-password-file", pw)
	cfg, filters, err := o.Config(oneStream, streams.Names(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cfg.Brokers, []string{"k1:9092", "k2:9092"}) || len(cfg.Routes) != 2 || cfg.Partitions != 12 || cfg.ReplicationFactor != -1 ||
		cfg.BatchMaxBytes != 1<<20 || cfg.SASLPassword != "secret" || cfg.TLS != nil || o.MaxInFlight != 20000 {
		t.Errorf("config %+v, max in flight %d", cfg, o.MaxInFlight)
	}
	if len(filters) != 2 || !slices.Equal(filters[subjects.StreamCommits], []string{"commits.>"}) {
		t.Errorf("filters %v", filters)
	}
}
