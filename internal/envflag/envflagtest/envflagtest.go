// Package envflagtest parses a package's flags in a test as a command
// would, with the environment of the machine running the test out of the
// way: a MILLRACE_NATS_URL or MILLRACE_HTTP_INSECURE_OPEN set in the
// developer's shell must not change what a test of defaults sees.
package envflagtest

import (
	"flag"
	"os"
	"strings"
	"testing"

	"github.com/millrace/millrace/internal/envflag"
)

// Variables outside the MILLRACE_ prefix that flags read.
var others = []string{"DATABASE_URL", "RETENTION_RAW_DAYS"}

// Clean unsets, for the rest of the test, every MILLRACE_* variable and
// the other variables millrace's flags read. Like t.Setenv, it may not be
// used in parallel tests.
func Clean(t testing.TB) {
	t.Helper()
	for _, kv := range os.Environ() {
		k, _, _ := strings.Cut(kv, "=")
		if strings.HasPrefix(k, "MILLRACE_") {
			unset(t, k)
		}
	}
	for _, k := range others {
		unset(t, k)
	}
}

func unset(t testing.TB, k string) {
	t.Setenv(k, "") // restored when the test ends
	os.Unsetenv(k)
}

// Parse cleans the environment (Clean), then registers flags with register
// on a new flag set, parses args and checks the variables as a command does
// (envflag.Errors); it fails the test on an error. Set a variable the case
// needs with t.Setenv inside register, before the flags that read it are
// registered, or use ParseErr.
func Parse(t testing.TB, register func(*flag.FlagSet), args ...string) *flag.FlagSet {
	t.Helper()
	fs, err := ParseErr(t, register, args...)
	if err != nil {
		t.Fatal(err)
	}
	return fs
}

// ParseErr is Parse returning the error of parsing or of the variables
// rather than failing the test.
func ParseErr(t testing.TB, register func(*flag.FlagSet), args ...string) (*flag.FlagSet, error) {
	t.Helper()
	Clean(t)
	fs := flag.NewFlagSet(t.Name(), flag.ContinueOnError)
	fs.SetOutput(testWriter{t})
	register(fs)
	if err := fs.Parse(args); err != nil {
		return fs, err
	}
	return fs, envflag.Errors(fs)
}

// testWriter sends the flag package's complaints to the test log.
type testWriter struct{ t testing.TB }

func (w testWriter) Write(b []byte) (int, error) {
	w.t.Helper()
	w.t.Log(strings.TrimRight(string(b), "\n"))
	return len(b), nil
}
