package deps

import (
	"os/exec"
	"slices"
	"strings"
	"testing"
)

// depsOf lists every package pkg imports, transitively (go list -deps).
func depsOf(t *testing.T, pkg string) []string {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", pkg).Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	return strings.Fields(string(out))
}

func TestDependencyDirection(t *testing.T) {
	const mod = "github.com/millrace/millrace"
	rules := []struct {
		pkg       string
		forbidden []string // prefixes
		why       string
	}{
		{mod + "/services/...", []string{mod + "/projectors"}, "edges publish; they never depend on a projection"},
		{mod + "/projectors/...", []string{"github.com/nats-io/", mod + "/streams"}, "projectors are plain packages tested against PostgreSQL alone (streams/projection and subjects are allowed)"},
		{mod + "/services/bes/redact", []string{"github.com/nats-io/", mod + "/streams", "github.com/jackc/"}, "the redactor is a function of bytes that the edge and `builds scrub` share"},
		{mod + "/streams/projection", []string{"github.com/nats-io/"}, "the projector contract must not drag NATS into projectors"},
		{mod + "/streams/...", []string{mod + "/commitlog"}, "the commit log depends on the backbone, not the other way round"},
		{mod + "/commitlog/layout", []string{"github.com/nats-io/", mod + "/streams"}, "the commit log's objects in the bucket are bytes and keys that the compactor (a projector) and the commits edge share"},
		{mod + "/archive", []string{"github.com/nats-io/", mod + "/streams", mod + "/services", mod + "/projectors"}, "the archive's objects are bytes in the bucket that the archiver, verify and a replay share; it reads the stream through its Source"},
		{mod + "/console", []string{"github.com/nats-io/", mod + "/streams", mod + "/services"}, "the console reads the projections in PostgreSQL through their packages; it publishes nothing and needs no backbone"},
		{mod + "/agent", []string{mod + "/services", mod + "/projectors", mod + "/streams", mod + "/migrations", "github.com/jackc/"}, "the node agent runs on GPU nodes: it speaks the protocol in schemas and needs nothing of the control plane"},
		{mod + "/schemas/...", []string{mod + "/cmd", mod + "/streams", mod + "/services", mod + "/projectors", mod + "/internal", mod + "/loadtest", mod + "/migrations"}, "schemas is a leaf module outside programs import"},
	}
	for _, r := range rules {
		for _, dep := range depsOf(t, r.pkg) {
			if dep == mod+"/streams/projection" {
				continue
			}
			for _, f := range r.forbidden {
				if strings.HasPrefix(dep, f) {
					t.Errorf("%s depends on %s: %s", r.pkg, dep, r.why)
				}
			}
		}
	}
}

// TestSubjectsStandardOnly: subjects holds the names every side shares,
// projectors included, so it may not drag in anything but the standard
// library (NATS least of all).
func TestSubjectsStandardOnly(t *testing.T) {
	standardOnly(t, "github.com/millrace/millrace/subjects")
}

// TestSharedHelpersStandardOnly: the key table, the configuration rule,
// the retry pause and the test poll are used by every edge and every test
// package, the agent's included; they must not bring anything along.
func TestSharedHelpersStandardOnly(t *testing.T) {
	standardOnly(t, "github.com/millrace/millrace/internal/apikey")
	standardOnly(t, "github.com/millrace/millrace/internal/backoff")
	standardOnly(t, "github.com/millrace/millrace/internal/knob")
	standardOnly(t, "github.com/millrace/millrace/internal/poll")
}

func standardOnly(t *testing.T, pkg string) {
	t.Helper()
	out, err := exec.Command("go", "list", "-deps", "-f", "{{if not .Standard}}{{.ImportPath}}{{end}}", pkg).Output()
	if err != nil {
		t.Fatalf("go list -deps %s: %v", pkg, err)
	}
	for _, dep := range strings.Fields(string(out)) {
		if dep != pkg {
			t.Errorf("%s depends on %s: it imports nothing but the standard library", pkg, dep)
		}
	}
}

// TestProjectorsUseSubjects: the projectors that name subjects take them
// from subjects rather than keeping a copy, which the rules above allow.
func TestProjectorsUseSubjects(t *testing.T) {
	const mod = "github.com/millrace/millrace"
	for _, p := range []string{mod + "/projectors/placer", mod + "/projectors/fleet", mod + "/projectors/kafka"} {
		if !slices.Contains(depsOf(t, p), mod+"/subjects") {
			t.Errorf("%s does not import subjects", p)
		}
	}
}
