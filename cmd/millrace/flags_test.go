package main

import (
	"flag"
	"strings"
	"testing"
)

func TestParseMemoryLimit(t *testing.T) {
	for in, want := range map[string]int64{
		"off": 0, "0": 0, "960MiB": 960 << 20, "1GiB": 1 << 30, "512KiB": 512 << 10, "4096B": 4096, "123": 123, " 2TiB ": 2 << 40,
	} {
		if got, err := parseMemoryLimit(in); err != nil || got != want {
			t.Errorf("parseMemoryLimit(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "1GB", "-1MiB", "lots", "9999999TiB", "1.5GiB"} {
		if got, err := parseMemoryLimit(in); err == nil {
			t.Errorf("parseMemoryLimit(%q) = %d, want an error", in, got)
		}
	}
}

func TestRedactOptions(t *testing.T) {
	t.Setenv("MILLRACE_BES_REDACT_PATTERNS", "corp-[0-9]{4}\n\nid=[a-z]{3},[a-z]{3}")
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var o besOptions
	o.register(fs)
	if err := fs.Parse([]string{"--bes-redact-pattern", "x{2} y", "--bes-redact-allow", "PATH,ROLE"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := o.config()
	if err != nil {
		t.Fatal(err)
	}
	if cfg.NoRedaction {
		t.Fatal("redaction is off by default")
	}
	for in, want := range map[string]string{
		"a corp-1234 b":              "a <redacted> b",
		"id=abc,def":                 "<redacted>",
		"xx y":                       "<redacted>",
		"--action_env=ROLE=ci":       "--action_env=ROLE=ci",
		"--action_env=HOME=/root":    "--action_env=HOME=<redacted>", // the list replaced the defaults
		"--build_metadata=ROLE=prod": "--build_metadata=ROLE=prod",
	} {
		if got := cfg.Redactor.Arg(in); got != want {
			t.Errorf("Arg(%q) = %q, want %q", in, got, want)
		}
	}
	fs = flag.NewFlagSet("t", flag.ContinueOnError)
	var bad besOptions
	bad.register(fs)
	fs.Parse([]string{"--bes-redact-pattern", "a*"})
	if _, err := bad.config(); err == nil || !strings.Contains(err.Error(), `"a*"`) {
		t.Fatalf("a pattern matching the empty string: %v", err)
	}
}
