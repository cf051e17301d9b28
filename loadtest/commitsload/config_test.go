package commitsload

import (
	"strings"
	"testing"
)

// TestValidateNamesNegatives: each negative rate, count or duration is
// refused, naming its flag (ProgressEvery alone means something negative:
// no progress lines).
func TestValidateNamesNegatives(t *testing.T) {
	for field, set := range map[string]func(*Config){
		"-rate":           func(c *Config) { c.Rate = -1 },
		"-writes":         func(c *Config) { c.Writes = -1 },
		"-duration":       func(c *Config) { c.Duration = -1 },
		"-warmup":         func(c *Config) { c.Warmup = -1 },
		"-rpc-timeout":    func(c *Config) { c.RPCTimeout = -1 },
		"-verify-timeout": func(c *Config) { c.VerifyTimeout = -1 },
	} {
		c := Config{APIKey: testKey}
		set(&c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), field+" -1") {
			t.Errorf("%s negative: %v, want an error naming the flag", field, err)
		}
	}
	if err := (Config{APIKey: testKey, ProgressEvery: -1}).Validate(); err != nil {
		t.Errorf("negative ProgressEvery (no progress lines): %v", err)
	}
}
