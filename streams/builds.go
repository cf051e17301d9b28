package streams

import (
	"context"
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/subjects"
)

// BuildEvents reads and trims builds' subjects wherever the backbone's
// layout keeps them (subjects.BESLayout): each call goes to the stream
// that holds its subject, the one stream BES or a partition's. It is the
// raw archive's Source and Trimmer (archive.Source, archive.Trimmer) and
// the console's Follower.
type BuildEvents struct {
	Layout subjects.BESLayout
	// Streams are the partitions' streams, in partition order.
	Streams []jetstream.Stream
}

// BuildEvents looks up the build events' streams.
func (b *Backbone) BuildEvents(ctx context.Context) (BuildEvents, error) {
	out := BuildEvents{Layout: b.Layout, Streams: make([]jetstream.Stream, b.Layout.N())}
	for p := range out.Streams {
		s, err := b.Stream(ctx, b.Layout.Stream(p))
		if err != nil {
			return out, err
		}
		out.Streams[p] = s
	}
	return out, nil
}

// Subject is where a build's events are (archive.Source, archive.Trimmer).
func (e BuildEvents) Subject(project, invocation string) string {
	return e.Layout.Subject(project, invocation)
}

// Erase erases the events of project's build id, or with id "" of every
// build of project, in every partition (EraseSubjects), calling progress
// (when not nil) as EraseSubjects does, counting the partitions before
// the one it erases. It returns the
// messages erased, also when it fails part way (archive.Eraser).
func (e BuildEvents) Erase(ctx context.Context, project, id string, progress func(erased, total uint64)) (uint64, error) {
	if id != "" {
		s, err := e.Of(e.Subject(project, id))
		if err != nil {
			return 0, err
		}
		return EraseSubjects(ctx, s, e.Subject(project, id), progress)
	}
	var erased uint64
	for p, s := range e.Streams {
		var counted func(erased, total uint64)
		if progress != nil {
			before := erased // the partitions before this one's
			counted = func(n, total uint64) { progress(before+n, before+total) }
		}
		n, err := EraseSubjects(ctx, s, e.Layout.ProjectFilter(p, project), counted)
		erased += n
		if err != nil {
			return erased, err
		}
	}
	return erased, nil
}

// Count counts the messages of project's builds in every partition, and
// its builds (CountSubjects).
func (e BuildEvents) Count(ctx context.Context, project string) (messages uint64, builds int, err error) {
	for p, s := range e.Streams {
		n, b, err := CountSubjects(ctx, s, e.Layout.ProjectFilter(p, project))
		if err != nil {
			return messages, builds, err
		}
		messages, builds = messages+n, builds+b
	}
	return messages, builds, nil
}

// Sample is SampleSubjects of every partition, n in all, each
// partition's share in proportion.
func (e BuildEvents) Sample(ctx context.Context, n int, minMessages uint64) ([]string, error) {
	var out []string
	for p, s := range e.Streams {
		some, err := SampleSubjects(ctx, s, e.Layout.Filter(p), (n+p)/e.Layout.N(), minMessages)
		if err != nil {
			return nil, err
		}
		out = append(out, some...)
	}
	return out, nil
}

// partition is the partition of a build's subject.
func (e BuildEvents) partition(subject string) (int, error) {
	if !e.Layout.Partitioned() {
		return 0, nil
	}
	p, ok := e.Layout.PartitionOf(subject)
	if !ok {
		return 0, fmt.Errorf("%q is not a build's subject of %d partitions", subject, e.Layout.N())
	}
	return p, nil
}

// Of is the stream that holds subject.
func (e BuildEvents) Of(subject string) (jetstream.Stream, error) {
	p, err := e.partition(subject)
	if err != nil {
		return nil, err
	}
	return e.Streams[p], nil
}

// Read is SubjectReader.Read on the stream of subject.
func (e BuildEvents) Read(ctx context.Context, subject string, fn func(seq uint64, at time.Time, subject string, header map[string][]string, data []byte) error) error {
	s, err := e.Of(subject)
	if err != nil {
		return err
	}
	return SubjectReader{Stream: s}.Read(ctx, subject, fn)
}

// Follow is SubjectReader.Follow on the stream of subject.
func (e BuildEvents) Follow(ctx context.Context, subject string, after uint64, fn func(seq uint64, data []byte) error) error {
	s, err := e.Of(subject)
	if err != nil {
		return err
	}
	return SubjectReader{Stream: s}.Follow(ctx, subject, after, fn)
}

// Floor is SubjectTrimmer.Floor on the stream of subject, the holders
// named as in one stream: each holds back by its durable of the subject's
// partition (subjects.BESLayout.Durable).
func (e BuildEvents) Floor(ctx context.Context, subject string, holders []string) (uint64, []string, error) {
	p, err := e.partition(subject)
	if err != nil {
		return 0, nil, err
	}
	named := make([]string, len(holders))
	for i, h := range holders {
		named[i] = e.Layout.Durable(h, p)
	}
	return SubjectTrimmer{Stream: e.Streams[p]}.Floor(ctx, subject, named)
}

// Trim is SubjectTrimmer.Trim on the stream of subject.
func (e BuildEvents) Trim(ctx context.Context, subject string, seq uint64) (uint64, error) {
	s, err := e.Of(subject)
	if err != nil {
		return 0, err
	}
	return SubjectTrimmer{Stream: s}.Trim(ctx, subject, seq)
}
