// Package commitlog owns the commit log's fold on the backbone: which
// worlds of COMMITS have versions to fold (FoldRunner's discovery, a
// headers-only durable consumer), one pass over a world (FoldWorld: read
// the world's versions after the folder's position, hand them to a
// projection.Folder, delete from COMMITS what the folder no longer needs
// there, sweep what a dead pass left), the consumers whose position holds
// those deletions back (HoldFor), and the fold's metrics. The objects a
// fold writes into the bucket, and how they are read back, are in
// commitlog/layout, which imports no NATS so that the compactor (a
// projector) and the commits edge share it. The COMMITS stream itself and
// the generic JetStream calls (streams.DeleteMsgs) are the backbone's,
// package streams.
//
// # What the fold never does
//
// FoldRunner (the commit log's compactor; position in the bucket) keeps the
// invariant every consumer of a stream keeps: it never acknowledges, and
// never records as its position, a message whose effect is not durable
// where its position lives. A version is acknowledged only once a pass has
// folded its world up to it into a checkpoint, and a version is deleted
// from COMMITS only when a checkpoint holds a later version of its document
// and every holder (HoldFor) reading its world has acknowledged it; while a
// holder does not exist, nothing is deleted. A failed pass leaves its
// world's versions unacknowledged. Pinned by
// TestFoldRunnerPassErrorDoesNotBlockOthers, TestFoldRunnerRestart,
// TestFoldWithholdsWhatAnExportHasNotAcked,
// TestFoldMissingHolderWithholdsEverything and, in projectors/compactor,
// TestStrandedVersionsSwept; with a real export, in projectors/kafka,
// TestCommitsExportWhileCompacting.
//
// The facts about JetStream's compare-and-set on COMMITS that the commits
// edge and the compactor rest on are tested against the server version we
// ship in cas_test.go.
package commitlog
