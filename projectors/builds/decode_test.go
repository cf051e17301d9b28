package builds

import (
	"bytes"
	"fmt"
	"go/build"
	"os"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/timestamppb"

	"github.com/millrace/millrace/schemas/bep"
)

// FuzzDecode feeds message bodies, as they come from the network, to the
// decoder and the in-memory merge: neither may panic, and whatever they
// accept must come out as text PostgreSQL stores (valid UTF-8, no NUL).
//
//	go test ./projectors/builds -run '^$' -fuzz FuzzDecode -fuzztime 1m
func FuzzDecode(f *testing.F) {
	for _, m := range fixtureMessages(f) {
		f.Add(m.data)
	}
	s, _ := scenario()
	for _, m := range s.msgs {
		f.Add(m.data)
	}
	// Metadata, command lines and failed targets with root causes.
	s = newStream(t0)
	metadataBuild(s, "acme", "inv", "c0ffee")
	for _, m := range s.msgs {
		f.Add(m.data)
	}
	if rec, err := os.Open("../../loadtest/fixtures/bazel-test-60.besrec"); err == nil {
		for _, m := range recordingMessages(f, rec) {
			f.Add(m.data)
		}
		rec.Close()
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		b, err := decodeBody(data)
		if err != nil {
			return
		}
		ev := event{body: b, inv: "inv", project: "p", at: t0}
		if ev.kind.tool() && ev.sequence <= 0 {
			ev.sequence = 1
		}
		st := newState()
		st.add(&ev)
		st.apply(&ev)
		v := st.invs[invKey{"p", "inv"}]
		var c invCols
		c.add(v)
		texts := []string{b.invocationID, b.buildID, b.attemptResult, ev.bazel.label}
		texts = append(texts, c.command[0], c.patterns[0], c.user[0], c.host[0], c.workspace[0],
			c.version[0], c.exitName[0], c.result[0])
		for _, t := range v.targets {
			texts = append(texts, t.label, t.kind, t.reason, joinList(t.tags))
		}
		for _, ts := range v.tests {
			texts = append(texts, ts.label, ts.status)
		}
		var once onceCols
		once.add(v)
		for _, m := range v.meta {
			if len(m.key) > maxMetaKey || len(m.value) > maxMetaValue {
				t.Fatalf("metadata %d+%d bytes: not cut to fit the index", len(m.key), len(m.value))
			}
		}
		for _, l := range v.cmdLines {
			texts = append(texts, l.label, joinList(l.argv))
		}
		for _, col := range [][]string{once.meta.key, once.meta.value, once.argv.argv, once.fail.label,
			once.fail.output, once.fail.config, once.fail.message, once.fail.stderr, once.fail.stderrURI,
			once.fail.mnemonic, once.fail.kind} {
			texts = append(texts, col...)
		}
		for _, s := range texts {
			if !utf8.ValidString(s) || strings.ContainsRune(s, 0) {
				t.Fatalf("text not storable: %q", s)
			}
		}
		for _, tm := range []time.Time{v.startedAt, v.finishedAt, b.eventTime} {
			if !tm.IsZero() && (tm.Before(minTime) || tm.After(maxTime)) {
				t.Fatalf("time out of range: %v", tm)
			}
		}
	})
}

// TestDecodeNewerBazel: newer Bazel sends Timestamp and Duration fields
// instead of the millis ones; both must be read.
func TestDecodeNewerBazel(t *testing.T) {
	start := time.Date(2025, 1, 2, 3, 4, 5, 6e8, time.UTC)
	s := newStream(t0)
	b := s.invocation("p", "inv-n")
	b.tool(&bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_Started{Started: &bep.BuildEventId_BuildStartedId{}}},
		Payload: &bep.BuildEvent_Started{Started: &bep.BuildStarted{
			Uuid: "inv-n", StartTime: timestamppb.New(start), Command: "build"}},
	})
	b.tool(&bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_TestResult{TestResult: &bep.BuildEventId_TestResultId{
			Label: "//t:t", Run: 1, Shard: 1, Attempt: 1}}},
		Payload: &bep.BuildEvent_TestResult{TestResult: &bep.TestResult{
			Status: bep.TestStatus_PASSED, TestAttemptDuration: durationpb.New(1500 * time.Millisecond),
			ExecutionInfo: &bep.TestResult_ExecutionInfo{CachedRemotely: true}}},
	})
	b.tool(&bep.BuildEvent{
		Id: &bep.BuildEventId{Id: &bep.BuildEventId_BuildFinished{BuildFinished: &bep.BuildEventId_BuildFinishedId{}}},
		Payload: &bep.BuildEvent_Finished{Finished: &bep.BuildFinished{
			ExitCode: &bep.BuildFinished_ExitCode{Name: "SUCCESS"}, FinishTime: timestamppb.New(start.Add(time.Minute))}},
	})
	st := newState()
	var evs []event
	for _, m := range s.msgs {
		ev, keep, err := decodeMessage(m)
		if err != nil || !keep {
			t.Fatalf("decode: %v %v", keep, err)
		}
		evs = append(evs, ev)
	}
	for i := range evs {
		st.add(&evs[i])
		st.apply(&evs[i])
	}
	v := st.invs[invKey{"p", "inv-n"}]
	if !v.startedAt.Equal(start) || !v.finishedAt.Equal(start.Add(time.Minute)) {
		t.Errorf("times %v %v", v.startedAt, v.finishedAt)
	}
	if !v.hasExit || v.exitCode != 0 || v.exitName != "SUCCESS" {
		t.Errorf("exit %v %d %q", v.hasExit, v.exitCode, v.exitName)
	}
	ts := v.tests["//t:t"]
	if ts == nil || ts.durationMs != 1500 || ts.numCached != 1 || ts.status != "PASSED" {
		t.Errorf("test %+v", ts)
	}
}

// TestUnknownFieldsSurvive: the bep types are a subset of Bazel's; what
// they do not model must survive a decode and re-encode (and so reach any
// consumer that re-marshals).
func TestUnknownFieldsSurvive(t *testing.T) {
	var b []byte
	b = protowire.AppendTag(b, 5, protowire.BytesType) // started
	var started []byte
	started = protowire.AppendTag(started, 5, protowire.BytesType)
	started = protowire.AppendString(started, "test")
	started = protowire.AppendTag(started, 99, protowire.VarintType) // a future field
	started = protowire.AppendVarint(started, 7)
	b = protowire.AppendBytes(b, started)
	var ev bep.BuildEvent
	if err := proto.Unmarshal(b, &ev); err != nil {
		t.Fatal(err)
	}
	if ev.GetStarted().GetCommand() != "test" {
		t.Fatalf("command %q", ev.GetStarted().GetCommand())
	}
	again, err := proto.MarshalOptions{Deterministic: true}.Marshal(&ev)
	if err != nil || !bytes.Equal(again, b) {
		t.Fatalf("re-encoded %x, want %x (%v)", again, b, err)
	}
}

// TestInvalidUTF8IsRepaired: a string field that is not UTF-8 does not make
// the event undecodable.
func TestInvalidUTF8IsRepaired(t *testing.T) {
	var id, payload []byte
	id = protowire.AppendTag(id, 1, protowire.BytesType)
	id = protowire.AppendString(id, "//a:\xff\x00b")
	payload = protowire.AppendTag(payload, 1, protowire.BytesType)
	payload = protowire.AppendString(payload, "sh_test\xc3 rule")
	var e bazelEvent
	if err := e.decode(rawEv(16, id, 18, payload)); err != nil {
		t.Fatal(err)
	}
	if e.label != "//a:\uFFFD\uFFFDb" {
		t.Errorf("label %q", e.label)
	}
	if k := e.msg.(*bep.TargetConfigured).GetTargetKind(); k != "sh_test\uFFFD rule" {
		t.Errorf("kind %q", k)
	}
}

// TestDependencies: a projector has no goroutines of its own and does not
// know NATS (CONTRIBUTING.md, "The backbone").
func TestDependencies(t *testing.T) {
	pkg, err := build.ImportDir(".", 0)
	if err != nil {
		t.Fatal(err)
	}
	for _, imp := range pkg.Imports {
		if strings.Contains(imp, "nats-io") || strings.Contains(imp, "millrace/streams") && imp != "github.com/millrace/millrace/streams/projection" {
			t.Errorf("package builds imports %s", imp)
		}
	}
	for _, name := range pkg.GoFiles {
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		if bytes.Contains(src, []byte("\tgo func")) || bytes.Contains(src, []byte(" go func(")) {
			t.Errorf("%s starts a goroutine", name)
		}
	}
}

// The critical path's length is read from the start of Bazel's "critical
// path" log, and nothing else passes for it; its steps from the lines
// after, the longest kept in the path's order.
func TestParseCriticalPath(t *testing.T) {
	for in, want := range map[string]int64{
		"Critical Path: 0.28s, Remote (0.00% of the time): [parse: 0.00%]\n  0.17s action 'Testing //a:b'": 280,
		"Critical Path: 1234.5s": 1234500,
		"Critical Path: 12s":     12000,
		"critical path: 1s":      -1,
		"Critical Path: s":       -1,
		"Critical Path: -1s":     -1,
		"Critical Path: 1e99s":   -1,
		"Critical Path: 1e9999s": -1,
		"Critical Path: nothing": -1,
		"":                       -1,
	} {
		if got, _ := parseCriticalPath([]byte(in)); got != want {
			t.Errorf("parseCriticalPath(%q) = %d, want %d", in, got, want)
		}
	}

	// As Bazel 4.2.3 wrote it for loadtest/fixtures/bazel-test-60.
	ms, steps := parseCriticalPath([]byte("Critical Path: 0.28s, Remote (0.00% of the time): [parse: 0.00%, queue: 0.00%]\n" +
		"  0.17s action 'Testing //pkg03:test_fail_033'\n" +
		"  0.00s runfiles for //pkg03:test_fail_033\n" +
		"  not a step\n" +
		"  0.05s action 'Executing genrule //pkg01:genrule_ok_014'\n" +
		"  0.03s\n" +
		"  1.5sec action 'x'\n"))
	if want := "170\tTesting //pkg03:test_fail_033\n0\trunfiles for //pkg03:test_fail_033\n50\tExecuting genrule //pkg01:genrule_ok_014"; ms != 280 || steps != want {
		t.Errorf("the fixture's path: %d %q, want 280 %q", ms, steps, want)
	}

	// A long path keeps its longest steps, in order; a long description
	// is cut at a character's start.
	var log strings.Builder
	log.WriteString("Critical Path: 100.00s")
	for i := range 50 {
		fmt.Fprintf(&log, "\n  %d.00s action 'step %02d'", i%7, i)
	}
	fmt.Fprintf(&log, "\n  9.00s action '%s'", strings.Repeat("é", 300))
	_, steps = parseCriticalPath([]byte(log.String()))
	lines := strings.Split(steps, "\n")
	if len(lines) != maxCriticalSteps {
		t.Fatalf("%d steps kept, want %d:\n%s", len(lines), maxCriticalSteps, steps)
	}
	// 9 s once, then the first four of 6 s.
	if lines[0] != "6000\tstep 06" || lines[1] != "6000\tstep 13" || !strings.HasPrefix(lines[len(lines)-1], "9000\téé") {
		t.Errorf("the first and last steps kept: %q, %q", lines[0], lines[len(lines)-1])
	}
	for _, l := range lines {
		if !strings.HasPrefix(l, "6000\t") && !strings.HasPrefix(l, "9000\t") || l == "6000\tstep 48" {
			t.Errorf("a step shorter than the 5 longest was kept: %q", l)
		}
		if len(l) > 6+maxCriticalWhat || !utf8.ValidString(l) {
			t.Errorf("a description not cut at %d bytes, at a character: %q", maxCriticalWhat, l)
		}
	}
	if got := criticalSteps(&steps); len(got) != maxCriticalSteps || got[0].Ms != 6000 || got[0].What != "step 06" {
		t.Errorf("the steps read back: %+v", got)
	}
}
