package commitlog

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// FoldStats tells what FoldWorld did.
type FoldStats struct {
	From     uint64 // the folder's position when the pass began
	Versions int    // read from the stream and folded
	Dropped  int    // removed from the stream afterwards
	To       uint64 // the last sequence folded (0: nothing was new)
	Swept    int    // versions a dead pass had left, removed first
	// Withheld counts versions the pass would have removed but a holder
	// (HoldFor) had not yet acknowledged; a later pass sweeps them.
	Withheld int
	// Missing names the holders that did not exist on COMMITS: each held
	// every version back.
	Missing []string
	held    bool // the holders were looked up
}

// Position is where the world is folded up to after the pass.
func (s FoldStats) Position() uint64 { return max(s.From, s.To) }

// foldFetch is how many messages FoldWorld reads at a time.
const foldFetch = 1000

// FoldWorld runs one pass of f over world on the COMMITS stream: it reads
// the world's versions after f's position, up to the world's last message
// at the start, gives them to f, and deletes the sequences f returns, but
// none above the ack floor of a holder (HoldFor). A version already gone
// (another pass removed it) is fine.
//
// When f is a projection.Dropper, the pass first sweeps what a pass that
// died during its deletions left (see projection.Dropper), and records
// its own deletions as done once they all succeeded. A pass that fails
// after Fold returns an error and records nothing: the next one sweeps.
//
// Only the leader of the fold deletes: before each batch of deletions
// the pass checks projection.Fence(ctx) (the fold runner's lease), and a
// fence that fails ends the pass there. f does the same before it stores
// a checkpoint.
func FoldWorld(ctx context.Context, js jetstream.JetStream, f projection.Folder, world string, opts ...FoldOption) (FoldStats, error) {
	var o foldOptions
	for _, opt := range opts {
		opt(&o)
	}
	var st FoldStats
	stream, err := js.Stream(ctx, subjects.StreamCommits)
	if err != nil {
		return st, fmt.Errorf("fold %q: the %s stream: %w", world, subjects.StreamCommits, err)
	}
	d, drops := f.(projection.Dropper)
	if drops {
		if st.Swept, err = sweepWorld(ctx, js, stream, d, world, o.holders, &st); err != nil {
			return st, err
		}
	}
	after, err := f.Covered(ctx, world)
	if err != nil {
		return st, err
	}
	st.From = after
	versions, err := readWorld(ctx, js, stream, world, after, o.waiting)
	if err != nil || len(versions) == 0 {
		return st, err
	}
	st.Versions, st.To = len(versions), versions[len(versions)-1].Seq
	drop, err := f.Fold(ctx, world, versions)
	if err != nil {
		return st, err
	}
	floor, err := holdFloor(ctx, stream, world, o.holders, &st)
	if err != nil {
		return st, fmt.Errorf("fold %q: %w", world, err)
	}
	drop, st.Withheld = below(drop, floor)
	st.Dropped, err = deleteFenced(ctx, js, drop)
	if err != nil {
		return st, fmt.Errorf("fold %q: %w", world, err)
	}
	// With versions withheld the checkpoint's drops are not all done:
	// recorded as undone, the next pass sweeps what is left.
	if drops && st.Withheld == 0 {
		if err := d.Dropped(ctx, world, st.To); err != nil {
			return st, err
		}
	}
	return st, nil
}

// A FoldOption tells FoldWorld what the caller knows.
type FoldOption func(*foldOptions)

type foldOptions struct {
	waiting int
	holders []string
}

// FoldWaiting says that n versions of the world are known to wait (the
// compactor runner counts them). When they make at least half of the
// stream's sequences between the checkpoint and the world's last message,
// the pass reads that range unfiltered and skips other worlds' messages:
// a consumer filtered on the world makes the server count the world's
// pending messages subject by subject when it is created, a cost that
// grows with the documents of the world (about 0.3 s of server CPU at
// 100,000 documents, 3 s at 1,000,000), not with the pass.
func FoldWaiting(n int) FoldOption { return func(o *foldOptions) { o.waiting = n } }

// HoldFor names the durable consumers on COMMITS that hold the pass's
// deletions back (FoldRunnerConfig.HoldFor says why): none is deleted
// above the ack floor of one whose subjects take the world, and none at
// all while one of them does not exist.
func HoldFor(durables ...string) FoldOption {
	return func(o *foldOptions) { o.holders = durables }
}

// sweepWorld removes the versions a pass that died during its deletions
// left at or below d's latest checkpoint: every message older than its
// document's version in the checkpoint (that version itself stays: it is
// the document's last in the stream, or a later pass drops it). It reads
// headers only, so a sweep of a world of 1,000,000 documents moves their
// subjects, not their bodies. It returns how many it deleted.
func sweepWorld(ctx context.Context, js jetstream.JetStream, stream jetstream.Stream, d projection.Dropper, world string, holders []string, st *FoldStats) (int, error) {
	seq, version, err := d.Undropped(ctx, world)
	if err != nil || seq == 0 {
		return 0, err
	}
	var drop []uint64
	last, err := stream.GetLastMsgForSubject(ctx, subjects.CommitsWorldFilter(world))
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
	floor, err := holdFloor(ctx, stream, world, holders, st)
	if err != nil {
		return 0, fmt.Errorf("sweep %q: %w", world, err)
	}
	drop, withheld := below(drop, floor)
	if _, err := deleteFenced(ctx, js, drop); err != nil {
		return 0, fmt.Errorf("sweep %q: %w", world, err)
	}
	if withheld == 0 {
		if err := d.Dropped(ctx, world, seq); err != nil {
			return 0, err
		}
	}
	return len(drop), nil
}

// deleteBatch is how many versions a pass deletes between two checks of
// its lease: a process that lost the lease stops deleting within one
// batch, and a check (one request) is small beside a batch's deletions.
const deleteBatch = 4096

// deleteFenced deletes seqs from COMMITS in batches, each only while the
// process leads the fold (projection.Fence), and returns how many it
// deleted.
func deleteFenced(ctx context.Context, js jetstream.JetStream, seqs []uint64) (int, error) {
	done := 0
	for len(seqs) > 0 {
		n := min(len(seqs), deleteBatch)
		if err := projection.Fence(ctx); err != nil {
			return done, fmt.Errorf("not deleting: %w", err)
		}
		if err := streams.DeleteMsgs(ctx, js, subjects.StreamCommits, seqs[:n], 0); err != nil {
			return done, err
		}
		done, seqs = done+n, seqs[n:]
	}
	return done, nil
}

// below splits seqs (sorted) at floor: those at or below it, and how many
// are above.
func below(seqs []uint64, floor uint64) ([]uint64, int) {
	n := len(seqs)
	if floor < math.MaxUint64 {
		n, _ = slices.BinarySearch(seqs, floor+1)
	}
	return seqs[:n], len(seqs) - n
}

// holdFloor is the lowest ack floor of the holders whose subjects take the
// world's (MaxUint64: none does): a version above it may not have reached
// the other system yet. A holder that does not exist holds everything
// (0): its consumer, once created, delivers from the stream's start, and
// what was deleted before would never reach the other system. It adds
// such holders to st.Missing.
func holdFloor(ctx context.Context, stream jetstream.Stream, world string, holders []string, st *FoldStats) (uint64, error) {
	st.held = true
	floor, missing, err := streams.HoldFloor(ctx, stream, subjects.CommitsWorldFilter(world), holders, false)
	if err != nil {
		return 0, err
	}
	for _, name := range missing {
		if !slices.Contains(st.Missing, name) {
			st.Missing = append(st.Missing, name)
		}
	}
	return floor, nil
}

// strandedVersions reads the world's message headers up to limit and
// returns the sequences older than their document's version in the
// checkpoint. A document the checkpoint does not hold keeps every version.
func strandedVersions(ctx context.Context, js jetstream.JetStream, world string, limit uint64, version func(string) (uint64, bool)) ([]uint64, error) {
	cons, err := js.OrderedConsumer(ctx, subjects.StreamCommits, jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{subjects.CommitsWorldFilter(world)},
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
			if _, doc, ok := subjects.ParseCommits(msg.Subject()); ok {
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

// readWorld returns the world's versions after seq, up to the stream's
// last message at the start of the pass (later ones are the next pass's).
//
// It never asks for the world's last message: GetLastMsgForSubject on a
// wildcard makes the server search its index of the stream's blocks, a
// cost that grows with the stream. The consumer's own count of what is
// pending after each message says where the world ends.
func readWorld(ctx context.Context, js jetstream.JetStream, stream jetstream.Stream, world string, after uint64, waiting int) ([]projection.Version, error) {
	info, err := stream.Info(ctx)
	if err != nil {
		return nil, fmt.Errorf("fold %q: the stream's state: %w", world, err)
	}
	last := info.State.LastSeq
	if last <= after {
		return nil, nil
	}
	cfg := jetstream.OrderedConsumerConfig{
		FilterSubjects: []string{subjects.CommitsWorldFilter(world)},
		DeliverPolicy:  jetstream.DeliverByStartSequencePolicy,
		OptStartSeq:    after + 1,
	}
	if waiting > 0 && last-after <= 2*uint64(waiting) {
		cfg.FilterSubjects = nil // see FoldWaiting
	}
	cons, err := js.OrderedConsumer(ctx, subjects.StreamCommits, cfg)
	if err != nil {
		return nil, fmt.Errorf("fold %q: %w", world, err)
	}
	var out []projection.Version
	for {
		batch, err := cons.FetchNoWait(foldFetch)
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
			if seq > last {
				return out, nil
			}
			w, doc, ok := subjects.ParseCommits(msg.Subject())
			switch {
			case !ok:
				return nil, fmt.Errorf("fold %q: message %d has subject %q, not a document's", world, seq, msg.Subject())
			case w == world:
				out = append(out, projection.Version{Doc: doc, Seq: seq, Time: meta.Timestamp.UTC(),
					Deleted: msg.Headers().Get(envelope.Kind) == envelope.KindDelete, Body: msg.Data()})
			}
			// Nothing after this one (of the world, or of the stream when
			// read unfiltered) was stored when it was delivered.
			if seq == last || meta.NumPending == 0 {
				return out, nil
			}
		}
		if err := batch.Error(); err != nil && !errors.Is(err, nats.ErrTimeout) && !errors.Is(err, jetstream.ErrNoMessages) {
			return nil, fmt.Errorf("fold %q: %w", world, err)
		}
		if n == 0 {
			return out, nil
		}
	}
}
