package streams

import "testing"

func TestStreamOf(t *testing.T) {
	for _, c := range []struct {
		filter, stream string
	}{
		{"bes.>", StreamBES},
		{"bes.p.*", StreamBES},
		{"fleet.place.>", StreamFleetPlace},
		{"fleet.node.pool.*", StreamFleetNodes},
		{"commits.w.>", StreamCommits},
		{"fleet.>", ""}, // three streams
		{">", ""},
		{"bes", ""},
		{"nope.>", ""},
	} {
		got, ok := StreamOf(c.filter)
		if got != c.stream || ok != (c.stream != "") {
			t.Errorf("StreamOf(%q) = %q, %v; want %q", c.filter, got, ok, c.stream)
		}
	}
	for _, c := range []struct {
		f, p string
		want bool
	}{
		{"a.b", "a.*", true}, {"a.*", "a.b", false}, {"a.b.c", "a.>", true}, {"a", "a.>", false},
		{"a.>", "a.*", false}, {"a.*", "a.*", true}, {"a.b", "a.b", true}, {"a.b.c", "a.*", false},
	} {
		if got := subsetOf(c.f, c.p); got != c.want {
			t.Errorf("subsetOf(%q, %q) = %v", c.f, c.p, got)
		}
	}
}

func TestOverlaps(t *testing.T) {
	for _, c := range []struct {
		a, b string
		want bool
	}{
		{"commits.>", "commits.w.>", true},
		{"commits.w.>", "commits.v.>", false},
		{"commits.*.x", "commits.w.>", true},
		{"commits.w.x", "commits.w.>", true},
		{"commits.w", "commits.w.>", false},
		{"bes.>", "commits.w.>", false},
		{">", "commits.w.>", true},
		{"a.*", "a.b", true},
		{"a.*", "a.b.c", false},
	} {
		if got := overlaps(c.a, c.b); got != c.want {
			t.Errorf("overlaps(%q, %q) = %v", c.a, c.b, got)
		}
		if got := overlaps(c.b, c.a); got != c.want {
			t.Errorf("overlaps(%q, %q) = %v", c.b, c.a, got)
		}
	}
}
