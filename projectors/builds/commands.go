package builds

import (
	"encoding/json"
	"fmt"
	"io"
	"time"
)

// What the commands of the builds projection print (cmd/millrace: project
// builds, replay builds, builds show, builds scrub, projects retention):
// their help, beside the options it describes, and the scrub's output,
// beside ScrubStats (the retention's is WriteRetention).

// ProjectDescription is the help of `millrace project builds`.
const ProjectDescription = `Consumes the BES stream into PostgreSQL: invocations, targets, tests, metrics,
build output and hourly rollups. Several instances may run: one applies, the
others stand by (a PostgreSQL advisory lock decides). With --bes-partitions
above 1 they share the work: each partition of build events has its own
consumer, position and lock, and the instances spread the partitions among
them, taking over those of one that leaves or dies (--builds-group-heartbeat).
Beside it, the archiver
moves the raw events of finished builds to the bucket (--bucket-url), one
object per build, --archive-after their last event (archive/README.md).`

// ReplayDescription is the help of `millrace replay builds`.
const ReplayDescription = `Empties the builds projection and applies every archived build (from the bucket,
--bucket-url), then the BES stream less what the archive held; the result equals
what the live projector built. A build whose raw events are gone, past
--retention-raw-days, keeps its rows as they are. When the stream has lost events
of a build the archive lacks, it refuses before emptying anything and names the
builds. Stop the builds projector first (replay refuses to run while it holds its
lock); start it again afterwards.

With --bes-partitions above 1, it replays each partition in turn, or with
--partition P that one alone, and the projectors need not stop: the partitions
it replays are paused (consumer_paused), the instances running them let them
go, the others go on, and each resumes once replayed.`

// ShowDescription is the help of `millrace builds show`.
const ShowDescription = `Reads the database directly; no server needs to run.

A build is a project and an invocation id: clients of two projects may choose
the same id (Bazel's --invocation_id). With --project, prints that project's
build. Without it, prints every build with that id (one after the other);
with --json, it prints the build if exactly one project has the id, and
otherwise fails naming the projects that have it, so that a tool never reads
one tenant's build for another's. With --output, it prints the build's console
output as Bazel printed it (its stdout on standard output, its stderr on
standard error; one project's, as --json), read from the build's archive
object in the bucket (--bucket-url) once the archiver has moved it there.`

// ScrubDescription is the help of `millrace builds scrub`.
const ScrubDescription = `Applies the BES edge's redaction rules (the same --bes-redact-* flags) to every
projected column that holds text from Bazel's events: commands, patterns, users,
hosts, workspaces, target kinds, failure reasons, tags and console output. For
builds stored before the edge redacted events. Idempotent; safe while the
projector runs. --dry-run counts what would change.`

// RetentionDescription is the help of `millrace projects retention`.
const RetentionDescription = `Without a --*-days flag, prints the effective retention in days (0: for ever) of
raw events, finished builds' rows and rollups of every project with builds or
an override, or of --project (* marks its own values). With one, sets --project's
(0: the default); raw may not outlive rows, nor rows rollups (projectors/builds).`

// ScrubProgress writes a scrub's progress (ScrubOptions.Progress) to w as
// builds scrub does on standard error: one line, rewritten in place at
// most once a second.
func ScrubProgress(w io.Writer, dryRun bool) func(ScrubStats) {
	var last time.Time
	return func(st ScrubStats) {
		if time.Since(last) >= time.Second {
			last = time.Now()
			fmt.Fprintf(w, "\rbuilds scrub: %d invocations scanned, %s %d   ", st.Invocations, scrubVerb(dryRun), st.InvocationsChanged)
		}
	}
}

// WriteScrub writes a scrub's totals as builds scrub does: a line that
// says how long it took, or with asJSON an object that says whether it
// was a dry run.
func WriteScrub(w io.Writer, st ScrubStats, dryRun bool, took time.Duration, asJSON bool) error {
	if asJSON {
		return json.NewEncoder(w).Encode(struct {
			ScrubStats
			DryRun bool `json:"dry_run"`
		}{st, dryRun})
	}
	fmt.Fprintf(w, "builds scrub: %d invocations scanned in %s; %s %d invocations, %d targets, %d metadata rows, %d console outputs\n",
		st.Invocations, took.Round(time.Millisecond), scrubVerb(dryRun), st.InvocationsChanged, st.TargetsChanged, st.MetadataChanged, st.OutputsChanged)
	return nil
}

// scrubVerb says what a scrub did to what it counts.
func scrubVerb(dryRun bool) string {
	if dryRun {
		return "would change"
	}
	return "changed"
}
