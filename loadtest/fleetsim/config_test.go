package fleetsim_test

import (
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/loadtest/fleetsim"
)

// TestValidateNamesNegatives: each negative count, rate or duration without
// a meaning for negative is refused, naming its flag; those with one
// (Ramp, CrashFor, ReservationHold, SilenceTimeout, GaugeInterval,
// ProgressEvery, GCPercent) are taken.
func TestValidateNamesNegatives(t *testing.T) {
	for field, set := range map[string]func(*fleetsim.Config){
		"-nodes":             func(c *fleetsim.Config) { c.Nodes = -1 },
		"-first-node":        func(c *fleetsim.Config) { c.FirstNode = -1 },
		"-join-concurrency":  func(c *fleetsim.Config) { c.JoinConcurrency = -1 },
		"-duration":          func(c *fleetsim.Config) { c.Duration = -1 },
		"-settle":            func(c *fleetsim.Config) { c.Settle = -1 },
		"-storm-at":          func(c *fleetsim.Config) { c.StormAt = -1 },
		"-unreachable-after": func(c *fleetsim.Config) { c.UnreachableAfter = -1 },
		"-status-rate":       func(c *fleetsim.Config) { c.StatusRate = -1 },
		"-crash-rate":        func(c *fleetsim.Config) { c.CrashRate = -1 },
		"-reservation-rate":  func(c *fleetsim.Config) { c.ReservationRate = -1 },
		"-liveness-samples":  func(c *fleetsim.Config) { c.LivenessSamples = -1 },
	} {
		c := fleetsim.Config{CACert: "ca.pem", CAKey: "ca-key.pem"}
		set(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), field+" -1") {
			t.Errorf("%s negative: %v, want an error naming the flag", field, err)
		}
	}
	never := fleetsim.Config{CACert: "ca.pem", CAKey: "ca-key.pem", Ramp: -1, CrashFor: -1, ReservationHold: -time.Second,
		SilenceTimeout: -1, GaugeInterval: -1, ProgressEvery: -1, GCPercent: -1}
	if err := never.Validate(); err != nil {
		t.Errorf("the negatives that mean something: %v", err)
	}
}
