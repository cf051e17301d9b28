package streams

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/subjects"
)

// StreamSpecs are the streams millrace needs; Apply creates or updates them.
func StreamSpecs(c Config) []jetstream.StreamConfig {
	c = c.WithDefaults()
	return []jetstream.StreamConfig{
		{
			Name:        subjects.StreamBES,
			Description: "Bazel build events, one message per event, subject bes.<project>.<invocation>",
			Subjects:    []string{subjects.BESFilter},
			Retention:   jetstream.LimitsPolicy,
			Storage:     jetstream.FileStorage,
			Replicas:    c.Replicas,
			MaxAge:      c.BESMaxAge,
			MaxBytes:    orUnlimited(c.BESMaxBytes),
			MaxMsgSize:  c.MaxPayload,
			Discard:     jetstream.DiscardOld,
			Duplicates:  c.DuplicateWindow,
		},
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
	}
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
