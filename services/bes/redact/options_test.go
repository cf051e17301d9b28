package redact_test

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/services/bes/redact"
)

// Patterns come from the variable (one per line), the repeated flag and
// the patterns file (whose # lines are comments); a pattern New refuses
// is a mistake in the command line, a file that cannot be read is not.
func TestOptionsRedactor(t *testing.T) {
	t.Setenv("MILLRACE_BES_REDACT_PATTERNS", "env-[0-9]{3}\n\n  ")
	file := filepath.Join(t.TempDir(), "patterns")
	if err := os.WriteFile(file, []byte("# corp-1234 is not a pattern\nfile-[0-9]{3}\n\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var o redact.Options
	o.RegisterFlags(fs)
	if err := fs.Parse([]string{"--bes-redact-pattern", "flag-[0-9]{3}", "--bes-redact-patterns-file", file}); err != nil {
		t.Fatal(err)
	}
	r, err := o.Redactor()
	if err != nil {
		t.Fatal(err)
	}
	for in, want := range map[string]string{
		"a env-123 b":                  "a <redacted> b",
		"a flag-123 b":                 "a <redacted> b",
		"a file-123 b":                 "a <redacted> b",
		"# corp-1234 is not a pattern": "# corp-1234 is not a pattern",
		"--action_env=HOME=/root":      "--action_env=HOME=/root", // the default allow list
	} {
		if got := r.Arg(in); got != want {
			t.Errorf("Arg(%q) = %q, want %q", in, got, want)
		}
	}

	var usage envflag.UsageError
	if _, err := (redact.Options{Patterns: []string{"a*"}}).Redactor(); !errors.As(err, &usage) || !strings.Contains(err.Error(), `"a*"`) {
		t.Errorf("a pattern matching the empty string: %v, want a usage error naming it", err)
	}
	_, err = (redact.Options{PatternsFile: filepath.Join(t.TempDir(), "missing")}).Redactor()
	if err == nil || errors.As(err, &usage) || !strings.Contains(err.Error(), "redact patterns file") {
		t.Errorf("a missing patterns file: %v, want an error that is not a usage error", err)
	}
}
