package console

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/millrace/millrace/projectors/builds"
)

// WriteBuild writes one build for a person at a terminal: its status,
// command, exit, duration, failed targets and tests.
func WriteBuild(out io.Writer, b *builds.Build) error {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintf(w, "invocation\t%s\nproject\t%s\nstatus\t%s\n", b.ID, b.Project, b.Status)
	if b.Command != nil {
		fmt.Fprintf(w, "command\t%s\n", *b.Command)
	}
	if b.ExitCode != nil && b.ExitCodeName != nil {
		fmt.Fprintf(w, "exit\t%d %s\n", *b.ExitCode, *b.ExitCodeName)
	}
	if b.DurationMs != nil {
		fmt.Fprintf(w, "duration\t%s\n", time.Duration(*b.DurationMs)*time.Millisecond)
	}
	failed := 0
	for _, t := range b.Targets {
		if !t.Success {
			failed++
		}
	}
	fmt.Fprintf(w, "targets\t%d (%d failed)\n", len(b.Targets), failed)
	for _, t := range b.Targets {
		if !t.Success {
			reason := ""
			if t.FailureReason != nil {
				reason = *t.FailureReason
			}
			fmt.Fprintf(w, "  FAILED\t%s\t%s\n", t.Label, reason)
		}
	}
	fmt.Fprintf(w, "tests\t%d\n", len(b.Tests))
	for _, t := range b.Tests {
		fmt.Fprintf(w, "  %s\t%s\n", t.Status, t.Label)
	}
	return w.Flush()
}
