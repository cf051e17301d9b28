package builds

import (
	"flag"
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/envflag"
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

// TestRegisterFlags: the variable sets AbandonAfter, the flag overrides
// it, and a negative value stops the command at start.
func TestRegisterFlags(t *testing.T) {
	t.Setenv("MILLRACE_BUILDS_ABANDON_AFTER", "10m")
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var c Config
	c.RegisterFlags(fs)
	if c.AbandonAfter != 10*time.Minute {
		t.Errorf("MILLRACE_BUILDS_ABANDON_AFTER=10m gave %v", c.AbandonAfter)
	}
	if err := fs.Parse([]string{"-builds-abandon-after=-1s"}); err != nil {
		t.Fatal(err)
	}
	if err := envflag.Errors(fs); err == nil || !strings.Contains(err.Error(), "--builds-abandon-after") {
		t.Errorf("-builds-abandon-after=-1s: %v, want a refusal naming the flag", err)
	}
}
