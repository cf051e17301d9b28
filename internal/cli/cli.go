// Package cli runs the subcommands of a program ("millrace serve bes
// --bes-listen ..."): it finds the command named by the first words of the
// arguments, parses its flags (which may also follow its arguments), checks
// the environment variables behind them (internal/envflag), runs it, and
// turns the outcome into an exit code: 0, 1 for a failure, 2 for a mistake
// in the command line (envflag.UsageError), which also prints the
// command's usage. Help goes to standard output when asked for, to
// standard error with a mistake.
//
// It is the command layer's plumbing, kept apart so that the commands
// themselves are only their flags, their components and their output.
package cli

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"sort"
	"strings"

	"github.com/millrace/millrace/internal/envflag"
)

// Command is one subcommand.
type Command struct {
	// Name is one or more words: "dev", "serve bes".
	Name string
	// Summary is the line the program's usage lists it with.
	Summary string
	// Usage names the arguments after the flags, for the help text.
	Usage string
	// Long is the help text's body; empty: none.
	Long string
	// Flags registers the command's flags on fs and returns the body,
	// called once they are parsed with the arguments that are not flags.
	Flags func(fs *flag.FlagSet) func(ctx context.Context, args []string) error
}

// Program is a set of subcommands under one name.
type Program struct {
	// Name is the program's name ("millrace"), in help texts and errors.
	Name string
	// Intro is the first paragraph of the program's usage.
	Intro    string
	Commands []Command
}

// Run runs the command args name and returns the exit code.
func (p Program) Run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		if len(args) > 1 {
			return p.Run(ctx, append(args[1:], "-h"), stdout, stderr)
		}
		p.Usage(stdout)
		return 0
	}
	cmd, rest, ok := p.find(args)
	if !ok {
		fmt.Fprintf(stderr, "%s: unknown command %q\n\n", p.Name, strings.Join(args, " "))
		p.Usage(stderr)
		return 2
	}
	fs := flag.NewFlagSet(p.Name+" "+cmd.Name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	if slices.ContainsFunc(rest, func(a string) bool { return a == "-h" || a == "-help" || a == "--help" }) {
		fs.SetOutput(stdout) // asked-for help goes to stdout
	}
	body := cmd.Flags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: %s %s [flags] %s\n\n%s\n", p.Name, cmd.Name, cmd.Usage, cmd.Summary)
		if cmd.Long != "" {
			fmt.Fprintf(fs.Output(), "\n%s\n", cmd.Long)
		}
		fmt.Fprintf(fs.Output(), "\nFlags (each also read from the environment variable shown):\n")
		fs.PrintDefaults()
	}
	positional, err := parse(fs, rest)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0 // the flag package printed the usage
		}
		return 2
	}
	if err := envflag.Errors(fs); err != nil {
		fmt.Fprintf(stderr, "%s %s: %v\n", p.Name, cmd.Name, err)
		return 2
	}
	if err := body(ctx, positional); err != nil {
		fmt.Fprintf(stderr, "%s %s: %v\n", p.Name, cmd.Name, err)
		if errors.As(err, new(envflag.UsageError)) {
			fs.Usage()
			return 2
		}
		return 1
	}
	return 0
}

// parse parses the flags of args, which may come after arguments too
// (`builds show ID --json`), and returns the arguments.
func parse(fs *flag.FlagSet, args []string) ([]string, error) {
	var positional []string
	for {
		if err := fs.Parse(args); err != nil {
			return nil, err
		}
		if args = fs.Args(); len(args) == 0 {
			return positional, nil
		}
		positional, args = append(positional, args[0]), args[1:]
	}
}

// find matches the longest command name ("streams apply") at the start of
// args.
func (p Program) find(args []string) (Command, []string, bool) {
	best, n := Command{}, 0
	for _, c := range p.Commands {
		words := strings.Fields(c.Name)
		if len(words) <= len(args) && len(words) > n && strings.Join(args[:len(words)], " ") == c.Name {
			best, n = c, len(words)
		}
	}
	return best, args[n:], n > 0
}

// Usage prints the program's usage: its intro and its commands, sorted.
func (p Program) Usage(w io.Writer) {
	fmt.Fprintf(w, "%s\n\nUsage: %s <command> [flags]\n\nCommands:\n", p.Intro, p.Name)
	cs := slices.Clone(p.Commands)
	sort.SliceStable(cs, func(i, j int) bool { return cs[i].Name < cs[j].Name })
	width := 0
	for _, c := range cs {
		width = max(width, len(c.Name))
	}
	for _, c := range cs {
		fmt.Fprintf(w, "  %-*s  %s\n", width, c.Name, c.Summary)
	}
	fmt.Fprintf(w, "\nRun `%s <command> -h` for a command's flags.\n", p.Name)
}

// NoArgs is the check of a command that takes no arguments.
func NoArgs(cmd string, args []string) error {
	if len(args) > 0 {
		return envflag.Usage(cmd + " takes no arguments")
	}
	return nil
}
