package main

import (
	"flag"
	"log/slog"
	"os"
	"slices"
	"testing"

	"github.com/millrace/millrace/projectors/kafka"
)

// --compactor-hold names the consumers that hold the compactor's deletions
// back; left empty it is the Kafka export's consumer of COMMITS when the
// export is configured to read COMMITS, and "none" is an explicit empty
// list.
func TestCompactorHold(t *testing.T) {
	for _, v := range []string{"MILLRACE_KAFKA_BROKERS", "MILLRACE_KAFKA_ROUTES", "MILLRACE_COMPACTOR_HOLD"} {
		if _, ok := os.LookupEnv(v); ok {
			t.Setenv(v, "") // restored after the test
			os.Unsetenv(v)
		}
	}
	for _, c := range []struct {
		args []string
		want []string
	}{
		{nil, nil}, // no export configured: nothing holds
		{[]string{"--kafka-brokers", "k1:9092,k2:9092"}, []string{"export-kafka-commits"}},
		{[]string{"--kafka-brokers", "k1:9092", "--kafka-routes", "bes.> -> builds"}, nil},
		{[]string{"--kafka-brokers", "k1:9092", "--kafka-routes", "bes.> -> builds, commits.w.> -> w"}, []string{"export-kafka-commits"}},
		{[]string{"--kafka-brokers", "k1:9092", "--compactor-hold", "none"}, []string{}},
		{[]string{"--compactor-hold", " mirror, export-a "}, []string{"mirror", "export-a"}},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		var co compactorOptions
		var ko kafka.Options
		co.register(fs)
		ko.RegisterRouteFlags(fs)
		if err := fs.Parse(c.args); err != nil {
			t.Fatal(err)
		}
		rc, _, err := co.config(0, ko, slog.Default())
		if err != nil {
			t.Fatalf("%q: %v", c.args, err)
		}
		if !slices.Equal(rc.HoldFor, c.want) || (rc.HoldFor == nil) != (c.want == nil) {
			t.Errorf("%q: holders %#v, want %#v", c.args, rc.HoldFor, c.want)
		}
	}
	for _, bad := range [][]string{
		{"--compactor-hold", ","},
		{"--compactor-hold", "export.commits"},
		{"--kafka-brokers", "k1:9092", "--kafka-routes", "nonsense"},
	} {
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		var co compactorOptions
		var ko kafka.Options
		co.register(fs)
		ko.RegisterRouteFlags(fs)
		if err := fs.Parse(bad); err != nil {
			t.Fatal(err)
		}
		if rc, _, err := co.config(0, ko, slog.Default()); err == nil {
			t.Errorf("%q: accepted, holders %q", bad, rc.HoldFor)
		}
	}
}
