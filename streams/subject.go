package streams

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/subjects"
)

// StoredMsg is one stored message of a subject as ReadSubject hands it
// over: every field JetStream stored. Header is the message's own map:
// the callee may keep it.
type StoredMsg struct {
	Seq     uint64
	Time    time.Time
	Subject string
	Header  map[string][]string
	Data    []byte
}

// ReadSubject calls fn with every message of s on subject, in stream
// order, from the first to the last stored when it starts (what arrives
// meanwhile may or may not be included). It reads with an ordered
// consumer, in batches bounded in bytes, so memory does not grow with the
// subject's size; an error of fn ends it.
func ReadSubject(ctx context.Context, s jetstream.Stream, subject string, fn func(StoredMsg) error) error {
	return SubjectReader{s}.Read(ctx, subject, func(seq uint64, at time.Time, subject string, h map[string][]string, data []byte) error {
		return fn(StoredMsg{Seq: seq, Time: at, Subject: subject, Header: h, Data: data})
	})
}

// SubjectReader reads subjects of one stream (ReadSubject), handing each
// message's fields over as they are: the raw archive's Source
// (archive.Source) without a type of either package in the other's.
type SubjectReader struct{ Stream jetstream.Stream }

// Reader is the backbone's stream name as a SubjectReader (Stream).
func (b *Backbone) Reader(ctx context.Context, name string) (SubjectReader, error) {
	s, err := b.Stream(ctx, name)
	return SubjectReader{Stream: s}, err
}

// Subject is where a build's events are in the one-stream layout, BES's
// (archive.Source): for a backbone of partitioned build events, read
// through BuildEvents.
func (SubjectReader) Subject(project, invocation string) string {
	return subjects.BES(project, invocation)
}

// Read is ReadSubject with the message's fields as arguments.
func (r SubjectReader) Read(ctx context.Context, subject string, fn func(seq uint64, at time.Time, subject string, header map[string][]string, data []byte) error) error {
	s := r.Stream
	last, err := s.GetLastMsgForSubject(ctx, subject)
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read %s: %w", subject, err)
	}
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject}})
	if err != nil {
		return fmt.Errorf("read %s: %w", subject, err)
	}
	// Pulls of at most 8 MiB: a subject of large events is not taken in
	// at once.
	it, err := cons.Messages(jetstream.PullMaxBytes(8 << 20))
	if err != nil {
		return fmt.Errorf("read %s: %w", subject, err)
	}
	defer it.Stop()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	for {
		m, err := it.Next()
		if err != nil {
			if ctx.Err() != nil {
				return ctx.Err()
			}
			return fmt.Errorf("read %s: %w", subject, err)
		}
		md, err := m.Metadata()
		if err != nil {
			return fmt.Errorf("read %s: %w", subject, err)
		}
		if err := fn(md.Sequence.Stream, md.Timestamp, m.Subject(), m.Headers(), m.Data()); err != nil {
			return err
		}
		if md.Sequence.Stream >= last.Sequence {
			return nil
		}
	}
}

// followIdle is how long the server keeps a follow's consumer that no
// one pulls from.
const followIdle = 30 * time.Second

// Follow calls fn with each message of subject stored after sequence
// after, in stream order, as they arrive, until ctx ends (it returns nil)
// or fn fails. It holds one ordered consumer, which the server forgets
// when the follow ends (it is deleted; should the process die first, the
// server drops it after followIdle): what a live console page costs while
// it is open, and nothing once it is closed. The consumer filters on the
// one subject, which the server answers from its index of that subject
// rather than by reading the stream.
func (r SubjectReader) Follow(ctx context.Context, subject string, after uint64, fn func(seq uint64, data []byte) error) error {
	cons, err := r.Stream.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{subject},
		DeliverPolicy: jetstream.DeliverByStartSequencePolicy, OptStartSeq: after + 1, InactiveThreshold: followIdle})
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("follow %s: %w", subject, err)
	}
	it, err := cons.Messages(jetstream.PullMaxBytes(8 << 20))
	if err != nil {
		return fmt.Errorf("follow %s: %w", subject, err)
	}
	defer func() {
		it.Stop()
		// The consumer's name now: an ordered consumer makes a new one
		// whenever it resets.
		if info := cons.CachedInfo(); info != nil {
			dctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), 5*time.Second)
			defer cancel()
			r.Stream.DeleteConsumer(dctx, info.Name) // else it goes after followIdle
		}
	}()
	stop := context.AfterFunc(ctx, it.Stop)
	defer stop()
	for {
		m, err := it.Next()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("follow %s: %w", subject, err)
		}
		md, err := m.Metadata()
		if err != nil {
			return fmt.Errorf("follow %s: %w", subject, err)
		}
		if err := fn(md.Sequence.Stream, m.Data()); err != nil {
			return err
		}
	}
}

// Subjects returns the subjects of s on filter with their message counts
// (for the BES stream: its builds).
func Subjects(ctx context.Context, s jetstream.Stream, filter string) (map[string]uint64, error) {
	info, err := s.Info(ctx, jetstream.WithSubjectFilter(filter))
	if err != nil {
		return nil, err
	}
	return info.State.Subjects, nil
}

// SampleSubjects returns at most n subjects of s on filter that hold more
// than minMessages messages, taken at random.
func SampleSubjects(ctx context.Context, s jetstream.Stream, filter string, n int, minMessages uint64) ([]string, error) {
	counts, err := Subjects(ctx, s, filter)
	if err != nil {
		return nil, err
	}
	var subs []string
	for subj, c := range counts {
		if c > minMessages {
			subs = append(subs, subj)
		}
	}
	rand.Shuffle(len(subs), func(i, j int) { subs[i], subs[j] = subs[j], subs[i] })
	return subs[:min(n, len(subs))], nil
}
