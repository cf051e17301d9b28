package projection

import (
	"context"
	"time"
)

// The commit log's contract. A Folder keeps a world's documents in storage
// of its own (the compactor: objects in a bucket) with its position in
// that storage, not in PostgreSQL; streams.FoldWorld reads the world's
// versions after the position, hands them to Fold, and then removes from
// the stream the versions Fold says it holds and no longer needs there.

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
	Fold(ctx context.Context, world string, versions []Version) (drop []uint64, err error)
}
