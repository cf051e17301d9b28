// Package archive is the long-term log of builds: the raw events of each
// finished build, as the BES stream stored them, in one zstd object per
// build in the bucket, compressed with a dictionary trained on recorded
// BEP. It owns the object format (Writer, Reader), the dictionaries in the
// bucket (Dicts, Train), the keys of build objects (BuildKey), and the
// archiver (Archiver) that finds finished builds in PostgreSQL, reads their
// events through a Source, writes, checks and records the object, and
// trims archived builds from the stream through a Trimmer once every
// durable consumer of it has read them, and moves their console output
// out of PostgreSQL into the objects through an OutputMover (output.go;
// Objects reads it back for the console).
//
// It imports no NATS: the stream is read through Source and trimmed
// through Trimmer, which package streams implements (streams.SubjectReader,
// streams.SubjectTrimmer). See README.md for the
// operator's view.
package archive
