package bazelws

import (
	"os"
	"reflect"
	"strings"
	"testing"
)

// TestParseJSONFile reads a file recorded from Bazel 4.2.3 (the bazel-test-8 fixture: one target of
// every outcome) and checks every field against what that run printed.
func TestParseJSONFile(t *testing.T) {
	s, err := ParseJSONFile("testdata/bazel-test-8.json")
	if err != nil {
		t.Fatal(err)
	}
	if s.InvocationID != "e1016b3f-c48f-459e-9bc9-0b3657c85a12" || s.Command != "test" {
		t.Errorf("invocation %q command %q", s.InvocationID, s.Command)
	}
	if s.Events != 98 || !s.LastMessage || !s.Finished {
		t.Errorf("events %d lastMessage %v finished %v", s.Events, s.LastMessage, s.Finished)
	}
	if s.ExitCode != 1 || s.ExitCodeName != "BUILD_FAILURE" {
		t.Errorf("exit %d %s", s.ExitCode, s.ExitCodeName)
	}
	wantTargets := map[string]bool{
		"//pkg00:genrule_ok_000":   true,
		"//pkg00:genrule_fail_001": false, // completed without "success": the zero value
		"//pkg00:test_pass_002":    true,
		"//pkg00:test_fail_003":    true, // a failing test still built
		"//pkg00:genrule_ok_004":   true,
		"//pkg00:genrule_ok_005":   true,
		"//pkg00:test_flaky_006":   true,
		"//pkg00:test_broken_007":  false,
	}
	if !reflect.DeepEqual(s.Targets, wantTargets) {
		t.Errorf("Targets:\n%s", diffMaps(wantTargets, s.Targets))
	}
	wantSummaries := map[string]string{
		"//pkg00:test_pass_002":  "PASSED",
		"//pkg00:test_fail_003":  "FAILED",
		"//pkg00:test_flaky_006": "FLAKY",
	}
	if !reflect.DeepEqual(s.Tests, wantSummaries) {
		t.Errorf("Tests:\n%s", diffMaps(wantSummaries, s.Tests))
	}
	wantStatuses := map[string]string{
		"//pkg00:test_pass_002":   "PASSED",
		"//pkg00:test_fail_003":   "FAILED",
		"//pkg00:test_flaky_006":  "FLAKY",
		"//pkg00:test_broken_007": "FAILED_TO_BUILD",
	}
	if got := s.TestStatuses(); !reflect.DeepEqual(got, wantStatuses) {
		t.Errorf("TestStatuses:\n%s", diffMaps(wantStatuses, got))
	}
	if k := s.TargetKinds["//pkg00:test_flaky_006"]; k != "script_test rule" {
		t.Errorf("kind of the flaky test: %q", k)
	}
	if k := s.TargetKinds["//pkg00:genrule_ok_000"]; k != "genrule rule" {
		t.Errorf("kind of a genrule: %q", k)
	}
	for kind, n := range map[string]int{"started": 1, "targetConfigured": 8, "targetCompleted": 8, "testSummary": 3, "buildFinished": 1} {
		if s.EventCounts[kind] != n {
			t.Errorf("EventCounts[%s] = %d, want %d", kind, s.EventCounts[kind], n)
		}
	}
}

// TestParseJSONZeroValues covers what proto3 JSON leaves out and what the recorded file has no example
// of: a summary without overallStatus, an exit code of 0, aborted targets, and a label completed twice.
func TestParseJSONZeroValues(t *testing.T) {
	const in = `{"id":{"started":{}},"started":{"uuid":"u-1","command":"test"}}
{"id":{"targetConfigured":{"label":"//a:t"}},"configured":{"targetKind":"sh_test rule","testSize":"MEDIUM"}}
{"id":{"targetConfigured":{"label":"//a:u"}},"configured":{"targetKind":"my_test rule"}}
{"id":{"targetConfigured":{"label":"//a:v"}},"configured":{"targetKind":"sh_test rule","testSize":"SMALL"}}
{"id":{"targetConfigured":{"label":"//a:gone"}},"aborted":{"reason":"ANALYSIS_FAILURE","description":"no such target"}}
{"id":{"targetCompleted":{"label":"//a:t","configuration":{"id":"c1"}}},"completed":{"success":true}}
{"id":{"targetCompleted":{"label":"//a:u","configuration":{"id":"c1"}}},"completed":{"success":true}}
{"id":{"targetCompleted":{"label":"//a:u","configuration":{"id":"c2"}}},"completed":{}}
{"id":{"targetCompleted":{"label":"//a:v","configuration":{"id":"c1"}}},"aborted":{"reason":"USER_INTERRUPTED"}}
{"id":{"testSummary":{"label":"//a:t","configuration":{"id":"c1"}}},"testSummary":{"totalRunCount":1}}
{"id":{"buildFinished":{}},"finished":{"exitCode":{"name":"SUCCESS"}},"lastMessage":true}
`
	s, err := ParseJSON(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	if s.InvocationID != "u-1" || s.Events != 11 || !s.LastMessage {
		t.Errorf("invocation %q events %d lastMessage %v", s.InvocationID, s.Events, s.LastMessage)
	}
	if !s.Finished || s.ExitCode != 0 || s.ExitCodeName != "SUCCESS" {
		t.Errorf("finished %v exit %d %s", s.Finished, s.ExitCode, s.ExitCodeName)
	}
	wantTargets := map[string]bool{"//a:t": true, "//a:u": false, "//a:v": false, "//a:gone": false}
	if !reflect.DeepEqual(s.Targets, wantTargets) {
		t.Errorf("Targets:\n%s", diffMaps(wantTargets, s.Targets))
	}
	wantStatuses := map[string]string{"//a:t": "NO_STATUS", "//a:u": "FAILED_TO_BUILD", "//a:v": "FAILED_TO_BUILD"}
	if got := s.TestStatuses(); !reflect.DeepEqual(got, wantStatuses) {
		t.Errorf("TestStatuses:\n%s", diffMaps(wantStatuses, got))
	}
}

func TestParseJSONErrors(t *testing.T) {
	for name, in := range map[string]string{
		"truncated":     `{"id":{"started":{}},"started":{"uuid":"u"}}` + "\n" + `{"id":{"buildFin`,
		"two id kinds":  `{"id":{"started":{},"progress":{}}}`,
		"no id":         `{"started":{"uuid":"u"}}`,
		"label missing": `{"id":{"targetCompleted":{}},"completed":{"success":true}}`,
	} {
		if _, err := ParseJSON(strings.NewReader(in)); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

// FuzzParseJSON: the parser reads files that came from elsewhere; it must fail cleanly, never panic.
func FuzzParseJSON(f *testing.F) {
	b, err := os.ReadFile("testdata/bazel-test-8.json")
	if err != nil {
		f.Fatal(err)
	}
	f.Add(b)
	f.Add([]byte(`{"id":{"testSummary":{"label":"//x:y"}},"testSummary":{}}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		s, err := ParseJSON(strings.NewReader(string(b)))
		if err == nil {
			s.TestStatuses()
		}
	})
}
