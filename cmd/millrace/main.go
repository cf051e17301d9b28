// Command millrace runs millrace's services and tools; each subcommand runs
// one service or projector as its own process, and `millrace dev` runs them
// all in one process on embedded defaults.
package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"syscall"

	"github.com/millrace/millrace/internal/cli"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/gcpace"
	"github.com/millrace/millrace/internal/keyfile"
	"github.com/millrace/millrace/internal/logs"
)

// command is one subcommand: its flags are parsed into its own config, then
// its body runs with a context that ends on SIGINT or SIGTERM.
type command = cli.Command

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
	serveConsoleCommand(),
	migrateCommand(),
	streamsApplyCommand(),
	streamsInfoCommand(),
	streamsAccountsCommand(),
	streamsBackupCommand(),
	streamsRestoreCommand(),
	streamsPurgeBESCommand(),
	replayBuildsCommand(),
	replayFleetCommand(),
	buildsShowCommand(),
	buildsScrubCommand(),
	buildsDeleteCommand(),
	projectsRetentionCommand(),
	archiveVerifyCommand(),
	zstdTrainCommand(),
	loadtestFleetCommand(),
	loadtestCommitsCommand(),
	versionCommand(),
}

func main() {
	// The edge allocates per event and spent a third of its CPU in the
	// garbage collector at the default GOGC=100; a fixed GOGC=400 cut that
	// but let memory grow five times as fast as open streams hold it. So
	// the collector is paced by a headroom in bytes over the live heap
	// (internal/gcpace). GOGC in the environment still wins.
	if os.Getenv("GOGC") == "" {
		if err := paceGC(os.Getenv(gcHeadroomEnv)); err != nil {
			fmt.Fprintf(os.Stderr, "millrace: $%s: %v\n", gcHeadroomEnv, err)
			os.Exit(2)
		}
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

// program is millrace: its commands and its usage's intro.
var program = cli.Program{
	Name:     "millrace",
	Intro:    "millrace: an event-sourced pipeline for build and compute infrastructure.",
	Commands: commands,
}

// run dispatches args to a subcommand and returns the exit code.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) int {
	return program.Run(ctx, args, stdout, stderr)
}

// once is the body of a command that runs once and takes no arguments: it
// makes the logger and runs body.
func once(cmd string, lo *logs.Options, body func(ctx context.Context, log *slog.Logger) error) func(context.Context, []string) error {
	return func(ctx context.Context, args []string) error {
		if err := cli.NoArgs(cmd, args); err != nil {
			return err
		}
		log, err := lo.Logger()
		if err != nil {
			return err
		}
		return body(ctx, log)
	}
}

// gcHeadroomEnv sets the most the heap may grow over its live data between
// collections (internal/gcpace).
const gcHeadroomEnv = "MILLRACE_GC_HEADROOM"

// paceGC starts the collector's pacing with the headroom v (empty: the
// default).
func paceGC(v string) error {
	var c gcpace.Config
	if v != "" {
		n, err := envflag.ParseMemoryLimit(v)
		if err != nil {
			return err
		}
		if n <= 0 {
			return fmt.Errorf("headroom %q: want a size above 0, such as 64MiB", v)
		}
		c.Headroom = uint64(n)
	}
	gcpace.Start(c)
	return nil
}
