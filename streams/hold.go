package streams

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/subjects"
)

// HoldFloor is the lowest ack floor among the durable consumers of stream
// that hold deletions on filter back: the holders named, and, with
// everyDurable, every durable consumer of the stream. Only those whose
// subjects overlap filter count. A named holder that does not exist holds
// everything back (the floor is 0) and is returned in missing, so that a
// consumer not yet created, or deleted by mistake, cannot lose what it was
// to read. With no holder at all the floor is math.MaxUint64.
//
// Two users: the commit log's fold (commitlog.HoldFor) and the builds
// archive, whose raw events leave BES only once every reader has them.
func HoldFloor(ctx context.Context, stream jetstream.Stream, filter string, holders []string, everyDurable bool) (floor uint64, missing []string, err error) {
	floor = math.MaxUint64
	seen := map[string]bool{}
	take := func(ci *jetstream.ConsumerInfo) {
		seen[ci.Name] = true
		filters := ci.Config.FilterSubjects
		if ci.Config.FilterSubject != "" {
			filters = append(filters, ci.Config.FilterSubject)
		}
		if len(filters) == 0 || slices.ContainsFunc(filters, func(f string) bool { return subjects.Overlap(f, filter) }) {
			floor = min(floor, ci.AckFloor.Stream)
		}
	}
	if everyDurable {
		lister := stream.ListConsumers(ctx)
		for ci := range lister.Info() {
			if ci.Config.Durable != "" {
				take(ci)
			}
		}
		if err := lister.Err(); err != nil && !errors.Is(err, jetstream.ErrEndOfData) {
			return 0, nil, fmt.Errorf("the consumers that hold deletions back: %w", err)
		}
	}
	for _, name := range holders {
		if seen[name] {
			continue
		}
		c, err := stream.Consumer(ctx, name)
		switch {
		case errors.Is(err, jetstream.ErrConsumerNotFound):
			missing = append(missing, name)
			floor = 0
			continue
		case err != nil:
			return 0, nil, fmt.Errorf("the position of %s, which holds deletions back: %w", name, err)
		}
		take(c.CachedInfo())
	}
	return floor, missing, nil
}

// TrimSubject removes the messages of stream on subject at or below seq
// (a purge by subject and sequence: later messages of the subject stay).
func TrimSubject(ctx context.Context, stream jetstream.Stream, subject string, seq uint64) error {
	if err := stream.Purge(ctx, jetstream.WithPurgeSubject(subject), jetstream.WithPurgeSequence(seq+1)); err != nil {
		return fmt.Errorf("trim %s up to %d: %w", subject, seq, err)
	}
	return nil
}

// SubjectTrimmer trims subjects of one stream once every durable consumer
// of it, and the holders named, have read them: the raw archive's Trimmer
// (archive.Trimmer), which takes no NATS type.
type SubjectTrimmer struct{ Stream jetstream.Stream }

// Subject is where a build's events are in the one-stream layout
// (archive.Trimmer; BuildEvents for partitioned ones).
func (SubjectTrimmer) Subject(project, invocation string) string {
	return subjects.BES(project, invocation)
}

// Floor is HoldFloor over subject with every durable consumer of the
// stream holding too.
func (t SubjectTrimmer) Floor(ctx context.Context, subject string, holders []string) (uint64, []string, error) {
	return HoldFloor(ctx, t.Stream, subject, holders, true)
}

// Trim is TrimSubject, and returns how many messages of subject left the
// stream (the subject's count before less after: a message stored on it
// meanwhile makes it smaller, never larger).
func (t SubjectTrimmer) Trim(ctx context.Context, subject string, seq uint64) (uint64, error) {
	before, err := t.count(ctx, subject)
	if err != nil {
		return 0, err
	}
	if err := TrimSubject(ctx, t.Stream, subject, seq); err != nil {
		return 0, err
	}
	after, err := t.count(ctx, subject)
	if err != nil || after > before {
		return 0, err
	}
	return before - after, nil
}

// count is how many messages of the stream are on subject.
func (t SubjectTrimmer) count(ctx context.Context, subject string) (uint64, error) {
	info, err := t.Stream.Info(ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		return 0, fmt.Errorf("count %s: %w", subject, err)
	}
	return info.State.Subjects[subject], nil
}
