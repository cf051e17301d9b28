package kafka

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/millrace/millrace/subjects"
)

// DefaultRoutes sends every stream of millrace to a topic of its own.
const DefaultRoutes = subjects.BESFilter + " -> millrace.bes, " +
	subjects.FleetNodeFilter + " -> millrace.fleet.nodes, " +
	subjects.FleetResvFilter + " -> millrace.reservations, " +
	subjects.FleetPlaceFilter + " -> millrace.placements, " +
	subjects.CommitsFilter + " -> millrace.commits"

// Durable is the name of the JetStream consumer that exports stream: its
// ack floor is the export's position in that stream.
func Durable(stream string) string { return "export-kafka-" + strings.ToLower(stream) }

// ByStream groups the routes' filters by the streams that hold their
// subjects, for one export consumer per stream. streamsOf names the
// streams a filter falls in, each with the filter narrowed to its
// subjects (streams.StreamsOf: this package sees no streams): one
// stream, or with partitioned build events every partition's for a
// filter of them; names are the streams, for the error. A route whose
// subjects no stream, or set of partitions, holds is refused.
func ByStream(routes []Route, streamsOf func(filter string) (map[string]string, bool), names []string) (map[string][]string, error) {
	filters := map[string][]string{}
	for _, r := range routes {
		held, ok := streamsOf(r.Filter)
		if !ok {
			return nil, fmt.Errorf("route %s -> %s: no millrace stream holds every subject of %q (streams: %s)",
				r.Filter, r.Topic, r.Filter, strings.Join(names, ", "))
		}
		for stream, filter := range held {
			filters[stream] = append(filters[stream], filter)
		}
	}
	return filters, nil
}

// WaitTopics makes sure of the topics (EnsureTopics), trying again while
// the brokers are away or refuse: after a second, doubling up to 30 s. It
// returns nil once they are there, ctx's error if ctx ends first.
func (e *Exporter) WaitTopics(ctx context.Context) error {
	for wait := time.Second; ; wait = min(2*wait, 30*time.Second) {
		tctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := e.EnsureTopics(tctx)
		cancel()
		if err == nil {
			return nil
		}
		if ctx.Err() != nil {
			return ctx.Err()
		}
		e.cfg.Logger.Warn("topics not ready; export waits", "err", err, "retry_in", wait)
		t := time.NewTimer(wait)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		}
	}
}

// Reads reports whether routes export anything of stream (streamOf as for
// ByStream): then the export's consumer of it, Durable(stream), must hold
// back whatever would delete from stream what it has not sent.
func Reads(routes []Route, stream string, streamOf func(filter string) (string, bool)) bool {
	for _, r := range routes {
		if s, ok := streamOf(r.Filter); ok && s == stream {
			return true
		}
	}
	return false
}
