package subjects_test

import (
	"strings"
	"testing"

	"github.com/millrace/millrace/subjects"
)

func TestMatch(t *testing.T) {
	for _, c := range []struct {
		pattern, subject string
		want             bool
	}{
		{"bes.p.inv", "bes.p.inv", true},
		{"bes.p.inv", "bes.p.other", false},
		{"bes.p", "bes.p.inv", false},
		{"bes.p.inv", "bes.p", false},
		{"bes.*.inv", "bes.p.inv", true},
		{"bes.*.inv", "bes.p.q.inv", false}, // '*' is one token
		{"bes.*", "bes", false},
		{"*", "bes", true},
		{"*", "bes.p", false},
		{"bes.>", "bes.p", true},
		{"bes.>", "bes.p.inv.x", true},
		{"bes.>", "bes", false}, // '>' is one or more
		{">", "bes", true},
		{">", "a.b.c", true},
		{">", "", false},
		{"bes.*.>", "bes.p", false},
		{"bes.*.>", "bes.p.inv", true},
		{"bes.>", "besx.p", false},
		{"bes", "bes2", false},
		{"commits.*.x", "commits.w.x", true},
		{"commits.*.x", "commits.w.x.y", false},
		{"commits.*.x", "commits.w", false},
	} {
		if got := subjects.Match(c.pattern, c.subject); got != c.want {
			t.Errorf("Match(%q, %q) = %v, want %v", c.pattern, c.subject, got, c.want)
		}
	}
}

func TestCheckPattern(t *testing.T) {
	for _, p := range []string{"bes.>", ">", "*", "bes.*.x", "commits.w.>", "a-b_c.%2E.*"} {
		if err := subjects.CheckPattern(p); err != nil {
			t.Errorf("CheckPattern(%q) = %v", p, err)
		}
	}
	for _, p := range []string{"", ".", "bes.", ".bes", "bes..x", "bes.>.x", ">.x", "bes.a*", "bes.>x", "bes.a b", "bes.\tx", "bes.**"} {
		if err := subjects.CheckPattern(p); err == nil {
			t.Errorf("CheckPattern(%q) accepted", p)
		}
	}
}

func TestWithin(t *testing.T) {
	for _, c := range []struct {
		f, p string
		want bool
	}{
		{"a.b", "a.*", true}, {"a.*", "a.b", false}, {"a.b.c", "a.>", true}, {"a", "a.>", false},
		{"a.>", "a.*", false}, {"a.*", "a.*", true}, {"a.b", "a.b", true}, {"a.b.c", "a.*", false},
	} {
		if got := subjects.Within(c.f, c.p); got != c.want {
			t.Errorf("Within(%q, %q) = %v", c.f, c.p, got)
		}
	}
}

func TestOverlap(t *testing.T) {
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
		if got := subjects.Overlap(c.a, c.b); got != c.want {
			t.Errorf("Overlap(%q, %q) = %v", c.a, c.b, got)
		}
		if got := subjects.Overlap(c.b, c.a); got != c.want {
			t.Errorf("Overlap(%q, %q) = %v", c.b, c.a, got)
		}
	}
}

// literal reports whether s is a subject a message can have: non-empty
// tokens without wildcards or spaces.
func literal(s string) bool {
	for _, t := range strings.Split(s, ".") {
		if t == "" || t == "*" || t == ">" || strings.ContainsAny(t, " \t\r\n*>") {
			return false
		}
	}
	return true
}

// FuzzMatch: the three readings of a pattern agree on a literal subject
// (a subject is its own one-subject pattern): Match, Within and Overlap
// must give the same answer, and none of them panics on any input.
func FuzzMatch(f *testing.F) {
	for _, s := range [][2]string{
		{"bes.>", "bes.p.inv"}, {"bes.*", "bes.p"}, {">", "a"}, {"*.*", "a.b"}, {"a.*.>", "a.b"},
		{"commits.w.>", "commits.w.d"}, {"a", "a.b"}, {"", ""}, {"a..b", "a.x.b"}, {".", "a"},
	} {
		f.Add(s[0], s[1])
	}
	f.Fuzz(func(t *testing.T, pattern, subject string) {
		m := subjects.Match(pattern, subject)
		w := subjects.Within(subject, pattern)
		o := subjects.Overlap(pattern, subject)
		if subjects.CheckPattern(pattern) != nil || !literal(subject) {
			return
		}
		if m != w || m != o {
			t.Fatalf("pattern %q, subject %q: Match %v, Within %v, Overlap %v", pattern, subject, m, w, o)
		}
	})
}

func TestIntersect(t *testing.T) {
	for _, c := range []struct {
		a, b, want string
		ok         bool
	}{
		{"bes.>", "bes.2.>", "bes.2.>", true},
		{"bes.*.acme.>", "bes.2.>", "bes.2.acme.>", true},
		{"bes.1.>", "bes.2.>", "", false},
		{"bes.*.*", "bes.2.>", "bes.2.*", true},
		{"a.b", "a.*", "a.b", true},
		{"a.b", "a.b.c", "", false},
		{">", "x.*", "x.*", true},
	} {
		got, ok := subjects.Intersect(c.a, c.b)
		if got != c.want || ok != c.ok {
			t.Errorf("subjects.Intersect(%q, %q) = %q, %v; want %q, %v", c.a, c.b, got, ok, c.want, c.ok)
		}
		if ok != subjects.Overlap(c.a, c.b) {
			t.Errorf("subjects.Intersect(%q, %q) says %v, Overlap says %v", c.a, c.b, ok, !ok)
		}
		if r, _ := subjects.Intersect(c.b, c.a); r != got {
			t.Errorf("subjects.Intersect(%q, %q) = %q, the other way %q", c.a, c.b, got, r)
		}
	}
}
