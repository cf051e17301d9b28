package bazelws

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"os"
	"slices"
	"strings"
)

// JSONSummary is what a test needs from Bazel's --build_event_json_file: the outcome of the invocation,
// of every target and of every test, as Bazel itself reported them.
//
// The file is proto3 JSON, which omits zero values: a target_completed without "success" failed, a
// test_summary without "overallStatus" has NO_STATUS (not PASSED), a finished event without
// "exitCode.code" exited 0. The fields here hold those values explicitly.
type JSONSummary struct {
	Events       int            // events in the file (one per line)
	EventCounts  map[string]int // events per id kind as the JSON spells it ("progress", "targetCompleted", ...)
	InvocationID string         // started.uuid
	Command      string         // started.command ("build", "test")
	Finished     bool           // a buildFinished event was seen
	ExitCode     int            // finished.exitCode.code
	ExitCodeName string         // finished.exitCode.name ("SUCCESS", "BUILD_FAILURE", "TESTS_FAILED", ...)
	LastMessage  bool           // the last event carried lastMessage: the file is complete

	// Targets maps each label with a target_completed event to its success. An aborted payload on a
	// target_completed or target_configured id counts as failure; several completions of one label (more
	// than one configuration) succeed only if all do.
	Targets map[string]bool
	// TargetKinds maps each configured label to its kind ("genrule rule", "script_test rule").
	TargetKinds map[string]string
	// TestTargets holds the configured labels that are tests (Bazel gave them a test size).
	TestTargets map[string]bool
	// Tests maps each label with a test_summary event to its overall status.
	Tests map[string]string

	// RootCauses maps each target whose target_completed or aborted event
	// failed to the labels its children name as root causes (failed
	// actions' labels, labels that did not load or analyse), sorted, once
	// each; a failed target without children has none.
	RootCauses map[string][]string
	// FailedActions maps the label of each failed action_completed event to
	// its exit code.
	FailedActions map[string]int
	// WorkspaceStatus and BuildMetadata are the items of the
	// workspace_status and build_metadata events.
	WorkspaceStatus map[string]string
	BuildMetadata   map[string]string
}

// TestStatuses returns a status for every test target of a `bazel test` run: the test summary's, or,
// for a test that has none because it failed to build, FAILED_TO_BUILD (what Bazel's terminal summary
// says), or NO_STATUS for a test that built but was never summarised (an interrupted build).
func (s *JSONSummary) TestStatuses() map[string]string {
	out := make(map[string]string, len(s.TestTargets))
	for l := range s.TestTargets {
		switch st, ok := s.Tests[l]; {
		case ok:
			out[l] = st
		case !s.Targets[l]:
			out[l] = StatusFailedToBuild
		default:
			out[l] = StatusNoStatus
		}
	}
	for l, st := range s.Tests { // a summary for a target that was not configured in this file
		out[l] = st
	}
	return out
}

// jsonEvent holds the parts of a build_event_stream.BuildEvent that JSONSummary reads.
type jsonEvent struct {
	ID          map[string]json.RawMessage `json:"id"`
	Children    []map[string]jsonLabelID   `json:"children"`
	LastMessage bool                       `json:"lastMessage"`
	Action      *struct {
		Success  bool   `json:"success"`
		ExitCode int    `json:"exitCode"`
		Label    string `json:"label"`
	} `json:"action"`
	WorkspaceStatus *struct {
		Item []struct {
			Key   string `json:"key"`
			Value string `json:"value"`
		} `json:"item"`
	} `json:"workspaceStatus"`
	BuildMetadata *struct {
		Metadata map[string]string `json:"metadata"`
	} `json:"buildMetadata"`
	Started *struct {
		UUID    string `json:"uuid"`
		Command string `json:"command"`
	} `json:"started"`
	Finished *struct {
		ExitCode *struct {
			Name string `json:"name"`
			Code int    `json:"code"`
		} `json:"exitCode"`
	} `json:"finished"`
	Configured *struct {
		TargetKind string `json:"targetKind"`
		TestSize   string `json:"testSize"`
	} `json:"configured"`
	Completed *struct {
		Success bool `json:"success"`
	} `json:"completed"`
	Aborted *struct {
		Reason string `json:"reason"`
	} `json:"aborted"`
	TestSummary *struct {
		OverallStatus string `json:"overallStatus"`
	} `json:"testSummary"`
}

type jsonLabelID struct {
	Label string `json:"label"`
}

// addCauses records the root-cause labels among a failed target's
// children.
func (s *JSONSummary) addCauses(label string, children []map[string]jsonLabelID) {
	causes := s.RootCauses[label]
	for _, c := range children {
		for kind, id := range c {
			switch kind {
			case "actionCompleted", "configuredLabel", "unconfiguredLabel":
				if !slices.Contains(causes, id.Label) {
					causes = append(causes, id.Label)
				}
			}
		}
	}
	if causes == nil {
		causes = []string{}
	}
	slices.Sort(causes)
	s.RootCauses[label] = causes
}

// ParseJSONFile reads the file Bazel wrote with --build_event_json_file.
func ParseJSONFile(path string) (*JSONSummary, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	s, err := ParseJSON(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

// ParseJSON reads build events as Bazel writes them with --build_event_json_file: one JSON object per
// line (a decoder reads them, so no line is too long).
func ParseJSON(r io.Reader) (*JSONSummary, error) {
	s := &JSONSummary{
		EventCounts: map[string]int{},
		Targets:     map[string]bool{},
		TargetKinds: map[string]string{},
		TestTargets: map[string]bool{},
		Tests:       map[string]string{},

		RootCauses:      map[string][]string{},
		FailedActions:   map[string]int{},
		WorkspaceStatus: map[string]string{},
		BuildMetadata:   map[string]string{},
	}
	dec := json.NewDecoder(r)
	for {
		var ev jsonEvent
		err := dec.Decode(&ev)
		if errors.Is(err, io.EOF) {
			return s, nil
		}
		if err != nil {
			return s, fmt.Errorf("event %d: %w", s.Events+1, err)
		}
		s.Events++
		if err := s.add(&ev); err != nil {
			return s, fmt.Errorf("event %d: %w", s.Events, err)
		}
	}
}

func (s *JSONSummary) add(ev *jsonEvent) error {
	if len(ev.ID) != 1 {
		return fmt.Errorf("id has %d kinds, want 1", len(ev.ID))
	}
	var kind string
	var raw json.RawMessage
	for k, v := range ev.ID {
		kind, raw = k, v
	}
	s.EventCounts[kind]++
	s.LastMessage = ev.LastMessage

	var id jsonLabelID
	switch kind {
	case "targetConfigured", "targetCompleted", "testSummary":
		if err := json.Unmarshal(raw, &id); err != nil {
			return fmt.Errorf("%s id: %w", kind, err)
		}
		if id.Label == "" {
			return fmt.Errorf("%s id without a label", kind)
		}
	}

	switch {
	case kind == "started" && ev.Started != nil:
		s.InvocationID = ev.Started.UUID
		s.Command = ev.Started.Command
	case kind == "buildFinished" && ev.Finished != nil:
		s.Finished = true
		if ec := ev.Finished.ExitCode; ec != nil {
			s.ExitCode, s.ExitCodeName = ec.Code, ec.Name
		}
	case kind == "targetConfigured" && ev.Configured != nil:
		s.TargetKinds[id.Label] = ev.Configured.TargetKind
		if ev.Configured.TestSize != "" || strings.HasSuffix(ev.Configured.TargetKind, "_test rule") {
			s.TestTargets[id.Label] = true
		}
	case kind == "targetCompleted" && ev.Completed != nil:
		prev, seen := s.Targets[id.Label]
		s.Targets[id.Label] = ev.Completed.Success && (!seen || prev)
		if !ev.Completed.Success {
			s.addCauses(id.Label, ev.Children)
		}
	case (kind == "targetCompleted" || kind == "targetConfigured") && ev.Aborted != nil:
		s.Targets[id.Label] = false
		s.addCauses(id.Label, ev.Children)
	case kind == "actionCompleted" && ev.Action != nil && !ev.Action.Success:
		var aid jsonLabelID
		if err := json.Unmarshal(raw, &aid); err != nil {
			return fmt.Errorf("%s id: %w", kind, err)
		}
		s.FailedActions[aid.Label] = ev.Action.ExitCode
	case kind == "workspaceStatus" && ev.WorkspaceStatus != nil:
		for _, it := range ev.WorkspaceStatus.Item {
			s.WorkspaceStatus[it.Key] = it.Value
		}
	case kind == "buildMetadata" && ev.BuildMetadata != nil:
		maps.Copy(s.BuildMetadata, ev.BuildMetadata.Metadata)
	case kind == "testSummary" && ev.TestSummary != nil:
		st := ev.TestSummary.OverallStatus
		if st == "" {
			st = StatusNoStatus // the enum's zero value, which proto3 JSON omits
		}
		s.Tests[id.Label] = st
	}
	return nil
}
