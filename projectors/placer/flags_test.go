package placer

import (
	"testing"
	"time"

	"github.com/millrace/millrace/internal/envflag/envflagtest"
)

// The release policies' flags set the fields they name, and their
// defaults are the Config's.
func TestRegisterFlags(t *testing.T) {
	var c Config
	fs := envflagtest.Parse(t, c.RegisterFlags)
	if c.BindTimeout != DefaultBindTimeout || c.PendingTimeout != DefaultPendingTimeout || c.UnbindRetry != DefaultUnbindRetry {
		t.Fatalf("defaults %+v", c)
	}
	if err := fs.Parse([]string{"-placer-bind-timeout", "3s", "-placer-pending-timeout", "9s", "-placer-unbind-retry", "2s"}); err != nil {
		t.Fatal(err)
	}
	if c.BindTimeout != 3*time.Second || c.PendingTimeout != 9*time.Second || c.UnbindRetry != 2*time.Second {
		t.Fatalf("after the flags %+v", c)
	}
}
