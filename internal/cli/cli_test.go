package cli_test

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"slices"
	"strings"
	"testing"

	"github.com/millrace/millrace/internal/cli"
	"github.com/millrace/millrace/internal/envflag"
)

// program has "show" (one argument, --json, a variable-backed --batch)
// and "show all", so that the longest name wins.
func program(got *[]string) cli.Program {
	body := func(name string, fs *flag.FlagSet, fail error) func(context.Context, []string) error {
		asJSON := fs.Bool("json", false, "print JSON")
		var batch int
		envflag.Int(fs, &batch, "batch", "CLITEST_BATCH", 10, "rows per batch")
		return func(_ context.Context, args []string) error {
			*got = append([]string{name, "json=" + map[bool]string{true: "yes", false: "no"}[*asJSON]}, args...)
			return fail
		}
	}
	return cli.Program{Name: "prog", Intro: "prog: a test program.", Commands: []cli.Command{
		{Name: "show", Summary: "show one", Usage: "<id>", Long: "Shows one thing.", Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			return body("show", fs, nil)
		}},
		{Name: "show all", Summary: "show every one", Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			return body("show all", fs, nil)
		}},
		{Name: "fail", Summary: "fails", Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			return body("fail", fs, errors.New("it broke"))
		}},
		{Name: "misuse", Summary: "a usage error", Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			return body("misuse", fs, envflag.Usage("misuse needs --json"))
		}},
	}}
}

func TestRun(t *testing.T) {
	for _, c := range []struct {
		name           string
		args           []string
		env            string
		code           int
		got            []string
		stdout, stderr string // substrings; "" checks nothing
	}{
		{name: "flags after arguments", args: []string{"show", "id1", "--json"}, got: []string{"show", "json=yes", "id1"}},
		{name: "longest name wins", args: []string{"show", "all"}, got: []string{"show all", "json=no"}},
		{name: "unknown", args: []string{"hide"}, code: 2, stderr: `prog: unknown command "hide"`},
		{name: "failure", args: []string{"fail"}, code: 1, got: []string{"fail", "json=no"}, stderr: "prog fail: it broke"},
		{name: "usage error prints usage", args: []string{"misuse"}, code: 2, got: []string{"misuse", "json=no"}, stderr: "Usage: prog misuse [flags]"},
		{name: "bad flag", args: []string{"show", "--nope"}, code: 2, stderr: "flag provided but not defined"},
		{name: "bad variable", args: []string{"show", "x"}, env: "1k", code: 2, stderr: "CLITEST_BATCH"},
		{name: "help to stdout", args: []string{"show", "-h"}, stdout: "Shows one thing."},
		{name: "help command", args: []string{"help", "show"}, stdout: "Usage: prog show [flags] <id>"},
		{name: "program usage", args: nil, stdout: "  show all  show every one"},
	} {
		t.Run(c.name, func(t *testing.T) {
			if c.env != "" {
				t.Setenv("CLITEST_BATCH", c.env)
			}
			var got []string
			var stdout, stderr bytes.Buffer
			code := program(&got).Run(context.Background(), c.args, &stdout, &stderr)
			if code != c.code {
				t.Fatalf("exit %d, want %d; stderr:\n%s", code, c.code, stderr.String())
			}
			if !slices.Equal(got, c.got) {
				t.Errorf("ran %q, want %q", got, c.got)
			}
			if !strings.Contains(stdout.String(), c.stdout) {
				t.Errorf("stdout %q lacks %q", stdout.String(), c.stdout)
			}
			if !strings.Contains(stderr.String(), c.stderr) {
				t.Errorf("stderr %q lacks %q", stderr.String(), c.stderr)
			}
		})
	}
}

func TestNoArgs(t *testing.T) {
	if err := cli.NoArgs("dev", nil); err != nil {
		t.Fatal(err)
	}
	err := cli.NoArgs("dev", []string{"x"})
	if !errors.As(err, new(envflag.UsageError)) || err.Error() != "dev takes no arguments" {
		t.Fatalf("NoArgs with an argument: %v", err)
	}
}
