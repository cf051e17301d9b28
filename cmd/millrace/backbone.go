package main

import (
	"context"
	"os"

	"github.com/millrace/millrace/commitlog"
	buildsproj "github.com/millrace/millrace/projectors/builds"
	fleetproj "github.com/millrace/millrace/projectors/fleet"
	"github.com/millrace/millrace/projectors/kafka"
	"github.com/millrace/millrace/projectors/placer"
	"github.com/millrace/millrace/streams"
)

// openBackbone opens the backbone o names as client name, its reader kept
// off millrace's durables (serviceConsumers).
func openBackbone(ctx context.Context, o streams.Options, name string, m *streams.Metrics) (*streams.Backbone, streams.Config, error) {
	return o.Open(ctx, name, serviceConsumers(), m)
}

// withBackbone opens the backbone for a tool, runs f and closes it.
func withBackbone(ctx context.Context, o streams.Options, f func(*streams.Backbone, streams.Config) error) error {
	bb, c, err := openBackbone(ctx, o, "millrace-streams", nil)
	if err != nil {
		return err
	}
	defer bb.Close()
	return f(bb, c)
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
