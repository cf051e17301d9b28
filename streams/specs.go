package streams

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/subjects"
)

// StreamSpecs are the streams millrace needs; Apply creates or updates them.
func StreamSpecs(c Config) []jetstream.StreamConfig {
	c = c.WithDefaults()
	return append(besSpecs(c), []jetstream.StreamConfig{
		{
			Name:        subjects.StreamDead,
			Description: "Messages a projector could not apply, with the reason in Millrace-Dead-Reason",
			Subjects:    []string{subjects.DeadFilter},
			Retention:   jetstream.LimitsPolicy,
			Storage:     jetstream.FileStorage,
			Replicas:    c.Replicas,
			MaxAge:      c.DeadMaxAge,
			Discard:     jetstream.DiscardOld,
			Duplicates:  c.DuplicateWindow,
		},
		{
			Name:        subjects.StreamFleetNodes,
			Description: "GPU node transitions on fleet.node.<pool>.<node>, heartbeat-age batches on fleet.node.<pool>",
			Subjects:    []string{subjects.FleetNodeFilter},
			Retention:   jetstream.LimitsPolicy,
			Storage:     jetstream.FileStorage,
			Replicas:    c.Replicas,
			MaxAge:      c.FleetNodesMaxAge,
			MaxMsgSize:  c.MaxPayload,
			Discard:     jetstream.DiscardOld,
			Duplicates:  c.DuplicateWindow,
		},
		{
			Name:        subjects.StreamFleetResv,
			Description: "GPU reservation requests and cancellations, subject fleet.resv.<pool>",
			Subjects:    []string{subjects.FleetResvFilter},
			Retention:   jetstream.LimitsPolicy,
			Storage:     jetstream.FileStorage,
			Replicas:    c.Replicas,
			MaxAge:      c.FleetResvMaxAge,
			MaxMsgSize:  c.MaxPayload,
			Discard:     jetstream.DiscardOld,
			Duplicates:  c.DuplicateWindow,
		},
		{
			Name:        subjects.StreamFleetPlace,
			Description: "GPU placement decisions, subject fleet.place.<pool>",
			Subjects:    []string{subjects.FleetPlaceFilter},
			Retention:   jetstream.LimitsPolicy,
			Storage:     jetstream.FileStorage,
			Replicas:    c.Replicas,
			MaxAge:      c.FleetPlaceMaxAge,
			MaxMsgSize:  c.MaxPayload,
			Discard:     jetstream.DiscardOld,
			Duplicates:  c.DuplicateWindow,
		},
		{
			// No age or size limit: a version leaves the stream only when
			// the compactor has folded it into a checkpoint. Discard new,
			// so that a full store refuses writes rather than dropping
			// acknowledged versions. Direct gets stay off: a replica may
			// answer them behind the leader, and compare-and-set re-reads
			// a document's last version (docs/design.md, "Streams and subjects").
			Name:        subjects.StreamCommits,
			Description: "Commit log: one message per document version, subject commits.<world>.<doc>; the sequence is the version",
			Subjects:    []string{subjects.CommitsFilter},
			Retention:   jetstream.LimitsPolicy,
			Storage:     jetstream.FileStorage,
			Replicas:    c.Replicas,
			MaxMsgSize:  c.MaxPayload,
			Discard:     jetstream.DiscardNew,
			Duplicates:  c.DuplicateWindow,
		},
	}...)
}

// besSpecs are the build events' streams: BES, or one a partition
// (subjects.BESLayout).
func besSpecs(c Config) []jetstream.StreamConfig {
	l := c.BESLayout()
	out := make([]jetstream.StreamConfig, l.N())
	for p := range out {
		desc := "Bazel build events, one message per event, subject bes.<project>.<invocation>"
		if l.Partitioned() {
			desc = fmt.Sprintf("Bazel build events of partition %d of %d, one message per event, subject bes.%d.<project>.<invocation>", p, l.N(), p)
		}
		out[p] = jetstream.StreamConfig{
			Name:        l.Stream(p),
			Description: desc,
			Subjects:    []string{l.Filter(p)},
			Retention:   jetstream.LimitsPolicy,
			Storage:     jetstream.FileStorage,
			Replicas:    c.Replicas,
			MaxAge:      c.BESMaxAge,
			MaxBytes:    orUnlimited(c.BESMaxBytes),
			MaxMsgSize:  c.MaxPayload,
			Discard:     jetstream.DiscardOld,
			Duplicates:  c.DuplicateWindow,
		}
	}
	return out
}

func orUnlimited(n int64) int64 {
	if n <= 0 {
		return -1
	}
	return n
}

// Apply creates each stream or updates it to the spec. It is idempotent and
// safe to run from every process at start.
func Apply(ctx context.Context, js jetstream.JetStream, specs []jetstream.StreamConfig) error {
	for _, spec := range specs {
		if _, err := js.CreateOrUpdateStream(ctx, spec); err != nil {
			return fmt.Errorf("apply stream %s: %w", spec.Name, err)
		}
	}
	return nil
}

// ConsumerSpec is the durable pull consumer a projector reads through.
// AckAll (KindProjection's policy, consumer.go) lets the runner ack a whole
// batch with one ack of its last message; MaxAckPending stays well above
// the batch size. Attach sets where it starts.
func ConsumerSpec(name, filter string, batch int, ackWait time.Duration) jetstream.ConsumerConfig {
	return jetstream.ConsumerConfig{
		Durable:       name,
		Description:   "millrace projector " + name,
		FilterSubject: filter,
		DeliverPolicy: jetstream.DeliverAllPolicy,
		AckPolicy:     KindProjection.AckPolicy(),
		AckWait:       ackWait,
		MaxDeliver:    -1,
		MaxAckPending: max(4*batch, 10000),
		ReplayPolicy:  jetstream.ReplayInstantPolicy,
	}
}

// CheckLayout refuses a layout of build events other than the one the
// backbone's streams were made with: an edge of another layout would
// publish where no reader looks (or where no stream takes it), and a
// projector would read only some of the builds. A backbone without
// build-event streams takes any layout.
func CheckLayout(ctx context.Context, js jetstream.JetStream, l subjects.BESLayout) error {
	var found []string
	names := js.StreamNames(ctx)
	for name := range names.Name() {
		if name == subjects.StreamBES || isPartitionStream(name) {
			found = append(found, name)
		}
	}
	if err := names.Err(); err != nil {
		return fmt.Errorf("list the streams: %w", err)
	}
	if len(found) == 0 {
		return nil
	}
	want := l.Streams()
	slices.Sort(found)
	sorted := slices.Clone(want)
	slices.Sort(sorted)
	if slices.Equal(found, sorted) {
		return nil
	}
	have := "the one stream " + subjects.StreamBES
	if len(found) > 1 || found[0] != subjects.StreamBES {
		have = fmt.Sprintf("%d partition streams (%s)", len(found), strings.Join(found, ", "))
	}
	return fmt.Errorf("the backbone holds build events in %s, and this process was started with --bes-partitions %d (%s): every process of a backbone needs the partitions it was made with, and changing them is not supported (docs/design.md, \"Partitions\")",
		have, l.N(), strings.Join(want, ", "))
}

// isPartitionStream reports whether name is a partition's stream of build
// events, BES_<number> (an operator's BES_MIRROR is none).
func isPartitionStream(name string) bool {
	n, ok := strings.CutPrefix(name, subjects.StreamBES+"_")
	if !ok || n == "" {
		return false
	}
	_, err := strconv.Atoi(n)
	return err == nil && strings.Trim(n, "0123456789") == ""
}
