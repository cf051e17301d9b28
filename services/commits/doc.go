// Package commits is the commit log's edge: documents of a world, each a
// sequence of versions, stored one message per version on the COMMITS
// stream (commits.<world>.<doc>), with compare-and-set.
//
// A version is the stream sequence that stored it. Compare-and-set is
// JetStream's own check of a subject's last sequence
// (Nats-Expected-Last-Subject-Sequence), done by the server as it stores
// the message, so two writers can never both win over the same version:
// commitlog/cas_test.go shows it on one server and on a three-node cluster,
// with the server version we ship. On a replicated stream the server also
// refuses some writes whose expected version was right (another write to
// the subject was still in flight, nats-server #7281); the edge re-reads
// the document and, when the version it was given is still the current
// one, tries again a few times before it reports a conflict.
//
// A deleted document keeps its history; its tombstone is its latest
// version, and "must not exist" (expected version 0) accepts it.
//
// Reads come from the stream, and from the bucket for what the compactor
// (projectors/compactor) folded out of it: old versions from history
// segments, and List's world index from the latest checkpoint's shards
// plus the stream tail. The compactor keeps each document's latest version
// in the stream (it deletes only versions that are not a document's last),
// so compare-and-set never depends on the bucket.
package commits
