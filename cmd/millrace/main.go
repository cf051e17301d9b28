// Command millrace runs millrace's services and tools; each subcommand runs
// one service or projector as its own process, and `millrace dev` runs them
// all in one process on embedded defaults.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"runtime/debug"
	"slices"
	"sort"
	"strings"
	"syscall"

	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/logs"
)

// command is one subcommand: its flags are parsed into its own config, then
// run is called with a context that ends on SIGINT or SIGTERM.
type command struct {
	name    string
	summary string
	usage   string // arguments after the flags, for the help text
	long    string
	flags   func(fs *flag.FlagSet) func(ctx context.Context, args []string) error
}

var commands = []command{
	devCommand(),
	serveBESCommand(),
	projectBuildsCommand(),
	serveFleetCommand(),
	serveReservationsCommand(),
	projectFleetCommand(),
	projectPlacerCommand(),
	serveCommitsCommand(),
	projectCompactorCommand(),
	exportKafkaCommand(),
	migrateCommand(),
	streamsApplyCommand(),
	streamsInfoCommand(),
	streamsPurgeBESCommand(),
	replayBuildsCommand(),
	replayFleetCommand(),
	buildsShowCommand(),
	buildsScrubCommand(),
	loadtestFleetCommand(),
	loadtestCommitsCommand(),
	versionCommand(),
}

func main() {
	// The edge allocates per event and spent a third of its CPU in the
	// garbage collector at the default GOGC=100; at 400 it used about 30%
	// less CPU per event (make bench) for a heap of some tens of MB more.
	// GOGC in the environment still wins.
	if os.Getenv("GOGC") == "" {
		debug.SetGCPercent(400)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	// SIGHUP reads every key file again at once (they are also checked
	// every second), for an operator revoking a leaked key.
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	go func() {
		for range hup {
			keyfile.ReloadAll()
		}
	}()
	code := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

// run dispatches args to a subcommand and returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	if len(args) == 0 || args[0] == "help" || args[0] == "-h" || args[0] == "--help" {
		if len(args) > 1 {
			return run(ctx, append(args[1:], "-h"), stdout, stderr)
		}
		usage(stdout)
		return 0
	}
	cmd, rest, ok := find(args)
	if !ok {
		fmt.Fprintf(stderr, "millrace: unknown command %q\n\n", strings.Join(args, " "))
		usage(stderr)
		return 2
	}
	fs := flag.NewFlagSet("millrace "+cmd.name, flag.ContinueOnError)
	fs.SetOutput(stderr)
	if slices.ContainsFunc(rest, func(a string) bool { return a == "-h" || a == "-help" || a == "--help" }) {
		fs.SetOutput(stdout) // asked-for help goes to stdout
	}
	runFn := cmd.flags(fs)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: millrace %s [flags] %s\n\n%s\n", cmd.name, cmd.usage, cmd.summary)
		if cmd.long != "" {
			fmt.Fprintf(fs.Output(), "\n%s\n", cmd.long)
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
		fmt.Fprintf(stderr, "millrace %s: %v\n", cmd.name, err)
		return 2
	}
	if err := runFn(ctx, positional); err != nil {
		fmt.Fprintf(stderr, "millrace %s: %v\n", cmd.name, err)
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

// once is the body of a command that runs once and takes no arguments: it
// makes the logger and runs body.
func once(cmd string, lo *logs.Options, body func(ctx context.Context, log *slog.Logger) error) func(context.Context, []string) error {
	return func(ctx context.Context, args []string) error {
		if len(args) > 0 {
			return envflag.Usage(cmd + " takes no arguments")
		}
		log, err := lo.Logger()
		if err != nil {
			return err
		}
		return body(ctx, log)
	}
}

// find matches the longest command name ("streams apply") at the start of args.
func find(args []string) (command, []string, bool) {
	best, n := command{}, 0
	for _, c := range commands {
		words := strings.Fields(c.name)
		if len(words) <= len(args) && len(words) > n && strings.Join(args[:len(words)], " ") == c.name {
			best, n = c, len(words)
		}
	}
	return best, args[n:], n > 0
}

func usage(w io.Writer) {
	fmt.Fprintf(w, "millrace: an event-sourced pipeline for build and compute infrastructure.\n\nUsage: millrace <command> [flags]\n\nCommands:\n")
	cs := append([]command(nil), commands...)
	sort.SliceStable(cs, func(i, j int) bool { return cs[i].name < cs[j].name })
	width := 0
	for _, c := range cs {
		width = max(width, len(c.name))
	}
	for _, c := range cs {
		fmt.Fprintf(w, "  %-*s  %s\n", width, c.name, c.summary)
	}
	fmt.Fprintf(w, "\nRun `millrace <command> -h` for a command's flags.\n")
}
