package redact

import (
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/millrace/millrace/internal/envflag"
)

// Options are the redaction knobs as an operator sets them, on the command
// line or in the environment. The BES edge and `builds scrub` register the
// same ones, so that rows scrubbed after the fact follow the rules the edge
// applies to new events.
type Options struct {
	// Patterns are extra regular expressions (Config.Patterns), one per
	// occurrence of the flag.
	Patterns []string
	// PatternsFile names a file of more patterns, one per line; lines
	// starting with '#' are comments. Empty: none.
	PatternsFile string
	// Allow is Config.Allow as a comma-separated list; empty keeps no
	// value.
	Allow string
}

// patternList is a repeatable flag: each occurrence adds one regular
// expression. A regular expression may hold commas and spaces, so it
// cannot be a comma-separated list.
type patternList []string

func (p *patternList) String() string     { return strings.Join(*p, "\n") }
func (p *patternList) Set(v string) error { *p = append(*p, v); return nil }

// RegisterFlags registers the --bes-redact-* flags that set o, each with
// its variable.
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	// The variable holds one pattern per line rather than what envflag.Var
	// would take (one value), for the same reason the flag repeats.
	if v, ok := os.LookupEnv("MILLRACE_BES_REDACT_PATTERNS"); ok {
		o.Patterns = splitLines(v)
	}
	fs.Var((*patternList)(&o.Patterns), "bes-redact-pattern", "an extra regular expression (RE2) whose matches in build events are redacted; repeat the flag for more [$MILLRACE_BES_REDACT_PATTERNS, one per line]")
	envflag.String(fs, &o.PatternsFile, "bes-redact-patterns-file", "MILLRACE_BES_REDACT_PATTERNS_FILE", "", "file of extra regular expressions to redact, one per line (# comments)")
	envflag.String(fs, &o.Allow, "bes-redact-allow", "MILLRACE_BES_REDACT_ALLOW", strings.Join(DefaultAllow, ","),
		"variable names (of --action_env, --client_env, ..., --build_metadata keys) whose values are kept, comma-separated; NAME* matches a prefix; empty keeps none")
}

// Redactor reads the patterns file and builds the Redactor of o. A pattern
// New refuses is a mistake in the command line (an envflag.UsageError),
// so that the command prints its usage rather than failing as if
// something had gone wrong at run time.
func (o Options) Redactor() (*Redactor, error) {
	patterns := append([]string(nil), o.Patterns...)
	if o.PatternsFile != "" {
		b, err := os.ReadFile(o.PatternsFile)
		if err != nil {
			return nil, fmt.Errorf("redact patterns file: %w", err)
		}
		for _, l := range splitLines(string(b)) {
			if !strings.HasPrefix(l, "#") {
				patterns = append(patterns, l)
			}
		}
	}
	r, err := New(Config{Patterns: patterns, Allow: envflag.SplitList(o.Allow)})
	if err != nil {
		return nil, envflag.Usage(err.Error())
	}
	return r, nil
}

// splitLines is the non-blank lines of s, trimmed.
func splitLines(s string) []string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return out
}
