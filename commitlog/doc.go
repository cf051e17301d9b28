// Package commitlog owns the commit log's fold on the backbone, a user of
// the consumer core (streams.Loop, kind fold): which worlds of COMMITS
// have versions to fold (FoldRunner's discovery, a headers-only durable
// consumer), one pass over a world (FoldWorld: read
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
// world's versions unacknowledged.
//
// Only the leader has those effects. One process leads each durable name,
// by the key-value lease FoldLeaseKey(durable) in streams.LeaseBucket;
// others stand by. A pass stores its checkpoint (the folder, before its
// manifest) and each batch of its deletions (FoldWorld) only after
// projection.Fence confirmed the lease is still this process's: a process
// whose lease lapsed, was deleted or taken stores and deletes nothing
// more, and stands by.
//
// Pinned by TestFoldRunnerPassErrorDoesNotBlockOthers,
// TestFoldRunnerRestart, TestFoldWithholdsWhatAnExportHasNotAcked,
// TestFoldMissingHolderWithholdsEverything, TestFoldFencedBeforeTheCheckpoint,
// TestFoldFencedBeforeTheDeletions, TestFoldRunnersOnOneDurable, the fold's
// cases of TestConsumerCoreFaults in streams, and, in projectors/compactor,
// TestStrandedVersionsSwept and TestFoldWithoutTheLeadStoresNoCheckpoint;
// with a real export, in projectors/kafka, TestCommitsExportWhileCompacting.
//
// The facts about JetStream's compare-and-set on COMMITS that the commits
// edge and the compactor rest on are tested against the server version we
// ship in cas_test.go.
package commitlog
