package commitlog

import (
	"log/slog"
	"reflect"
	"strings"
	"testing"
	"time"
)

// TestFoldRunnerConfigNegative: NewFoldRunner refuses each negative field,
// naming it and saying what to set, before it touches the backbone.
func TestFoldRunnerConfigNegative(t *testing.T) {
	for field, set := range map[string]func(*FoldRunnerConfig){
		"MinVersions -1":    func(c *FoldRunnerConfig) { c.MinVersions = -1 },
		"Interval -1ns":     func(c *FoldRunnerConfig) { c.Interval = -1 },
		"Concurrency -1":    func(c *FoldRunnerConfig) { c.Concurrency = -1 },
		"MaxAckPending -1":  func(c *FoldRunnerConfig) { c.MaxAckPending = -1 },
		"AckWait -1ns":      func(c *FoldRunnerConfig) { c.AckWait = -1 },
		"Fetch -1":          func(c *FoldRunnerConfig) { c.Fetch = -1 },
		"FetchWait -1ns":    func(c *FoldRunnerConfig) { c.FetchWait = -1 },
		"RetryMin -1ns":     func(c *FoldRunnerConfig) { c.RetryMin = -1 },
		"RetryMax -1ns":     func(c *FoldRunnerConfig) { c.RetryMax = -1 },
		"StandbyEvery -1ns": func(c *FoldRunnerConfig) { c.StandbyEvery = -1 },
		"Drain -1ns":        func(c *FoldRunnerConfig) { c.Drain = -1 },
	} {
		var c FoldRunnerConfig
		set(&c)
		_, err := NewFoldRunner(nil, nil, c)
		if err == nil || !strings.Contains(err.Error(), "fold runner: "+field+" is negative; set 0 for the default") {
			t.Errorf("%s: got %v", field, err)
		}
	}
}

// TestFoldRunnerConfigDefaults: a zero field takes the default its comment
// documents, and the zero config is valid.
func TestFoldRunnerConfigDefaults(t *testing.T) {
	got := FoldRunnerConfig{}.withDefaults()
	want := FoldRunnerConfig{Durable: "compactor", MinVersions: 10000, Interval: 30 * time.Second, Concurrency: 2,
		MaxAckPending: 200000, AckWait: 5 * time.Minute, Fetch: 1000, FetchWait: 30 * time.Second,
		RetryMin: time.Second, RetryMax: time.Minute, Drain: 10 * time.Second, Logger: slog.Default()}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("defaults: %+v, want %+v", got, want)
	}
	if err := (FoldRunnerConfig{}).Validate(); err != nil {
		t.Errorf("the zero config: %v", err)
	}
}
