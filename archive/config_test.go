package archive_test

import (
	"flag"
	"slices"
	"testing"
	"time"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
)

func TestConfigFlags(t *testing.T) {
	var c archive.Config
	envflagtest.Parse(t, c.RegisterFlags)
	if c.After != archive.DefaultAfter || c.Interval != archive.DefaultInterval || c.Batch != archive.DefaultBatch || c.Off() {
		t.Fatalf("defaults: %+v", c)
	}
	envflagtest.Parse(t, c.RegisterFlags, "--archive-after", "-1s")
	if !c.Off() {
		t.Fatal("a negative --archive-after does not turn archiving off")
	}
	if _, err := envflagtest.ParseErr(t, c.RegisterFlags, "--archive-interval", "-1s"); err == nil {
		t.Fatal("a negative --archive-interval was accepted")
	}
	if _, err := envflagtest.ParseErr(t, func(fs *flag.FlagSet) {
		t.Setenv("MILLRACE_ARCHIVE_BATCH", "ten") // after Clean, before the flag reads it
		c.RegisterFlags(fs)
	}); err == nil {
		t.Fatal("an unparsable MILLRACE_ARCHIVE_BATCH was accepted")
	}
	if err := (archive.Config{Batch: -1}).Validate(); err == nil {
		t.Fatal("Validate accepts a negative Batch")
	}
	if err := (archive.Config{After: -time.Second}).Validate(); err != nil {
		t.Fatalf("Validate refuses a negative After (never): %v", err)
	}
}

// --archive-trim is on by default and a boolean flag; --archive-hold-for
// names consumers, and refuses what cannot be a consumer's name.
func TestTrimFlags(t *testing.T) {
	for _, c := range []struct {
		args   []string
		env    string
		noTrim bool
		hold   []string
	}{
		{nil, "", false, nil},
		{[]string{"--archive-trim=false"}, "", true, nil},
		{[]string{"--archive-trim"}, "false", false, nil},
		{nil, "false", true, nil},
		{[]string{"--archive-hold-for", " mirror, export-a "}, "", false, []string{"mirror", "export-a"}},
	} {
		var cfg archive.Config
		envflagtest.Parse(t, func(fs *flag.FlagSet) {
			if c.env != "" {
				t.Setenv("MILLRACE_ARCHIVE_TRIM", c.env)
			}
			cfg.RegisterFlags(fs)
		}, c.args...)
		if cfg.NoTrim != c.noTrim || !slices.Equal(cfg.HoldFor, c.hold) {
			t.Errorf("%q (MILLRACE_ARCHIVE_TRIM=%q): NoTrim %v, HoldFor %q; want %v, %q", c.args, c.env, cfg.NoTrim, cfg.HoldFor, c.noTrim, c.hold)
		}
	}
	for _, bad := range [][]string{{"--archive-hold-for", "export.bes"}, {"--archive-hold-for", "a b"}, {"--archive-trim=maybe"}} {
		var cfg archive.Config
		if _, err := envflagtest.ParseErr(t, cfg.RegisterFlags, bad...); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	var cfg archive.Config
	if _, err := envflagtest.ParseErr(t, func(fs *flag.FlagSet) {
		t.Setenv("MILLRACE_ARCHIVE_HOLD_FOR", "bes.>")
		cfg.RegisterFlags(fs)
	}); err == nil {
		t.Fatal("MILLRACE_ARCHIVE_HOLD_FOR=bes.> accepted")
	}
	if err := (archive.Config{HoldFor: []string{"x.y"}}).Validate(); err == nil {
		t.Fatal("Validate accepts a holder x.y")
	}
}
