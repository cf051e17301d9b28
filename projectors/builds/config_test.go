package builds

import (
	"strings"
	"testing"
	"time"
)

func newProjector(t testing.TB, cfg Config) *Projector {
	t.Helper()
	p, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// TestNewConfig: zero takes the default; a negative AbandonAfter is refused
// at start, naming the field, rather than abandoning every build at once.
func TestNewConfig(t *testing.T) {
	if p := newProjector(t, Config{}); p.cfg.AbandonAfter != DefaultAbandonAfter {
		t.Errorf("AbandonAfter %v, want the default %v", p.cfg.AbandonAfter, DefaultAbandonAfter)
	}
	_, err := New(Config{AbandonAfter: -time.Second})
	if err == nil || !strings.Contains(err.Error(), "builds: AbandonAfter -1s is negative; set 0 for the default (30m0s)") {
		t.Errorf("negative AbandonAfter: %v", err)
	}
}
