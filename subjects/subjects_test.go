package subjects_test

import (
	"strings"
	"testing"

	"github.com/millrace/millrace/subjects"
)

func TestBES(t *testing.T) {
	if got := subjects.BES("a.b c", "inv*1"); got != "bes.a%2Eb%20c.inv%2A1" {
		t.Fatalf("BES = %q", got)
	}
	if got := subjects.BES("", ""); got != "bes._._" {
		t.Fatalf("BES of empty ids = %q", got)
	}
}

func TestFleetSubjects(t *testing.T) {
	if got := subjects.FleetNode("gpu.a", "n 1"); got != "fleet.node.gpu%2Ea.n%201" {
		t.Fatalf("FleetNode = %q", got)
	}
	for _, c := range []struct {
		subject, pool, node string
		ok                  bool
	}{
		{subjects.FleetNode("gpu.a", "n 1"), "gpu.a", "n 1", true},
		{subjects.FleetLiveness("p*"), "p*", "", true},
		{subjects.FleetResv("p"), "p", "", true},
		{subjects.FleetPlace(""), "", "", true},
		{"fleet.node.a.b.c", "", "", false},
		{"fleet.node.a%2e", "", "", false},
		{"fleet.other.a", "", "", false},
		{"bes.a.b", "", "", false},
	} {
		pool, node, ok := subjects.ParseFleet(c.subject)
		if ok != c.ok || pool != c.pool || node != c.node {
			t.Errorf("ParseFleet(%q) = %q, %q, %v; want %q, %q, %v", c.subject, pool, node, ok, c.pool, c.node, c.ok)
		}
	}
}

func TestCommits(t *testing.T) {
	for _, c := range []struct{ world, doc, want string }{
		{"w1", "doc-1", "commits.w1.doc-1"},
		{"w", "a/b.c", "commits.w.a%2Fb%2Ec"},
		{"w", "", "commits.w._"},
		{"é", "ドキュメント", "commits.%C3%A9.%E3%83%89%E3%82%AD%E3%83%A5%E3%83%A1%E3%83%B3%E3%83%88"},
		{"w", "*>", "commits.w.%2A%3E"},
	} {
		got := subjects.Commits(c.world, c.doc)
		if got != c.want {
			t.Errorf("Commits(%q, %q) = %q, want %q", c.world, c.doc, got, c.want)
		}
		if w, d, ok := subjects.ParseCommits(got); !ok || w != c.world || d != c.doc {
			t.Errorf("ParseCommits(%q) = %q, %q, %v", got, w, d, ok)
		}
		if !strings.HasPrefix(got, strings.TrimSuffix(subjects.CommitsWorldFilter(c.world), ">")) {
			t.Errorf("%q is not under %q", got, subjects.CommitsWorldFilter(c.world))
		}
	}
	for _, s := range []string{"commits.w", "commits.w.a.b", "bes.w.a", "commits.%41.a", "commits.w.%4"} {
		if w, d, ok := subjects.ParseCommits(s); ok {
			t.Errorf("ParseCommits(%q) = %q, %q, true; want false", s, w, d)
		}
	}
}

func TestFleetPlace(t *testing.T) {
	for pool, want := range map[string]string{
		"":          "fleet.place._",
		"_":         "fleet.place.%5F",
		"a-b_c9":    "fleet.place.a-b_c9",
		"a.b*c>d e": "fleet.place.a%2Eb%2Ac%3Ed%20e",
		"50%":       "fleet.place.50%25",
		"é":         "fleet.place.%C3%A9",
	} {
		if got := subjects.FleetPlace(pool); got != want {
			t.Errorf("FleetPlace(%q) = %q, want %q", pool, got, want)
		}
	}
}

// TestFamilies: every subject a builder makes falls under its family's
// filter and under no other's, so that it lands in its stream alone.
func TestFamilies(t *testing.T) {
	id := "a.b*>c"
	filters := []string{subjects.BESFilter, subjects.DeadFilter, subjects.FleetNodeFilter,
		subjects.FleetResvFilter, subjects.FleetPlaceFilter, subjects.CommitsFilter}
	for _, c := range []struct{ subject, filter string }{
		{subjects.BES(id, id), subjects.BESFilter},
		{subjects.BES(id, id), subjects.BESProjectFilter(id)},
		{subjects.Dead(id), subjects.DeadFilter},
		{subjects.FleetNode(id, id), subjects.FleetNodeFilter},
		{subjects.FleetLiveness(id), subjects.FleetNodeFilter},
		{subjects.FleetResv(id), subjects.FleetResvFilter},
		{subjects.FleetPlace(id), subjects.FleetPlaceFilter},
		{subjects.Commits(id, id), subjects.CommitsFilter},
		{subjects.Commits(id, id), subjects.CommitsWorldFilter(id)},
	} {
		if !subjects.Match(c.filter, c.subject) {
			t.Errorf("%q does not match %q", c.subject, c.filter)
		}
		for _, f := range filters {
			if f != c.filter && subjects.Match(f, c.subject) && !subjects.Within(c.filter, f) {
				t.Errorf("%q also matches %q", c.subject, f)
			}
		}
	}
	if subjects.Match(subjects.BESProjectFilter("a"), subjects.BES("a.b", "c")) {
		t.Error("project a's filter takes project a.b's subjects")
	}
}

// Partition is FNV-1a of the tokens modulo n, 0 for fewer than two
// partitions, and the same for the same tokens.
func TestPartition(t *testing.T) {
	if p := subjects.Partition(0, "a"); p != 0 {
		t.Errorf("Partition(0) = %d", p)
	}
	if p := subjects.Partition(1, "a", "b"); p != 0 {
		t.Errorf("Partition(1) = %d", p)
	}
	// fnv32a("ab") = 0x4d2505ca; mod 7 = 1294271946 % 7.
	if p, want := subjects.Partition(7, "a", "b"), int(uint32(0x4d2505ca)%7); p != want {
		t.Errorf("Partition(7, a, b) = %d, want %d", p, want)
	}
	if subjects.BESPartition(16, "p", "inv") != subjects.BESPartition(16, "p", "inv") {
		t.Error("not deterministic")
	}
}
