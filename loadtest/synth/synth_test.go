package synth

import (
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/schemas/bep"
)

// The events are a function of their sequence: the mix the package says,
// unique labels, each target configured and completed once, and the same
// bytes every time.
func TestEvents(t *testing.T) {
	b := Build{Events: 10_006}
	if err := b.Validate(); err != nil {
		t.Fatal(err)
	}
	configured, completed := map[string]int{}, map[string]int{}
	var progress, tests, summaries, failedTargets int
	for seq := 1; seq < b.Events; seq++ {
		ev := b.Event(seq)
		if !proto.Equal(ev, b.Event(seq)) {
			t.Fatalf("event %d differs between two calls", seq)
		}
		switch p := ev.GetPayload().(type) {
		case *bep.BuildEvent_Progress:
			progress++
			if n := len(p.Progress.GetStdout()) + len(p.Progress.GetStderr()); n != DefaultOutputBytes {
				t.Fatalf("event %d: %d bytes of output, want %d", seq, n, DefaultOutputBytes)
			}
		case *bep.BuildEvent_Configured:
			configured[ev.GetId().GetTargetConfigured().GetLabel()]++
		case *bep.BuildEvent_Completed:
			completed[ev.GetId().GetTargetCompleted().GetLabel()]++
			if !p.Completed.GetSuccess() {
				failedTargets++
			}
		case *bep.BuildEvent_TestResult:
			tests++
		case *bep.BuildEvent_TestSummary:
			summaries++
		}
	}
	if len(configured) != b.Targets() || len(completed) != b.Targets() || tests != b.Tests() || summaries != b.Tests() {
		t.Fatalf("%d configured, %d completed, %d results, %d summaries; want %d targets and %d tests",
			len(configured), len(completed), tests, summaries, b.Targets(), b.Tests())
	}
	for l, n := range configured {
		if n != 1 || completed[l] != 1 {
			t.Fatalf("label %s configured %d and completed %d times", l, n, completed[l])
		}
	}
	if progress != 2*b.Targets()/2 || failedTargets != b.Targets()/97 {
		t.Fatalf("%d progress events, %d failed targets", progress, failedTargets)
	}
	if err := (Build{Events: MinEvents - 1}).Validate(); err == nil {
		t.Fatal("a build too short to make is valid")
	}
}
