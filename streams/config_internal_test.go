package streams

import (
	"log/slog"
	"reflect"
	"strings"
	"testing"
	"time"
)

// negativeCase sets one field of a config negative; the error must name
// it and say what to set.
type negativeCase struct {
	want string // the start of the message: "<pkg>: <field> <value> is negative"
	err  func() error
}

func checkNegatives(t *testing.T, cases []negativeCase) {
	t.Helper()
	for _, c := range cases {
		err := c.err()
		if err == nil || !strings.Contains(err.Error(), c.want+"; set 0 for the default") {
			t.Errorf("%s: got %v", c.want, err)
		}
	}
}

// TestRunnerConfigNegative: NewRunner refuses each negative field, naming
// it, before it touches the backbone or the database.
func TestRunnerConfigNegative(t *testing.T) {
	refused := func(f func(*RunnerConfig)) func() error {
		return func() error {
			var c RunnerConfig
			f(&c)
			_, err := NewRunner(nil, nil, &seqRecorder{}, c, nil)
			return err
		}
	}
	checkNegatives(t, []negativeCase{
		{"runner: Batch -1 is negative", refused(func(c *RunnerConfig) { c.Batch = -1 })},
		{"runner: MaxWait -1ns is negative", refused(func(c *RunnerConfig) { c.MaxWait = -1 })},
		{"runner: AckWait -1ns is negative", refused(func(c *RunnerConfig) { c.AckWait = -1 })},
		{"runner: RetryMin -1ns is negative", refused(func(c *RunnerConfig) { c.RetryMin = -1 })},
		{"runner: RetryMax -1ns is negative", refused(func(c *RunnerConfig) { c.RetryMax = -1 })},
		{"runner: SweepEvery -1ns is negative", refused(func(c *RunnerConfig) { c.SweepEvery = -1 })},
		{"runner: IdleSweepEvery -1ns is negative", refused(func(c *RunnerConfig) { c.IdleSweepEvery = -1 })},
		{"runner: StandbyEvery -1ns is negative", refused(func(c *RunnerConfig) { c.StandbyEvery = -1 })},
	})
}

// TestOutboxConfigNegative: NewOutbox refuses each negative field.
func TestOutboxConfigNegative(t *testing.T) {
	refused := func(f func(*OutboxConfig)) func() error {
		return func() error {
			var c OutboxConfig
			f(&c)
			_, err := NewOutbox(nil, nil, c)
			return err
		}
	}
	checkNegatives(t, []negativeCase{
		{"outbox: Batch -1 is negative", refused(func(c *OutboxConfig) { c.Batch = -1 })},
		{"outbox: PollEvery -1ns is negative", refused(func(c *OutboxConfig) { c.PollEvery = -1 })},
		{"outbox: RetryMin -1ns is negative", refused(func(c *OutboxConfig) { c.RetryMin = -1 })},
		{"outbox: RetryMax -1ns is negative", refused(func(c *OutboxConfig) { c.RetryMax = -1 })},
		{"outbox: StandbyEvery -1ns is negative", refused(func(c *OutboxConfig) { c.StandbyEvery = -1 })},
	})
}

// TestExportConfigNegative: NewExportRunner refuses each negative field.
func TestExportConfigNegative(t *testing.T) {
	refused := func(f func(*ExportConfig)) func() error {
		return func() error {
			c := ExportConfig{Stream: "BES"}
			f(&c)
			_, err := NewExportRunner(nil, nil, c, nil)
			return err
		}
	}
	checkNegatives(t, []negativeCase{
		{"export: MaxInFlight -1 is negative", refused(func(c *ExportConfig) { c.MaxInFlight = -1 })},
		{"export: AckEvery -1ns is negative", refused(func(c *ExportConfig) { c.AckEvery = -1 })},
		{"export: RetryMin -1ns is negative", refused(func(c *ExportConfig) { c.RetryMin = -1 })},
		{"export: RetryMax -1ns is negative", refused(func(c *ExportConfig) { c.RetryMax = -1 })},
		{"export: StandbyEvery -1ns is negative", refused(func(c *ExportConfig) { c.StandbyEvery = -1 })},
	})
}

// TestConfigNegative: the backbone's Config refuses each negative field,
// naming it, rather than taking its default (or, for Replicas and
// MaxPayload, a message about another rule).
func TestConfigNegative(t *testing.T) {
	refused := func(f func(*Config)) func() error {
		return func() error {
			var c Config
			f(&c)
			return c.Validate()
		}
	}
	checkNegatives(t, []negativeCase{
		{"streams: SyncInterval -1ns is negative", refused(func(c *Config) { c.SyncInterval = -1 })},
		{"streams: MaxPayload -1 is negative", refused(func(c *Config) { c.MaxPayload = -1 })},
		{"streams: Replicas -1 is negative", refused(func(c *Config) { c.Replicas = -1 })},
		{"streams: BESMaxAge -1ns is negative", refused(func(c *Config) { c.BESMaxAge = -1 })},
		{"streams: BESMaxBytes -1 is negative", refused(func(c *Config) { c.BESMaxBytes = -1 })},
		{"streams: DuplicateWindow -1ns is negative", refused(func(c *Config) { c.DuplicateWindow = -1 })},
		{"streams: DeadMaxAge -1ns is negative", refused(func(c *Config) { c.DeadMaxAge = -1 })},
		{"streams: FleetNodesMaxAge -1ns is negative", refused(func(c *Config) { c.FleetNodesMaxAge = -1 })},
		{"streams: FleetResvMaxAge -1ns is negative", refused(func(c *Config) { c.FleetResvMaxAge = -1 })},
		{"streams: FleetPlaceMaxAge -1ns is negative", refused(func(c *Config) { c.FleetPlaceMaxAge = -1 })},
		{"streams: LeaseTTL -1ns is negative", refused(func(c *Config) { c.LeaseTTL = -1 })},
	})
	if err := (Config{}).Validate(); err != nil {
		t.Errorf("the zero Config: %v", err)
	}
}

// TestConsumerConfigDefaults: a zero field takes the default its comment
// documents.
func TestConsumerConfigDefaults(t *testing.T) {
	log := slog.Default()
	if got, want := (RunnerConfig{}).withDefaults(), (RunnerConfig{Batch: 1000, MaxWait: 250 * time.Millisecond,
		AckWait: 60 * time.Second, RetryMin: 100 * time.Millisecond, RetryMax: 5 * time.Second,
		SweepEvery: 30 * time.Second, IdleSweepEvery: 30 * time.Second, Logger: log}); !reflect.DeepEqual(got, want) {
		t.Errorf("RunnerConfig defaults: %+v, want %+v", got, want)
	}
	if got, want := (OutboxConfig{}).withDefaults(), (OutboxConfig{Batch: 500, PollEvery: 5 * time.Second,
		RetryMin: 100 * time.Millisecond, RetryMax: 5 * time.Second, StandbyEvery: 2 * time.Second, Logger: log}); !reflect.DeepEqual(got, want) {
		t.Errorf("OutboxConfig defaults: %+v, want %+v", got, want)
	}
	if got, want := (ExportConfig{Stream: "BES"}).withDefaults(), (ExportConfig{Stream: "BES", Durable: "export-bes",
		MaxInFlight: 20_000, AckEvery: 20 * time.Millisecond, RetryMin: time.Second, RetryMax: 30 * time.Second,
		Logger: log}); !reflect.DeepEqual(got, want) {
		t.Errorf("ExportConfig defaults: %+v, want %+v", got, want)
	}
	for _, c := range []struct {
		what string
		err  error
	}{
		{"RunnerConfig", RunnerConfig{}.Validate()},
		{"OutboxConfig", OutboxConfig{}.Validate()},
		{"ExportConfig", ExportConfig{}.Validate()},
	} {
		if c.err != nil {
			t.Errorf("the zero %s: %v", c.what, c.err)
		}
	}
}
