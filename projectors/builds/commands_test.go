package builds

import (
	"bytes"
	"testing"
	"time"
)

// builds scrub reports its progress at most once a second on one line,
// and its totals in words that say whether it was a dry run, or as JSON.
func TestScrubOutput(t *testing.T) {
	var b bytes.Buffer
	progress := ScrubProgress(&b, true)
	progress(ScrubStats{Invocations: 500, InvocationsChanged: 3})
	progress(ScrubStats{Invocations: 1000, InvocationsChanged: 4}) // within the second
	if b.String() != "\rbuilds scrub: 500 invocations scanned, would change 3   " {
		t.Fatalf("progress %q", b.String())
	}
	st := ScrubStats{Invocations: 1000, InvocationsChanged: 4, TargetsChanged: 5, MetadataChanged: 7, OutputsChanged: 6}
	for _, c := range []struct {
		dryRun, asJSON bool
		want           string
	}{
		{false, false, "builds scrub: 1000 invocations scanned in 1.5s; changed 4 invocations, 5 targets, 7 metadata rows, 6 console outputs\n"},
		{true, false, "builds scrub: 1000 invocations scanned in 1.5s; would change 4 invocations, 5 targets, 7 metadata rows, 6 console outputs\n"},
		{true, true, `{"invocations":1000,"invocations_changed":4,"targets_changed":5,"outputs_changed":6,"metadata_changed":7,"dry_run":true}` + "\n"},
	} {
		b.Reset()
		if err := WriteScrub(&b, st, c.dryRun, 1500*time.Millisecond+400*time.Microsecond, c.asJSON); err != nil || b.String() != c.want {
			t.Errorf("dry run %v, JSON %v: %q, %v; want %q", c.dryRun, c.asJSON, b.String(), err, c.want)
		}
	}
}
