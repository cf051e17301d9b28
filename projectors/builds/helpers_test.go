package builds

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/bep"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.DropTemplate()
	os.Exit(code)
}

// msg is a stored stream message as the runner hands it to Apply.
type msg struct {
	subject string
	data    []byte
	hdr     map[string]string
	seq     uint64
	at      time.Time
}

func (m *msg) Subject() string          { return m.subject }
func (m *msg) Data() []byte             { return m.data }
func (m *msg) Header(key string) string { return m.hdr[key] }
func (m *msg) Seq() uint64              { return m.seq }
func (m *msg) Time() time.Time          { return m.at }

// stream numbers messages as JetStream would and stamps their storage time.
type stream struct {
	seq  uint64
	now  time.Time
	msgs []*msg
}

func newStream(start time.Time) *stream { return &stream{now: start} }

// advance moves the stream's clock, as time passes between events.
func (s *stream) advance(d time.Duration) time.Time {
	s.now = s.now.Add(d)
	return s.now
}

func (s *stream) add(m *msg) *msg {
	s.seq++
	s.now = s.now.Add(7 * time.Millisecond)
	m.seq, m.at = s.seq, s.now
	s.msgs = append(s.msgs, m)
	return m
}

// builder writes the events of one invocation into a stream.
type builder struct {
	s       *stream
	project string
	build   string
	inv     string
	seq     int64 // last BES tool sequence used
}

func (s *stream) invocation(project, inv string) *builder {
	return &builder{s: s, project: project, build: "build-" + inv, inv: inv}
}

func (b *builder) headers(kind string, seq int64, withInv bool) map[string]string {
	h := map[string]string{
		envelope.Schema:   envelope.SchemaBESv1,
		envelope.Kind:     kind,
		envelope.Project:  b.project,
		envelope.BuildID:  b.build,
		envelope.Sequence: strconv.FormatInt(seq, 10),
	}
	if withInv {
		h[envelope.InvocationID] = b.inv
		h[envelope.MsgID] = fmt.Sprintf("%s/%d", b.inv, seq)
	}
	return h
}

func (b *builder) obe(seq int64, ev *buildpb.BuildEvent, component buildpb.StreamId_BuildComponent, withInv bool) []byte {
	sid := &buildpb.StreamId{BuildId: b.build, Component: component}
	if withInv {
		sid.InvocationId = b.inv
	}
	ev.EventTime = timestamppb.New(b.s.now)
	data, err := proto.Marshal(&buildpb.OrderedBuildEvent{StreamId: sid, SequenceNumber: seq, Event: ev})
	if err != nil {
		panic(err)
	}
	return data
}

// tool appends a bazel_event with the next sequence number.
func (b *builder) tool(be *bep.BuildEvent) *msg {
	b.seq++
	return b.toolAt(b.seq, be)
}

// toolAt appends a bazel_event with a given sequence number (a resend).
func (b *builder) toolAt(seq int64, be *bep.BuildEvent) *msg {
	value, err := proto.Marshal(be)
	if err != nil {
		panic(err)
	}
	return b.toolBytes(seq, value)
}

// toolBytes appends a bazel_event whose BuildEvent bytes are given, for
// events that the Go protobuf runtime would refuse to marshal (strings that
// are not UTF-8, as Bazel may send from file names and tool output).
func (b *builder) toolBytes(seq int64, value []byte) *msg {
	ev := &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BazelEvent{
		BazelEvent: &anypb.Any{TypeUrl: bep.TypeURL, Value: value}}}
	return b.s.add(&msg{
		subject: subjects.BES(b.project, b.inv),
		data:    b.obe(seq, ev, buildpb.StreamId_TOOL, true),
		hdr:     b.headers(envelope.KindTool, seq, true),
	})
}

// finishStream appends ComponentStreamFinished.
func (b *builder) finishStream() *msg {
	b.seq++
	ev := &buildpb.BuildEvent{Event: &buildpb.BuildEvent_ComponentStreamFinished{
		ComponentStreamFinished: &buildpb.BuildEvent_BuildComponentStreamFinished{
			Type: buildpb.BuildEvent_BuildComponentStreamFinished_FINISHED}}}
	return b.s.add(&msg{
		subject: subjects.BES(b.project, b.inv),
		data:    b.obe(b.seq, ev, buildpb.StreamId_TOOL, true),
		hdr:     b.headers(envelope.KindTool, b.seq, true),
	})
}

func (b *builder) lifecycle(seq int64, ev *buildpb.BuildEvent, withInv bool) *msg {
	subject := subjects.BES(b.project, b.inv)
	if !withInv {
		subject = subjects.BES(b.project, b.build)
	}
	return b.s.add(&msg{
		subject: subject,
		data:    b.obe(seq, ev, buildpb.StreamId_CONTROLLER, withInv),
		hdr:     b.headers(envelope.KindLifecycle, seq, withInv),
	})
}

func (b *builder) enqueued() *msg {
	return b.lifecycle(1, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BuildEnqueued_{
		BuildEnqueued: &buildpb.BuildEvent_BuildEnqueued{}}}, false)
}

func (b *builder) attemptStarted() *msg {
	return b.lifecycle(1, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_InvocationAttemptStarted_{
		InvocationAttemptStarted: &buildpb.BuildEvent_InvocationAttemptStarted{AttemptNumber: 1}}}, true)
}

func (b *builder) attemptFinished(r buildpb.BuildStatus_Result) *msg {
	return b.lifecycle(2, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_InvocationAttemptFinished_{
		InvocationAttemptFinished: &buildpb.BuildEvent_InvocationAttemptFinished{
			InvocationStatus: &buildpb.BuildStatus{Result: r}}}}, true)
}

func (b *builder) buildFinished(r buildpb.BuildStatus_Result) *msg {
	return b.lifecycle(2, &buildpb.BuildEvent{Event: &buildpb.BuildEvent_BuildFinished_{
		BuildFinished: &buildpb.BuildEvent_BuildFinished{Status: &buildpb.BuildStatus{Result: r}}}}, false)
}

// BuildEvent constructors, shaped like Bazel 4.2.3's.

func progressEv(n int32, stdout, stderr string) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id:      &bep.BuildEventId{Id: &bep.BuildEventId_Progress{Progress: &bep.BuildEventId_ProgressId{OpaqueCount: n}}},
		Payload: &bep.BuildEvent_Progress{Progress: &bep.Progress{Stdout: stdout, Stderr: stderr}},
	}
}

func startedEv(inv string, at time.Time) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_Started{Started: &bep.BuildEventId_BuildStartedId{}}},
		Payload: &bep.BuildEvent_Started{Started: &bep.BuildStarted{
			Uuid: inv, StartTimeMillis: at.UnixMilli(), BuildToolVersion: "4.2.3", Command: "test",
			WorkingDirectory: "/src/ws", WorkspaceDirectory: "/src/ws", ServerPid: 4242,
		}},
	}
}

func workspaceStatusEv(user, host string) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_WorkspaceStatus{WorkspaceStatus: &bep.BuildEventId_WorkspaceStatusId{}}},
		Payload: &bep.BuildEvent_WorkspaceStatus{WorkspaceStatus: &bep.WorkspaceStatus{Item: []*bep.WorkspaceStatus_Item{
			{Key: "BUILD_EMBED_LABEL"}, {Key: "BUILD_HOST", Value: host}, {Key: "BUILD_USER", Value: user},
		}}},
	}
}

func patternEv(patterns ...string) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id:      &bep.BuildEventId{Id: &bep.BuildEventId_Pattern{Pattern: &bep.BuildEventId_PatternExpandedId{Pattern: patterns}}},
		Payload: &bep.BuildEvent_Expanded{Expanded: &bep.PatternExpanded{}},
	}
}

func configuredEv(label, kind string, tags ...string) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id:      &bep.BuildEventId{Id: &bep.BuildEventId_TargetConfigured{TargetConfigured: &bep.BuildEventId_TargetConfiguredId{Label: label}}},
		Payload: &bep.BuildEvent_Configured{Configured: &bep.TargetConfigured{TargetKind: kind, Tag: tags}},
	}
}

func namedSetEv(id string) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id:      &bep.BuildEventId{Id: &bep.BuildEventId_NamedSet{NamedSet: &bep.BuildEventId_NamedSetOfFilesId{Id: id}}},
		Payload: &bep.BuildEvent_NamedSetOfFiles{NamedSetOfFiles: &bep.NamedSetOfFiles{}},
	}
}

func actionEv(label, output string, ok bool, exit int32, msg string) *bep.BuildEvent {
	a := &bep.ActionExecuted{Success: ok, Type: "Genrule", ExitCode: exit,
		CommandLine: []string{"/bin/bash", "-c", "source external/bazel_tools/tools/genrule/genrule-setup.sh; ..."}}
	if msg != "" {
		a.FailureDetail = &bep.FailureDetail{Message: msg}
	}
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_ActionCompleted{ActionCompleted: &bep.BuildEventId_ActionCompletedId{
			PrimaryOutput: output, Label: label,
			Configuration: &bep.BuildEventId_ConfigurationId{Id: "63d1ec2b"}}}},
		Payload: &bep.BuildEvent_Action{Action: a},
	}
}

func completedEv(label string, ok bool, failure string) *bep.BuildEvent {
	c := &bep.TargetComplete{Success: ok}
	if failure != "" {
		c.FailureDetail = &bep.FailureDetail{Message: failure}
	}
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_TargetCompleted{TargetCompleted: &bep.BuildEventId_TargetCompletedId{
			Label: label, Configuration: &bep.BuildEventId_ConfigurationId{Id: "63d1ec2b"}}}},
		Payload: &bep.BuildEvent_Completed{Completed: c},
	}
}

func abortedEv(id *bep.BuildEventId, reason bep.Aborted_AbortReason, desc string) *bep.BuildEvent {
	return &bep.BuildEvent{Id: id, Payload: &bep.BuildEvent_Aborted{Aborted: &bep.Aborted{Reason: reason, Description: desc}}}
}

func testResultEv(label string, attempt int32, status bep.TestStatus, ms int64, cached bool) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_TestResult{TestResult: &bep.BuildEventId_TestResultId{
			Label: label, Run: 1, Shard: 1, Attempt: attempt,
			Configuration: &bep.BuildEventId_ConfigurationId{Id: "63d1ec2b"}}}},
		Payload: &bep.BuildEvent_TestResult{TestResult: &bep.TestResult{
			Status: status, CachedLocally: cached, TestAttemptDurationMillis: ms,
			ExecutionInfo: &bep.TestResult_ExecutionInfo{Strategy: "linux-sandbox", Hostname: "ci-7"}}},
	}
}

func testSummaryEv(label string, status bep.TestStatus, runs int32, ms int64) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_TestSummary{TestSummary: &bep.BuildEventId_TestSummaryId{
			Label: label, Configuration: &bep.BuildEventId_ConfigurationId{Id: "63d1ec2b"}}}},
		Payload: &bep.BuildEvent_TestSummary{TestSummary: &bep.TestSummary{
			OverallStatus: status, TotalRunCount: runs, TotalRunDurationMillis: ms}},
	}
}

func finishedEv(code int32, name string, at time.Time) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_BuildFinished{BuildFinished: &bep.BuildEventId_BuildFinishedId{}}},
		Payload: &bep.BuildEvent_Finished{Finished: &bep.BuildFinished{
			OverallSuccess: code == 0, ExitCode: &bep.BuildFinished_ExitCode{Name: name, Code: code},
			FinishTimeMillis: at.UnixMilli()}},
	}
}

func metricsEv(actions int64) *bep.BuildEvent {
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_BuildMetrics{BuildMetrics: &bep.BuildEventId_BuildMetricsId{}}},
		Payload: &bep.BuildEvent_BuildMetrics{BuildMetrics: &bep.BuildMetrics{
			ActionSummary: &bep.BuildMetrics_ActionSummary{ActionsCreated: actions + 12, ActionsExecuted: actions,
				ActionCacheStatistics: &bep.ActionCacheStatistics{Hits: 3, Misses: int32(actions)}},
			MemoryMetrics:  &bep.BuildMetrics_MemoryMetrics{UsedHeapSizePostBuild: 0, PeakPostGcHeapSize: 91 << 20},
			TargetMetrics:  &bep.BuildMetrics_TargetMetrics{TargetsLoaded: 61, TargetsConfigured: 75},
			PackageMetrics: &bep.BuildMetrics_PackageMetrics{PackagesLoaded: 7},
			TimingMetrics:  &bep.BuildMetrics_TimingMetrics{CpuTimeInMs: 9000, WallTimeInMs: 12000},
		}},
	}
}

func newerMetricsEv() *bep.BuildEvent {
	return &bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_BuildMetrics{BuildMetrics: &bep.BuildEventId_BuildMetricsId{}}},
		Payload: &bep.BuildEvent_BuildMetrics{BuildMetrics: &bep.BuildMetrics{
			ActionSummary: &bep.BuildMetrics_ActionSummary{RemoteCacheHits: 5},
			TimingMetrics: &bep.BuildMetrics_TimingMetrics{AnalysisPhaseTimeInMs: 300, ExecutionPhaseTimeInMs: 700},
		}},
	}
}

// rawEv encodes a BuildEvent by hand: id field 1 holding one id case, and
// one payload case, each given as (field number, message bytes).
func rawEv(idCase protowire.Number, id []byte, payloadCase protowire.Number, payload []byte) []byte {
	var idMsg []byte
	idMsg = protowire.AppendTag(idMsg, idCase, protowire.BytesType)
	idMsg = protowire.AppendBytes(idMsg, id)
	var b []byte
	b = protowire.AppendTag(b, 1, protowire.BytesType)
	b = protowire.AppendBytes(b, idMsg)
	b = protowire.AppendTag(b, payloadCase, protowire.BytesType)
	return protowire.AppendBytes(b, payload)
}

// rawString encodes a message with string fields given by number.
func rawString(fields ...any) []byte {
	var b []byte
	for i := 0; i < len(fields); i += 2 {
		b = protowire.AppendTag(b, protowire.Number(fields[i].(int)), protowire.BytesType)
		b = protowire.AppendString(b, fields[i+1].(string))
	}
	return b
}

func simpleEv(id *bep.BuildEventId) *bep.BuildEvent { return &bep.BuildEvent{Id: id} }

// synthBuild appends a realistic build of n targets to the stream, shaped
// like a fresh Bazel 4.2.3 `bazel test //... --keep_going` with all actions
// published: every 10th target a test (one of them flaky, one failing),
// every 17th genrule failing, about 300 bytes of output per progress event.
// It returns the number of BES tool events.
func synthBuild(s *stream, project, inv string, n int, finish bool) *builder {
	b := s.invocation(project, inv)
	start := s.now
	b.enqueued()
	b.attemptStarted()
	b.tool(startedEv(inv, start))
	b.tool(simpleEv(&bep.BuildEventId{Id: &bep.BuildEventId_UnstructuredCommandLine{}}))
	b.tool(simpleEv(&bep.BuildEventId{Id: &bep.BuildEventId_StructuredCommandLine{
		StructuredCommandLine: &bep.BuildEventId_StructuredCommandLineId{CommandLineLabel: "original"}}}))
	b.tool(simpleEv(&bep.BuildEventId{Id: &bep.BuildEventId_OptionsParsed{}}))
	b.tool(&bep.BuildEvent{Id: &bep.BuildEventId{Id: &bep.BuildEventId_BuildMetadata{}},
		Payload: &bep.BuildEvent_BuildMetadata{BuildMetadata: &bep.BuildMetadata{Metadata: map[string]string{"ROLE": "CI", "COMMIT_SHA": "sha-of-" + project}}}})
	b.tool(workspaceStatusEv("ci", "ci-7.example"))
	b.tool(patternEv("//..."))
	prog := int32(0)
	progress := func(stderr string) {
		prog++
		b.tool(progressEv(prog, "", stderr))
	}
	progress("Loading: 0 packages loaded\n\x1b[32mINFO: \x1b[0mAnalyzed " + strconv.Itoa(n) + " targets (7 packages loaded).\n")
	label := func(i int) string {
		if i%10 == 9 {
			return fmt.Sprintf("//pkg%02d:test_%03d", i/10, i)
		}
		return fmt.Sprintf("//pkg%02d:gen_%03d", i/10, i)
	}
	for i := 0; i < n; i++ {
		kind := "genrule rule"
		if i%10 == 9 {
			kind = "sh_test rule"
		}
		b.tool(configuredEv(label(i), kind))
	}
	exitCode, exitName := int32(0), "SUCCESS"
	for i := 0; i < n; i++ {
		l := label(i)
		failing := i%17 == 16 && i%10 != 9
		progress(fmt.Sprintf("\r\x1b[1A\x1b[K[%d / %d] Executing genrule %s; 0s linux-sandbox ... (%d actions running)\n%s",
			i, n, l, i%4+1, "    // some output that the genrule printed, long enough to look real ......\n"))
		b.tool(namedSetEv(strconv.Itoa(i)))
		if failing {
			exitCode, exitName = 1, "BUILD_FAILURE"
			out := "bazel-out/k8-fastbuild/bin/" + l[2:] + ".txt"
			b.tool(actionEv(l, out, false, 1, "Executing genrule "+l+" failed: (Exit 1): bash failed: error executing command"))
			c := completedEv(l, false, "")
			c.Children = []*bep.BuildEventId{actionID(l, out)}
			b.tool(c)
			continue
		}
		b.tool(actionEv(l, "bazel-out/k8-fastbuild/bin/"+l[2:]+".txt", true, 0, ""))
		b.tool(completedEv(l, true, ""))
		if i%10 == 9 {
			switch {
			case i%30 == 19: // flaky
				b.tool(testResultEv(l, 1, bep.TestStatus_FAILED, 120, false))
				b.tool(testResultEv(l, 2, bep.TestStatus_PASSED, 110, false))
				b.tool(testSummaryEv(l, bep.TestStatus_FLAKY, 2, 230))
			case i%30 == 29: // failing
				if exitCode == 0 {
					exitCode, exitName = 3, "TESTS_FAILED"
				}
				b.tool(testResultEv(l, 1, bep.TestStatus_FAILED, 90, false))
				b.tool(testSummaryEv(l, bep.TestStatus_FAILED, 1, 90))
			default:
				b.tool(testResultEv(l, 1, bep.TestStatus_PASSED, 40, false))
				b.tool(testSummaryEv(l, bep.TestStatus_PASSED, 1, 40))
			}
		}
	}
	if !finish {
		return b
	}
	end := s.now.Add(3 * time.Second)
	b.tool(finishedEv(exitCode, exitName, end))
	b.tool(simpleEv(&bep.BuildEventId{Id: &bep.BuildEventId_BuildToolLogs{}}))
	b.tool(metricsEv(int64(n)))
	progress("\x1b[32mINFO: \x1b[0mBuild completed, " + exitName + "\n")
	b.finishStream()
	b.attemptFinished(buildpb.BuildStatus_COMMAND_SUCCEEDED)
	b.buildFinished(buildpb.BuildStatus_COMMAND_SUCCEEDED)
	return b
}

// applyAll applies msgs in batches of size n, each in its own transaction,
// as the runner does (skipping nothing: the projector's own guards must
// hold), and tells the projector each commit, as the runner does, so that
// its cache serves the batches after the first; the tables may have been
// changed before, so the cache starts empty.
func applyAll(t testing.TB, pool *pgxpool.Pool, p *Projector, msgs []*msg, n int) {
	t.Helper()
	ctx := context.Background()
	p.Aborted()
	for i := 0; i < len(msgs); i += n {
		batch := make([]projection.Message, 0, n)
		for _, m := range msgs[i:min(i+n, len(msgs))] {
			batch = append(batch, m)
		}
		if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.Apply(ctx, tx, batch) }); err != nil {
			t.Fatalf("apply batch at %d: %v", i, err)
		}
		p.Committed()
	}
}

func sweep(t testing.TB, pool *pgxpool.Pool, p *Projector, now time.Time) {
	t.Helper()
	ctx := context.Background()
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.Sweep(ctx, tx, now) }); err != nil {
		t.Fatalf("sweep: %v", err)
	}
}

func digest(t testing.TB, pool *pgxpool.Pool) map[string]string {
	t.Helper()
	d, err := Digest(context.Background(), pool)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func truncate(t testing.TB, pool *pgxpool.Pool) {
	t.Helper()
	tables := []string{"hourly_rollups", "test_daily", "build_argv"}
	for t := range rowTables {
		tables = append(tables, t)
	}
	if _, err := pool.Exec(context.Background(), "truncate "+strings.Join(tables, ", ")); err != nil {
		t.Fatal(err)
	}
}

// ofBuild is the condition that names one build's rows of table, the
// build's project in $1 and invocation id in $2.
func ofBuild(table string) string {
	if byBuildKey(table) {
		return "build_key = (select build_key from invocations where project = $1 and id = $2)"
	}
	return "project = $1 and " + rowTables[table] + " = $2"
}

// sqlTestPartitions makes the partitions of every build's week, for tests
// that write rows straight into the tables.
const sqlTestPartitions = `select build_partitions_for(w) from (select distinct ((build_key >> 47) / 7)::int4 as w from invocations) x`
