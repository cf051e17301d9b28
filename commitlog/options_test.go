package commitlog

import (
	"errors"
	"flag"
	"slices"
	"strings"
	"testing"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
)

func parseOptions(t *testing.T, args ...string) Options {
	t.Helper()
	envflagtest.Clean(t)
	var o Options
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	o.RegisterFlags(fs, "")
	if err := fs.Parse(args); err != nil {
		t.Fatal(err)
	}
	return o
}

// --compactor-hold names the holders; empty, they are the default's (asked
// only then), and "none" is an explicit empty list.
func TestOptionsHold(t *testing.T) {
	asked := false
	def := func() ([]string, error) { asked = true; return []string{"export-a"}, nil }
	for _, c := range []struct {
		args []string
		def  func() ([]string, error)
		want []string
	}{
		{nil, nil, nil},
		{nil, def, []string{"export-a"}},
		{[]string{"--compactor-hold", "none"}, nil, []string{}},
		{[]string{"--compactor-hold", " mirror, export-b "}, nil, []string{"mirror", "export-b"}},
	} {
		rc, err := parseOptions(t, c.args...).Config(0, c.def, nil)
		if err != nil || !slices.Equal(rc.HoldFor, c.want) || (rc.HoldFor == nil) != (c.want == nil) {
			t.Errorf("%q: holders %#v, %v; want %#v", c.args, rc.HoldFor, err, c.want)
		}
	}
	asked = false
	if _, err := parseOptions(t, "--compactor-hold", "mirror").Config(0, def, nil); err != nil || asked {
		t.Fatalf("a named holder: %v, default asked %v", err, asked)
	}
	broken := errors.New("the default cannot tell")
	if _, err := parseOptions(t).Config(0, func() ([]string, error) { return nil, broken }, nil); !errors.Is(err, broken) {
		t.Fatalf("the default's error: %v", err)
	}
	for _, bad := range [][]string{{"--compactor-hold", ","}, {"--compactor-hold", "export.commits"}} {
		if rc, err := parseOptions(t, bad...).Config(0, nil, nil); !errors.As(err, new(envflag.UsageError)) {
			t.Errorf("%q: %v, holders %q; want a usage error", bad, err, rc.HoldFor)
		}
	}
}

// A flag the fold cannot work with is a usage error naming it: the flags
// show their defaults, so a zero is not taken for one.
func TestOptionsRefuse(t *testing.T) {
	for flag, want := range map[string]string{
		"--compactor-min-versions":    "--compactor-min-versions must be at least 1",
		"--compactor-interval":        "--compactor-interval must be positive",
		"--compactor-concurrency":     "--compactor-concurrency must be at least 1",
		"--compactor-max-ack-pending": "--compactor-max-ack-pending must be positive",
		"--compactor-ack-wait":        "--compactor-ack-wait must be positive",
	} {
		_, err := parseOptions(t, flag, "0").Config(0, nil, nil)
		if !errors.As(err, new(envflag.UsageError)) || err.Error() != want {
			t.Errorf("%s 0: %v; want the usage error %q", flag, err, want)
		}
	}
	// What only Validate knows is a usage error too.
	_, err := parseOptions(t, "--compactor-max-ack-pending", "10").Config(0, nil, nil)
	if !errors.As(err, new(envflag.UsageError)) || !strings.Contains(err.Error(), "max ack pending 10 must be at least twice the fetch size") {
		t.Errorf("max ack pending below two fetches: %v", err)
	}
	rc, err := parseOptions(t).Config(7, nil, nil)
	if err != nil || rc.Drain != 7 || rc.Durable != DefaultDurable || rc.MinVersions != DefaultMinVersions || rc.AckWait != DefaultAckWait {
		t.Errorf("the defaults: %+v, %v", rc, err)
	}
}

// Durable is the name the flags ask for, the default without one: the
// name a process keeps off its read-only identities.
func TestOptionsDurable(t *testing.T) {
	if d := parseOptions(t).Durable(); d != DefaultDurable {
		t.Errorf("no --compactor-durable: %q, want %q", d, DefaultDurable)
	}
	if d := parseOptions(t, "--compactor-durable", "folder").Durable(); d != "folder" {
		t.Errorf("--compactor-durable folder: %q", d)
	}
	if d := (Options{}).Durable(); d != DefaultDurable {
		t.Errorf("unregistered options: %q, want %q", d, DefaultDurable)
	}
}

// --compactor-hold's help says what the caller's default holds back.
func TestOptionsHoldHelp(t *testing.T) {
	for help, want := range map[string]string{"": "empty: none;", "the export's": "empty: the export's;"} {
		var o Options
		fs := flag.NewFlagSet("t", flag.ContinueOnError)
		o.RegisterFlags(fs, help)
		if u := fs.Lookup("compactor-hold").Usage; !strings.Contains(u, want) {
			t.Errorf("default help %q: the flag's help %q does not say %q", help, u, want)
		}
	}
}
