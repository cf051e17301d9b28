package agent

import (
	"testing"
	"time"
)

// TestSettingsDefaults: zero Settings take the documented defaults.
func TestSettingsDefaults(t *testing.T) {
	var s Settings
	lo, hi := s.backoff()
	for name, c := range map[string]struct{ got, want time.Duration }{
		"DefaultHeartbeat": {s.heartbeat(0), DefaultHeartbeat},
		"HelloTimeout":     {s.helloTimeout(), DefaultHelloTimeout},
		"SilenceTimeout":   {s.silence(3 * time.Second), DefaultSilenceBeats * 3 * time.Second},
		"BackoffMin":       {lo, DefaultBackoffMin},
		"BackoffMax":       {hi, DefaultBackoffMax},
		"GaugeInterval":    {s.gaugeInterval(), DefaultGaugeInterval},
	} {
		if c.got != c.want {
			t.Errorf("%s: %v, want %v", name, c.got, c.want)
		}
	}
}
