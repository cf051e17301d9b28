package fleet

import (
	"testing"
	"time"

	"github.com/millrace/millrace/internal/envflag/envflagtest"
)

// The thresholds' flags set the fields they name, and their defaults are
// the Config's.
func TestRegisterFlags(t *testing.T) {
	var c Config
	fs := envflagtest.Parse(t, c.RegisterFlags)
	if c.SuspectAfter != DefaultSuspectAfter || c.UnreachableAfter != DefaultUnreachableAfter || c.ClockSlack != DefaultClockSlack {
		t.Fatalf("defaults %+v", c)
	}
	if err := fs.Parse([]string{"-fleet-suspect-after", "3s", "-fleet-unreachable-after", "9s", "-fleet-clock-slack", "2s"}); err != nil {
		t.Fatal(err)
	}
	if c.SuspectAfter != 3*time.Second || c.UnreachableAfter != 9*time.Second || c.ClockSlack != 2*time.Second {
		t.Fatalf("after the flags %+v", c)
	}
}
