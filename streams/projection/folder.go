package projection

import (
	"context"
	"time"
)

// The commit log's contract. A Folder keeps a world's documents in storage
// of its own (the compactor: objects in a bucket) with its position in
// that storage, not in PostgreSQL; commitlog.FoldWorld reads the world's
// versions after the position, hands them to Fold, and then removes from
// the stream the versions Fold says it holds and no longer needs there.
//
// The invariant the stream and a Folder keep together: at or below the
// Folder's position, the stream holds only each document's version in the
// Folder's latest checkpoint (its last folded one). A pass can break it
// for a while: it dies after Fold stored a checkpoint and before every
// deletion ended, and nothing later would delete those versions (they are
// at or below the position, and not the previous checkpoint's either).
// A Folder that also implements Dropper lets FoldWorld repair that: the
// pass records when its deletions are done, and a pass that finds the
// latest checkpoint unrecorded first sweeps the world's versions at or
// below it.

// Version is one document version of a world's commit log.
type Version struct {
	Doc     string
	Seq     uint64 // the stream sequence: the version
	Deleted bool   // a tombstone
	Time    time.Time
	Body    []byte
}

// Folder folds versions of a world into its storage.
type Folder interface {
	// Covered is the sequence the world is folded up to (0: nothing yet).
	Covered(ctx context.Context, world string) (uint64, error)
	// Fold takes the world's versions after Covered, up to the world's
	// last one when the pass began, in sequence order, and stores them
	// durably before it returns. It returns the sequences the stream may
	// now drop: only versions that are not their document's last (the
	// stream's per-subject last sequence is what compare-and-set checks).
	// Just before the write that makes its checkpoint durable it calls
	// Fence(ctx), and stores nothing when that fails: only the fold's
	// leader moves the position.
	Fold(ctx context.Context, world string, versions []Version) (drop []uint64, err error)
}

// Dropper is a Folder that records, beside each checkpoint, that the
// stream has dropped what the checkpoint made droppable. commitlog.FoldWorld
// uses it when the Folder implements it:
//
//  1. Undropped: when the latest checkpoint is not recorded, FoldWorld
//     reads the world's messages at or below its seq (headers only) and
//     deletes every one older than its document's version in the
//     checkpoint (never that version itself, so every document keeps its
//     last version in the stream), then calls Dropped(seq).
//  2. Covered and Fold as above; after every deletion Fold asked for has
//     succeeded, FoldWorld calls Dropped with the last version of the pass.
type Dropper interface {
	Folder
	// Undropped returns the seq of the world's latest checkpoint when its
	// drops are not recorded as done (0 when they are, or when the world
	// has no checkpoint), and the version each document has in it (ok
	// false: the checkpoint does not hold the document, and FoldWorld then
	// deletes none of its versions).
	Undropped(ctx context.Context, world string) (seq uint64, version func(doc string) (v uint64, ok bool), err error)
	// Dropped records that, at or below seq, the stream holds only each
	// document's version in the checkpoint at seq. FoldWorld calls it
	// after a sweep of the checkpoint Undropped returned, and after the
	// deletions of a pass with the pass's last version; a Folder whose
	// Fold did not itself store the checkpoint at seq on top of a recorded
	// one (another folder got there first, or its base was unrecorded)
	// must record nothing, so that the next pass sweeps.
	Dropped(ctx context.Context, world string, seq uint64) error
}
