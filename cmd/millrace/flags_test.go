package main

import (
	"bytes"
	"context"
	"flag"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
	"github.com/millrace/millrace/services/bes"
)

func TestRedactOptions(t *testing.T) {
	t.Setenv("MILLRACE_BES_REDACT_PATTERNS", "corp-[0-9]{4}\n\nid=[a-z]{3},[a-z]{3}")
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var o bes.Options
	o.RegisterFlags(fs)
	if err := fs.Parse([]string{"--bes-redact-pattern", "x{2} y", "--bes-redact-allow", "PATH,ROLE"}); err != nil {
		t.Fatal(err)
	}
	cfg, err := o.Load(context.Background(), newTelemetry().kf, slog.Default())
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
	var bad bes.Options
	bad.RegisterFlags(fs)
	fs.Parse([]string{"--bes-redact-pattern", "a*"})
	if _, err := bad.Load(context.Background(), newTelemetry().kf, slog.Default()); err == nil || !strings.Contains(err.Error(), `"a*"`) {
		t.Fatalf("a pattern matching the empty string: %v", err)
	}
}

// A variable that does not parse stops the command before it starts, and
// the message names the variable; one that parses is taken.
func TestBadEnvironmentFailsAtStart(t *testing.T) {
	for _, c := range []struct {
		cmd      []string
		env, val string
	}{
		{[]string{"project", "builds"}, "MILLRACE_BUILDS_BATCH", "1k"},             // int
		{[]string{"project", "builds"}, "MILLRACE_BUILDS_MAX_WAIT", "250"},         // duration without a unit
		{[]string{"export", "kafka"}, "MILLRACE_KAFKA_CREATE_TOPICS", "yes"},       // bool
		{[]string{"serve", "bes"}, "MILLRACE_BES_MAX_EVENT_BYTES", "4MB"},          // size
		{[]string{"serve", "commits"}, "MILLRACE_COMMITS_MAX_BODY_BYTES", "lots"},  // size
		{[]string{"serve", "bes"}, "MILLRACE_SHUTDOWN_TIMEOUT", "twenty seconds"},  // duration
		{[]string{"project", "fleet"}, "MILLRACE_FLEET_PROJECTOR_BATCH", "1000.5"}, // int
		{[]string{"serve", "fleet"}, "MILLRACE_FLEET_TLS_RESUMPTION", "enabled"},   // bool
		{[]string{"serve", "fleet"}, "MILLRACE_FLEET_MEMORY_LIMIT", "1GB"},         // memory size
		{[]string{"project", "builds"}, "MILLRACE_BUILDS_BATCH", "-5"},             // a negative count
		{[]string{"serve", "commits"}, "MILLRACE_SHUTDOWN_TIMEOUT", "-1s"},         // a negative duration
	} {
		t.Run(c.env, func(t *testing.T) {
			t.Setenv(c.env, c.val)
			var stdout, stderr bytes.Buffer
			ctx, cancel := context.WithCancel(context.Background())
			cancel() // nothing may start: a command that got past the check ends at once
			code := run(ctx, c.cmd, &stdout, &stderr)
			if code != 2 || !strings.Contains(stderr.String(), c.env) || !strings.Contains(stderr.String(), c.val) {
				t.Fatalf("%s=%s: exit %d, stderr %q; want exit 2 naming the variable and its value", c.env, c.val, code, stderr.String())
			}
		})
	}
}

func TestEnvironmentSizes(t *testing.T) {
	t.Setenv("MILLRACE_BES_MAX_EVENT_BYTES", "2MiB")
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var o bes.Options
	o.RegisterFlags(fs)
	if err := envflag.Errors(fs); err != nil {
		t.Fatal(err)
	}
	if o.Config.MaxEventBytes != 2<<20 {
		t.Fatalf("MILLRACE_BES_MAX_EVENT_BYTES=2MiB gave %d", o.Config.MaxEventBytes)
	}
	if err := fs.Parse([]string{"-bes-max-event-bytes=512KiB"}); err != nil || o.Config.MaxEventBytes != 512<<10 {
		t.Fatalf("-bes-max-event-bytes=512KiB gave %d, %v", o.Config.MaxEventBytes, err)
	}
	if err := fs.Parse([]string{"-bes-max-event-bytes=1k"}); err == nil {
		t.Fatal("-bes-max-event-bytes=1k was accepted")
	}
}

// TestBuildsBatching: the builds projector's default wait keeps the
// projection's lag within half of its second, and a batch holds what 1,000
// paced streams (2,500 events/s) send meanwhile twice over, so that a
// caught-up projector takes one batch per wait: fewer, larger batches
// write fewer invocation rows per event (projectors/builds/README.md,
// "Cost").
func TestBuildsBatching(t *testing.T) {
	var o projectorOptions
	envflagtest.Parse(t, o.register)
	if o.rc.MaxWait <= 250*time.Millisecond || o.rc.MaxWait > 500*time.Millisecond {
		t.Errorf("--builds-max-wait defaults to %v, want more than 250ms and at most 500ms", o.rc.MaxWait)
	}
	if sent := int(2500 * o.rc.MaxWait.Seconds()); o.rc.Batch < 2*sent {
		t.Errorf("--builds-batch defaults to %d, want at least twice the %d events sent in the wait", o.rc.Batch, sent)
	}
}
