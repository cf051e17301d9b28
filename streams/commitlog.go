package streams

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
)

// FoldStats tells what FoldWorld did.
type FoldStats struct {
	From     uint64 // the folder's position when the pass began
	Versions int    // read from the stream and folded
	Dropped  int    // removed from the stream afterwards
	To       uint64 // the last sequence folded (0: nothing was new)
	Swept    int    // versions a dead pass had left, removed first
}

// Position is where the world is folded up to after the pass.
func (s FoldStats) Position() uint64 { return max(s.From, s.To) }

// foldFetch is how many messages FoldWorld reads at a time.
const foldFetch = 1000

// dropConcurrency is how many message deletions are in flight at once: each
// is one JetStream API round trip (a lookup by sequence on the server).
const dropConcurrency = 64

// FoldWorld runs one pass of f over world on the COMMITS stream: it reads
// the world's versions after f's position, up to the world's last message
// at the start, gives them to f, and deletes the sequences f returns. A
// version already gone (another pass removed it) is fine.
//
// When f is a projection.Dropper, the pass first sweeps what a pass that
// died during its deletions left (see projection.Dropper), and records
// its own deletions as done once they all succeeded. A pass that fails
// after Fold returns an error and records nothing: the next one sweeps.
func FoldWorld(ctx context.Context, js jetstream.JetStream, f projection.Folder, world string) (FoldStats, error) {
	var st FoldStats
	stream, err := js.Stream(ctx, StreamCommits)
	if err != nil {
		return st, fmt.Errorf("fold %q: the %s stream: %w", world, StreamCommits, err)
	}
	d, drops := f.(projection.Dropper)
	if drops {
		if st.Swept, err = sweepWorld(ctx, js, stream, d, world); err != nil {
			return st, err
		}
	}
	after, err := f.Covered(ctx, world)
	if err != nil {
		return st, err
	}
	st.From = after
	versions, err := readWorld(ctx, js, stream, world, after)
	if err != nil || len(versions) == 0 {
		return st, err
	}
	st.Versions, st.To = len(versions), versions[len(versions)-1].Seq
	drop, err := f.Fold(ctx, world, versions)
	if err != nil {
		return st, err
	}
	if err := deleteSeqs(ctx, stream, drop); err != nil {
		return st, fmt.Errorf("fold %q: %w", world, err)
	}
	st.Dropped = len(drop)
	if drops {
		if err := d.Dropped(ctx, world, st.To); err != nil {
			return st, err
		}
	}
	return st, nil
}

// sweepWorld removes the versions a pass that died during its deletions
// left at or below d's latest checkpoint: every message older than its
// document's version in the checkpoint (that version itself stays: it is
// the document's last in the stream, or a later pass drops it). It reads
// headers only, so a sweep of a world of 1,000,000 documents moves their
// subjects, not their bodies. It returns how many it deleted.
func sweepWorld(ctx context.Context, js jetstream.JetStream, stream jetstream.Stream, d projection.Dropper, world string) (int, error) {
	seq, version, err := d.Undropped(ctx, world)
	if err != nil || seq == 0 {
		return 0, err
	}
	var drop []uint64
	last, err := stream.GetLastMsgForSubject(ctx, CommitsWorldFilter(world))
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		// Nothing of the world is left in the stream.
	case err != nil:
		return 0, fmt.Errorf("sweep %q: its last message: %w", world, err)
	default:
		if drop, err = strandedVersions(ctx, js, world, min(seq, last.Sequence), version); err != nil {
			return 0, err
		}
	}
	if err := deleteSeqs(ctx, stream, drop); err != nil {
		return 0, fmt.Errorf("sweep %q: %w", world, err)
	}
	if err := d.Dropped(ctx, world, seq); err != nil {
		return 0, err
	}
	return len(drop), nil
}

// strandedVersions reads the world's message headers up to limit and
// returns the sequences older than their document's version in the
// checkpoint. A document the checkpoint does not hold keeps every version.
func strandedVersions(ctx context.Context, js jetstream.JetStream, world string, limit uint64, version func(string) (uint64, bool)) ([]uint64, error) {
	cons, err := js.OrderedConsumer(ctx, StreamCommits, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{CommitsWorldFilter(world)},
		DeliverPolicy:  jetstream.DeliverAllPolicy,
		HeadersOnly:    true,
	})
	if err != nil {
		return nil, fmt.Errorf("sweep %q: %w", world, err)
	}
	var drop []uint64
	for {
		batch, err := cons.Fetch(foldFetch, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return nil, fmt.Errorf("sweep %q: %w", world, err)
		}
		n := 0
		for msg := range batch.Messages() {
			n++
			meta, err := msg.Metadata()
			if err != nil {
				return nil, err
			}
			seq := meta.Sequence.Stream
			if seq > limit {
				return drop, nil
			}
			if _, doc, ok := CommitsSubjectDoc(msg.Subject()); ok {
				if v, ok := version(doc); ok && seq < v {
					drop = append(drop, seq)
				}
			}
			// The limit itself may be gone (deleted since we looked), so
			// the end of what the stream had is also the end.
			if seq == limit || meta.NumPending == 0 {
				return drop, nil
			}
		}
		if err := batch.Error(); err != nil {
			return nil, fmt.Errorf("sweep %q: %w", world, err)
		}
		if n == 0 {
			return drop, nil
		}
	}
}

// readWorld returns the world's versions after seq, up to the world's last
// message at the time of the call.
func readWorld(ctx context.Context, js jetstream.JetStream, stream jetstream.Stream, world string, after uint64) ([]projection.Version, error) {
	last, err := stream.GetLastMsgForSubject(ctx, CommitsWorldFilter(world))
	if errors.Is(err, jetstream.ErrMsgNotFound) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("fold %q: its last message: %w", world, err)
	}
	if last.Sequence <= after {
		return nil, nil
	}
	cons, err := js.OrderedConsumer(ctx, StreamCommits, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{CommitsWorldFilter(world)},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:    after + 1,
	})
	if err != nil {
		return nil, fmt.Errorf("fold %q: %w", world, err)
	}
	var out []projection.Version
	for {
		batch, err := cons.Fetch(foldFetch, jetstream.FetchMaxWait(5*time.Second))
		if err != nil {
			return nil, fmt.Errorf("fold %q: %w", world, err)
		}
		n := 0
		for msg := range batch.Messages() {
			n++
			meta, err := msg.Metadata()
			if err != nil {
				return nil, err
			}
			seq := meta.Sequence.Stream
			if seq > last.Sequence {
				continue // the next pass's
			}
			_, doc, ok := CommitsSubjectDoc(msg.Subject())
			if !ok {
				return nil, fmt.Errorf("fold %q: message %d has subject %q, not a document's", world, seq, msg.Subject())
			}
			out = append(out, projection.Version{Doc: doc, Seq: seq, Time: meta.Timestamp.UTC(),
				Deleted: msg.Headers().Get(envelope.Kind) == envelope.KindDelete, Body: msg.Data()})
			if seq == last.Sequence {
				return out, nil
			}
		}
		if err := batch.Error(); err != nil {
			return nil, fmt.Errorf("fold %q: %w", world, err)
		}
		if n == 0 {
			return nil, fmt.Errorf("fold %q: the stream ended before its last message %d", world, last.Sequence)
		}
	}
}

// deleteSeqs deletes the messages at seqs, dropConcurrency at a time.
func deleteSeqs(ctx context.Context, stream jetstream.Stream, seqs []uint64) error {
	ctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	sem := make(chan struct{}, dropConcurrency)
	var wg sync.WaitGroup
	for _, seq := range seqs {
		select {
		case sem <- struct{}{}:
		case <-ctx.Done():
		}
		if ctx.Err() != nil {
			break
		}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			err := stream.DeleteMsg(ctx, seq)
			if err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) && !errors.Is(err, jetstream.ErrMsgDeleteUnsuccessful) {
				cancel(fmt.Errorf("delete version %d: %w", seq, err))
			}
		}()
	}
	wg.Wait()
	return context.Cause(ctx)
}
