package main

import (
	"context"
	"log/slog"
	"os"

	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/internal/resources"
	buildsproj "github.com/millrace/millrace/projectors/builds"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/projectors/placer"
	"github.com/millrace/millrace/streams"
)

// tool opens what ro names for a command that runs once (the backbone as
// client millrace-streams, its reader kept off millrace's durables), runs
// f and closes it.
func tool(ctx context.Context, ro *resources.Options, log *slog.Logger, f func(*resources.Opened) error) error {
	return ro.Run(ctx, "millrace-streams", serviceConsumers(), log, f)
}

// serviceConsumers are the durable consumers millrace's processes use; the
// embedded server's reader identity may not touch them (streams/auth.go).
func serviceConsumers() []string {
	names := []string{buildsproj.ConsumerName, fleetproj.ConsumerName,
		placer.ConsumerName, placer.RequestsConsumer, placer.DecisionsConsumer, commitlog.DefaultDurable}
	// A tool that starts the embedded server knows the compactor's durable
	// only from the environment; a process that runs the fold adds the one
	// its flag names (process.durables).
	if d := os.Getenv("MILLRACE_COMPACTOR_DURABLE"); d != "" && d != commitlog.DefaultDurable {
		names = append(names, d)
	}
	for _, s := range streams.StreamSpecs(streams.Config{}) {
		names = append(names, kafka.Durable(s.Name))
	}
	return names
}
