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
	Versions int    // read from the stream and folded
	Dropped  int    // removed from the stream afterwards
	To       uint64 // the last sequence folded (0: nothing was new)
}

// foldFetch is how many messages FoldWorld reads at a time.
const foldFetch = 1000

// dropConcurrency is how many message deletions are in flight at once: each
// is one JetStream API round trip (a lookup by sequence on the server).
const dropConcurrency = 64

// FoldWorld runs one pass of f over world on the COMMITS stream: it reads
// the world's versions after f's position, up to the world's last message
// at the start, gives them to f, and deletes the sequences f returns. A
// version already gone (another pass removed it) is fine.
func FoldWorld(ctx context.Context, js jetstream.JetStream, f projection.Folder, world string) (FoldStats, error) {
	var st FoldStats
	stream, err := js.Stream(ctx, StreamCommits)
	if err != nil {
		return st, fmt.Errorf("fold %q: the %s stream: %w", world, StreamCommits, err)
	}
	after, err := f.Covered(ctx, world)
	if err != nil {
		return st, err
	}
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
		return st, err
	}
	st.Dropped = len(drop)
	return st, nil
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
