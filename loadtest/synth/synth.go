// Package synth makes up one Bazel invocation of any number of build events
// and sends it to a BES backend as Bazel does, generating each event when
// it is sent: a build of a million events costs the sender the memory of
// one. The events are a function of their sequence number, so two runs of
// the same Build send the same bytes (under the ids given).
//
// The mix, per ten events: two targets (TargetConfigured, ActionExecuted,
// TargetComplete each), one of them a test (TestResult and TestSummary as
// well), and two progress events with console output. Every 97th target's
// action fails, every 50th test fails and every 70th is flaky. Labels are
// unique: //pkgN:tM, a thousand targets a package.
package synth

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/schemas/bep"
)

// Build is one synthetic invocation.
type Build struct {
	// Events is the number of tool events, ComponentStreamFinished
	// included; at least MinEvents.
	Events int
	// OutputBytes is the console output of one progress event; 0 means
	// DefaultOutputBytes.
	OutputBytes int
	// Start is the time of the first event; the others follow a
	// millisecond apart. Zero means 2024-03-09 14:58 UTC.
	Start time.Time
}

// MinEvents is the fewest tool events a Build has: its start, one cycle
// and its end.
const MinEvents = 3 + cycle + 3

// DefaultOutputBytes is Build.OutputBytes' default: about a line and a
// half of Bazel's progress, as a fresh `bazel test //...` prints.
const DefaultOutputBytes = 200

const (
	head  = 3  // BuildStarted, PatternExpanded, WorkspaceStatus
	cycle = 10 // two targets
	tail  = 3  // BuildFinished, BuildMetrics, ComponentStreamFinished
)

var defaultStart = time.Date(2024, 3, 9, 14, 58, 0, 0, time.UTC)

func (b Build) withDefaults() Build {
	if b.OutputBytes == 0 {
		b.OutputBytes = DefaultOutputBytes
	}
	if b.Start.IsZero() {
		b.Start = defaultStart
	}
	return b
}

// Validate reports a build that cannot be made.
func (b Build) Validate() error {
	if b.Events < MinEvents {
		return fmt.Errorf("synth: a build has at least %d events, not %d", MinEvents, b.Events)
	}
	if b.OutputBytes < 0 {
		return fmt.Errorf("synth: OutputBytes %d is negative", b.OutputBytes)
	}
	return nil
}

// cycles is how many whole cycles fit; the events left over before the
// tail are progress events.
func (b Build) cycles() int { return (b.Events - head - tail) / cycle }

// Targets is how many targets the build has, and Tests how many of them
// are tests.
func (b Build) Targets() int { return 2 * b.cycles() }

// Tests is how many of the targets are tests.
func (b Build) Tests() int { return b.cycles() }

// Label is target i's label.
func Label(i int) string { return fmt.Sprintf("//pkg%d:t%d", i/1000, i) }

// Failed reports whether target i fails (its action fails).
func Failed(i int) bool { return i%97 == 96 }

// TestStatus is the status of the test that target i is (odd i).
func TestStatus(i int) bep.TestStatus {
	switch t := i / 2; {
	case Failed(i):
		return bep.TestStatus_FAILED_TO_BUILD
	case t%50 == 49:
		return bep.TestStatus_FAILED
	case t%70 == 69:
		return bep.TestStatus_FLAKY
	}
	return bep.TestStatus_PASSED
}

// ExitCode is the build's exit code: 1 (BUILD_FAILURE) once any target
// failed, else 3 (TESTS_FAILED) once any test failed, else 0.
func (b Build) ExitCode() (int32, string) {
	n := b.Targets()
	switch {
	case n > 96:
		return 1, "BUILD_FAILURE"
	case n/2 > 49:
		return 3, "TESTS_FAILED"
	}
	return 0, "SUCCESS"
}

// Event returns tool event seq (1..Events-1; Events is
// ComponentStreamFinished, which is not a BuildEvent).
func (b Build) Event(seq int) *bep.BuildEvent {
	b = b.withDefaults()
	at := b.Start.Add(time.Duration(seq) * time.Millisecond)
	switch i := seq - 1; {
	case i == 0:
		return &bep.BuildEvent{
			Id: &bep.BuildEventId{Id: &bep.BuildEventId_Started{Started: &bep.BuildEventId_BuildStartedId{}}},
			Payload: &bep.BuildEvent_Started{Started: &bep.BuildStarted{
				StartTimeMillis: b.Start.UnixMilli(), BuildToolVersion: "4.2.3", Command: "test",
				WorkspaceDirectory: "/src/ws", WorkingDirectory: "/src/ws"}},
		}
	case i == 1:
		return &bep.BuildEvent{
			Id:      &bep.BuildEventId{Id: &bep.BuildEventId_Pattern{Pattern: &bep.BuildEventId_PatternExpandedId{Pattern: []string{"//..."}}}},
			Payload: &bep.BuildEvent_Expanded{Expanded: &bep.PatternExpanded{}},
		}
	case i == 2:
		return &bep.BuildEvent{
			Id: &bep.BuildEventId{Id: &bep.BuildEventId_WorkspaceStatus{WorkspaceStatus: &bep.BuildEventId_WorkspaceStatusId{}}},
			Payload: &bep.BuildEvent_WorkspaceStatus{WorkspaceStatus: &bep.WorkspaceStatus{Item: []*bep.WorkspaceStatus_Item{
				{Key: "BUILD_HOST", Value: "ci-7.example"}, {Key: "BUILD_USER", Value: "ci"}}}},
		}
	case seq == b.Events-2:
		code, name := b.ExitCode()
		return &bep.BuildEvent{
			Id: &bep.BuildEventId{Id: &bep.BuildEventId_BuildFinished{BuildFinished: &bep.BuildEventId_BuildFinishedId{}}},
			Payload: &bep.BuildEvent_Finished{Finished: &bep.BuildFinished{
				OverallSuccess: code == 0, ExitCode: &bep.BuildFinished_ExitCode{Name: name, Code: code},
				FinishTimeMillis: at.UnixMilli()}},
		}
	case seq == b.Events-1:
		return &bep.BuildEvent{
			Id: &bep.BuildEventId{Id: &bep.BuildEventId_BuildMetrics{BuildMetrics: &bep.BuildEventId_BuildMetricsId{}}},
			Payload: &bep.BuildEvent_BuildMetrics{BuildMetrics: &bep.BuildMetrics{
				ActionSummary: &bep.BuildMetrics_ActionSummary{ActionsExecuted: int64(b.Targets())},
				TargetMetrics: &bep.BuildMetrics_TargetMetrics{TargetsConfigured: int64(b.Targets())}}},
		}
	case i-head >= b.cycles()*cycle:
		return b.progress(seq)
	default:
		c, k := (i-head)/cycle, (i-head)%cycle
		switch k {
		case 0, 6:
			return b.progress(seq)
		case 1, 7:
			return configured(2*c + k/6)
		case 2, 8:
			return action(2*c + k/6)
		case 3, 9:
			return completed(2*c + k/6)
		case 4:
			return testResult(2*c + 1)
		default:
			return testSummary(2*c + 1)
		}
	}
}

// progress is a progress event of OutputBytes of output, mostly stderr as
// Bazel prints it.
func (b Build) progress(seq int) *bep.BuildEvent {
	line := fmt.Sprintf("[%d / %d] Executing genrule %s; 0s linux-sandbox\n", seq, b.Events, Label(seq/5))
	out := line
	if len(out) < b.OutputBytes {
		out += strings.Repeat(".", b.OutputBytes-len(out)-1) + "\n"
	}
	out = out[:min(len(out), b.OutputBytes)]
	var stdout string
	if seq%10 == 0 {
		stdout, out = out, ""
	}
	return &bep.BuildEvent{
		Id:      &bep.BuildEventId{Id: &bep.BuildEventId_Progress{Progress: &bep.BuildEventId_ProgressId{OpaqueCount: int32(seq)}}},
		Payload: &bep.BuildEvent_Progress{Progress: &bep.Progress{Stdout: stdout, Stderr: out}},
	}
}

var config = &bep.BuildEventId_ConfigurationId{Id: "63d1ec2b"}

func kind(i int) string {
	if i%2 == 1 {
		return "sh_test rule"
	}
	return "genrule rule"
}

func configured(i int) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id:      &bep.BuildEventId{Id: &bep.BuildEventId_TargetConfigured{TargetConfigured: &bep.BuildEventId_TargetConfiguredId{Label: Label(i)}}},
		Payload: &bep.BuildEvent_Configured{Configured: &bep.TargetConfigured{TargetKind: kind(i)}},
	}
}

func action(i int) *bep.BuildEvent {
	a := &bep.ActionExecuted{Success: !Failed(i), Type: "Genrule"}
	if Failed(i) {
		a.ExitCode = 1
		a.FailureDetail = &bep.FailureDetail{Message: "Executing genrule " + Label(i) + " failed: (Exit 1)"}
	}
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_ActionCompleted{ActionCompleted: &bep.BuildEventId_ActionCompletedId{
			PrimaryOutput: "bazel-out/k8-fastbuild/bin/" + Label(i)[2:] + ".out", Label: Label(i), Configuration: config}}},
		Payload: &bep.BuildEvent_Action{Action: a},
	}
}

func completed(i int) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_TargetCompleted{TargetCompleted: &bep.BuildEventId_TargetCompletedId{
			Label: Label(i), Configuration: config}}},
		Payload: &bep.BuildEvent_Completed{Completed: &bep.TargetComplete{Success: !Failed(i)}},
	}
}

func testResult(i int) *bep.BuildEvent {
	st := TestStatus(i)
	if st == bep.TestStatus_FLAKY {
		st = bep.TestStatus_PASSED // the last attempt passed
	}
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_TestResult{TestResult: &bep.BuildEventId_TestResultId{
			Label: Label(i), Run: 1, Shard: 1, Attempt: 1, Configuration: config}}},
		Payload: &bep.BuildEvent_TestResult{TestResult: &bep.TestResult{Status: st, TestAttemptDurationMillis: 40}},
	}
}

func testSummary(i int) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_TestSummary{TestSummary: &bep.BuildEventId_TestSummaryId{
			Label: Label(i), Configuration: config}}},
		Payload: &bep.BuildEvent_TestSummary{TestSummary: &bep.TestSummary{
			OverallStatus: TestStatus(i), TotalRunCount: 1, TotalRunDurationMillis: 40}},
	}
}

// IDs name the build a Send makes.
type IDs struct{ Project, BuildID, InvocationID string }

// Send sends b to a BES backend as Bazel 4.2.3 does: BuildEnqueued and
// InvocationAttemptStarted, one tool event stream of b.Events events (sent
// without waiting for acks, each acked in order), then
// InvocationAttemptFinished and BuildFinished. It returns when every event
// is acknowledged, or the first error.
func Send(ctx context.Context, client buildpb.PublishBuildEventClient, ids IDs, b Build) error {
	if err := b.Validate(); err != nil {
		return err
	}
	b = b.withDefaults()
	life := func(seq int64, inv string, ev *buildpb.BuildEvent) error {
		ev.EventTime = timestamppb.New(b.Start)
		_, err := client.PublishLifecycleEvent(ctx, &buildpb.PublishLifecycleEventRequest{
			ServiceLevel: buildpb.PublishLifecycleEventRequest_INTERACTIVE,
			BuildEvent: &buildpb.OrderedBuildEvent{
				StreamId:       &buildpb.StreamId{BuildId: ids.BuildID, InvocationId: inv, Component: buildpb.StreamId_CONTROLLER},
				SequenceNumber: seq, Event: ev},
			ProjectId: ids.Project,
		})
		if err != nil {
			return fmt.Errorf("synth: lifecycle event: %w", err)
		}
		return nil
	}
	if err := life(1, "", &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BuildEnqueued_{BuildEnqueued: &buildpb.BuildEvent_BuildEnqueued{}}}); err != nil {
		return err
	}
	if err := life(1, ids.InvocationID, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_InvocationAttemptStarted_{
		InvocationAttemptStarted: &buildpb.BuildEvent_InvocationAttemptStarted{AttemptNumber: 1}}}); err != nil {
		return err
	}
	if err := sendStream(ctx, client, ids, b); err != nil {
		return err
	}
	if err := life(2, ids.InvocationID, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_InvocationAttemptFinished_{
		InvocationAttemptFinished: &buildpb.BuildEvent_InvocationAttemptFinished{
			InvocationStatus: &buildpb.BuildStatus{Result: buildpb.BuildStatus_COMMAND_SUCCEEDED}}}}); err != nil {
		return err
	}
	return life(2, "", &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BuildFinished_{
		BuildFinished: &buildpb.BuildEvent_BuildFinished{Status: &buildpb.BuildStatus{Result: buildpb.BuildStatus_COMMAND_SUCCEEDED}}}})
}

func sendStream(ctx context.Context, client buildpb.PublishBuildEventClient, ids IDs, b Build) error {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := client.PublishBuildToolEventStream(ctx)
	if err != nil {
		return fmt.Errorf("synth: open the stream: %w", err)
	}
	acked := make(chan error, 1)
	go func() {
		for want := int64(1); ; want++ {
			ack, err := st.Recv()
			switch {
			case errors.Is(err, io.EOF) && want == int64(b.Events)+1:
				acked <- nil
				return
			case errors.Is(err, io.EOF):
				acked <- fmt.Errorf("synth: the stream closed after %d acks of %d", want-1, b.Events)
				return
			case err != nil:
				acked <- fmt.Errorf("synth: ack %d: %w", want, err)
				return
			case ack.GetSequenceNumber() != want:
				acked <- fmt.Errorf("synth: ack for %d, want %d", ack.GetSequenceNumber(), want)
				cancel()
				return
			}
		}
	}()
	sid := &buildpb.StreamId{BuildId: ids.BuildID, InvocationId: ids.InvocationID, Component: buildpb.StreamId_TOOL}
	req := &buildpb.PublishBuildToolEventStreamRequest{ProjectId: ids.Project}
	anyEv := &anypb.Any{TypeUrl: bep.TypeURL}
	var buf []byte
	for seq := 1; seq <= b.Events; seq++ {
		ev := &buildpb.BuildEvent{EventTime: timestamppb.New(b.Start.Add(time.Duration(seq) * time.Millisecond))}
		if seq == b.Events {
			ev.Event = &buildpb.BuildEvent_ComponentStreamFinished{ComponentStreamFinished: &buildpb.BuildEvent_BuildComponentStreamFinished{
				Type: buildpb.BuildEvent_BuildComponentStreamFinished_FINISHED}}
		} else {
			buf, err = proto.MarshalOptions{}.MarshalAppend(buf[:0], b.Event(seq))
			if err != nil {
				return fmt.Errorf("synth: event %d: %w", seq, err)
			}
			anyEv.Value = buf
			ev.Event = &buildpb.BuildEvent_BazelEvent{BazelEvent: anyEv}
		}
		req.OrderedBuildEvent = &buildpb.OrderedBuildEvent{StreamId: sid, SequenceNumber: int64(seq), Event: ev}
		req.NotificationKeywords = nil
		if seq == 1 {
			req.NotificationKeywords = []string{"protocol_name=BEP", "invocation_id=" + ids.InvocationID}
		}
		if err := st.Send(req); err != nil {
			break // the stream ended: the receiver has its status
		}
	}
	if err := st.CloseSend(); err != nil {
		return fmt.Errorf("synth: close the stream: %w", err)
	}
	select {
	case err := <-acked:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}
