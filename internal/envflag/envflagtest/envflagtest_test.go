package envflagtest_test

import (
	"flag"
	"os"
	"testing"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
)

// A variable set outside the test does not reach the flags; one set inside
// register does; a bad one is an error.
func TestParse(t *testing.T) {
	t.Setenv("MILLRACE_ENVFLAGTEST_N", "7")
	t.Setenv("DATABASE_URL", "postgres://elsewhere")
	var n int
	var url string
	register := func(fs *flag.FlagSet) {
		envflag.Int(fs, &n, "n", "MILLRACE_ENVFLAGTEST_N", 3, "n")
		envflag.String(fs, &url, "database-url", "DATABASE_URL", "", "url")
	}
	envflagtest.Parse(t, register)
	if n != 3 || url != "" {
		t.Fatalf("the caller's environment leaked in: n=%d url=%q", n, url)
	}
	if _, ok := os.LookupEnv("MILLRACE_ENVFLAGTEST_N"); ok {
		t.Fatal("the variable is still set after Clean")
	}
	envflagtest.Parse(t, func(fs *flag.FlagSet) { t.Setenv("MILLRACE_ENVFLAGTEST_N", "9"); register(fs) })
	if n != 9 {
		t.Fatalf("a variable set in register: n=%d, want 9", n)
	}
	if _, err := envflagtest.ParseErr(t, func(fs *flag.FlagSet) { t.Setenv("MILLRACE_ENVFLAGTEST_N", "1k"); register(fs) }); err == nil {
		t.Fatal("a variable that does not parse was accepted")
	}
	if _, err := envflagtest.ParseErr(t, register, "-n", "-1"); err == nil {
		t.Fatal("a negative count was accepted")
	}
}
