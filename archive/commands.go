package archive

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// What the commands that run this package's work print (cmd/millrace:
// archive verify, zstd train, builds delete): their help, beside the
// options it describes (VerifyOptions, TrainAndSave, Delete), and their
// output, beside the types it prints (Finding, Summary, Deleted).

// VerifyDescription is the help of `millrace archive verify`.
const VerifyDescription = `Reads each archived build's object from the bucket (--bucket-url) and checks it:
it decodes whole to what archived_builds records; event by event (sequence,
stored time, subject, every header, data) against the BES stream while the
stream still holds the build; and its tool events and last tool sequence
against the projection. Prints a line per bad build with the reason and a
summary (--json: one JSON object per build, then the summary), records each
verdict in archived_builds, and exits non-zero if any build is bad. Progress
on standard error.`

// TrainDescription is the help of `millrace zstd train`.
const TrainDescription = `Trains a dictionary on builds' records as the archive writes them (subjects,
headers and events), from BES recordings (loadtest/besrecord's format) or from
builds in the BES stream, stores it in the bucket (--bucket-url) under a new id
and makes it current: the archiver uses it for the builds it writes next, and
objects written with an older one stay readable. Every fifth build is held out
and archived with the new dictionary and with plain zstd: it prints the
dictionary's id, its size and both ratios.`

// DeleteDescription is the help of `millrace builds delete`.
const DeleteDescription = `Deletes the build (or every build of the project) from the BES stream (its bytes
overwritten), the archive and the database, where the rollups forget what it
counted; no other project's data is touched. --all needs --yes. A build still
sending events starts again with them. See archive/README.md, "Deletion".`

// ProgressLine writes a count of builds done to w as the commands show it
// on standard error: one line rewritten in place, under label, unit naming
// what is counted.
func ProgressLine(w io.Writer, label, unit string) func(done, total int) {
	return func(done, total int) { fmt.Fprintf(w, "\r%s: %d/%d %s   ", label, done, total, unit) }
}

// WriteFinding writes f as archive verify does: a line if the build is
// bad, or with asJSON an object for every build.
func WriteFinding(w io.Writer, f Finding, asJSON bool) {
	switch {
	case asJSON:
		writeJSON(w, f)
	case f.Error != "":
		fmt.Fprintf(w, "bad: %s of project %s (%s): %s\n", f.Invocation, f.Project, f.Key, strings.TrimSpace(f.Error))
	}
}

// WriteSummary writes sum as archive verify does, last (with asJSON an
// object), and returns an error when a build was bad: the command's
// failure.
func WriteSummary(w io.Writer, sum Summary, asJSON bool) error {
	if asJSON {
		writeJSON(w, sum)
	} else {
		fmt.Fprintf(w, "archive verify: %d builds, %d bad\n", sum.Builds, sum.Bad)
	}
	if sum.Bad > 0 {
		return fmt.Errorf("%d of %d archived builds are bad", sum.Bad, sum.Builds)
	}
	return nil
}

// WriteDeleted writes what Delete removed of project as builds delete
// does: a line, or with asJSON an object.
func WriteDeleted(w io.Writer, d Deleted, project string, asJSON bool) error {
	if asJSON {
		return writeJSON(w, d)
	}
	fmt.Fprintf(w, "builds delete: deleted %d builds' rows, %d stream messages, %d archive objects of project %q\n", d.Builds, d.Messages, d.Objects, project)
	return nil
}

// writeJSON writes v as the commands write JSON: indented, one value after
// the other.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}
