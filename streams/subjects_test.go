package streams_test

import (
	"strings"
	"testing"

	"github.com/millrace/millrace/streams"
)

func TestToken(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"", "_"},
		{"_", "%5F"},
		{"__", "__"},
		{"proj", "proj"},
		{"5d1c9c1e-2a3b-4c5d-8e9f-000000000001", "5d1c9c1e-2a3b-4c5d-8e9f-000000000001"},
		{"a.b c", "a%2Eb%20c"},
		{"inv*x>", "inv%2Ax%3E"},
		{"100%", "100%25"},
		{"%41", "%2541"},
		{"é", "%C3%A9"},
		{"a\x00b", "a%00b"},
		{"\xff", "%FF"},
	} {
		if got := streams.Token(c.in); got != c.want {
			t.Errorf("Token(%q) = %q, want %q", c.in, got, c.want)
		}
		if got, ok := streams.Untoken(c.want); !ok || got != c.in {
			t.Errorf("Untoken(%q) = %q, %v, want %q", c.want, got, ok, c.in)
		}
	}
}

func TestUntokenRefuses(t *testing.T) {
	for _, tok := range []string{
		"%", "%4", "a%4", "%4G", "%g0", "%2e", // cut short, not hex, lower case
		"a.b", "a b", "*", ">", "a*", "x>y", "é",
	} {
		if s, ok := streams.Untoken(tok); ok {
			t.Errorf("Untoken(%q) = %q, true; want false", tok, s)
		}
	}
}

func TestBESSubject(t *testing.T) {
	if got := streams.BESSubject("a.b c", "inv*1"); got != "bes.a%2Eb%20c.inv%2A1" {
		t.Fatalf("BESSubject = %q", got)
	}
	if got := streams.BESSubject("", ""); got != "bes._._" {
		t.Fatalf("BESSubject of empty ids = %q", got)
	}
}

// safeToken reports whether tok can stand as one NATS subject token and
// holds nothing but what Token emits.
func safeToken(tok string) bool {
	if tok == "" {
		return false
	}
	for i := 0; i < len(tok); i++ {
		c := tok[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '%') {
			return false
		}
	}
	return true
}

func FuzzToken(f *testing.F) {
	for _, s := range []string{
		"", "_", "%", "%5F", "a.b c", "inv*>", "5d1c9c1e-2a3b-4c5d-8e9f-000000000001",
		"é", "\x00", "\xff\xfe", "a%2Eb", "..", "_._", strings.Repeat("%", 20),
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tok := streams.Token(s)
		if !safeToken(tok) {
			t.Fatalf("Token(%q) = %q is not a safe subject token", s, tok)
		}
		back, ok := streams.Untoken(tok)
		if !ok || back != s {
			t.Fatalf("Untoken(Token(%q)) = %q, %v", s, back, ok)
		}
		subject := streams.BESSubject(s, s)
		if toks := strings.Split(subject, "."); len(toks) != 3 || toks[0] != "bes" || toks[1] != tok || toks[2] != tok {
			t.Fatalf("BESSubject(%q, %q) = %q", s, s, subject)
		}

		// Untoken of anything: no panic, and what it accepts encodes again
		// to a safe token that decodes to the same string.
		if u, ok := streams.Untoken(s); ok {
			again := streams.Token(u)
			if !safeToken(again) {
				t.Fatalf("Token(Untoken(%q)) = %q is not safe", s, again)
			}
			if u2, ok := streams.Untoken(again); !ok || u2 != u {
				t.Fatalf("Untoken(Token(Untoken(%q))) = %q, %v, want %q", s, u2, ok, u)
			}
		}
	})
}

func TestUntokenRefusesNonCanonical(t *testing.T) {
	for _, tok := range []string{"%41", "a%2e", "%5F%5F"} {
		if s, ok := streams.Untoken(tok); ok {
			t.Errorf("Untoken(%q) = %q, ok; want refused (not how Token writes it)", tok, s)
		}
	}
}

func TestFleetSubjects(t *testing.T) {
	if got := streams.FleetNodeSubject("gpu.a", "n 1"); got != "fleet.node.gpu%2Ea.n%201" {
		t.Fatalf("FleetNodeSubject = %q", got)
	}
	for _, c := range []struct {
		subject, pool, node string
		ok                  bool
	}{
		{streams.FleetNodeSubject("gpu.a", "n 1"), "gpu.a", "n 1", true},
		{streams.FleetLivenessSubject("p*"), "p*", "", true},
		{streams.FleetResvSubject("p"), "p", "", true},
		{streams.FleetPlaceSubject(""), "", "", true},
		{"fleet.node.a.b.c", "", "", false},
		{"fleet.node.a%2e", "", "", false},
		{"fleet.other.a", "", "", false},
		{"bes.a.b", "", "", false},
	} {
		pool, node, ok := streams.FleetSubjectPool(c.subject)
		if ok != c.ok || pool != c.pool || node != c.node {
			t.Errorf("FleetSubjectPool(%q) = %q, %q, %v; want %q, %q, %v", c.subject, pool, node, ok, c.pool, c.node, c.ok)
		}
	}
}

func TestCommitsSubject(t *testing.T) {
	for _, c := range []struct{ world, doc, want string }{
		{"w1", "doc-1", "commits.w1.doc-1"},
		{"w", "a/b.c", "commits.w.a%2Fb%2Ec"},
		{"w", "", "commits.w._"},
		{"é", "ドキュメント", "commits.%C3%A9.%E3%83%89%E3%82%AD%E3%83%A5%E3%83%A1%E3%83%B3%E3%83%88"},
		{"w", "*>", "commits.w.%2A%3E"},
	} {
		got := streams.CommitsSubject(c.world, c.doc)
		if got != c.want {
			t.Errorf("CommitsSubject(%q, %q) = %q, want %q", c.world, c.doc, got, c.want)
		}
		if w, d, ok := streams.CommitsSubjectDoc(got); !ok || w != c.world || d != c.doc {
			t.Errorf("CommitsSubjectDoc(%q) = %q, %q, %v", got, w, d, ok)
		}
		if !strings.HasPrefix(got, strings.TrimSuffix(streams.CommitsWorldFilter(c.world), ">")) {
			t.Errorf("%q is not under %q", got, streams.CommitsWorldFilter(c.world))
		}
	}
	for _, s := range []string{"commits.w", "commits.w.a.b", "bes.w.a", "commits.%41.a", "commits.w.%4"} {
		if w, d, ok := streams.CommitsSubjectDoc(s); ok {
			t.Errorf("CommitsSubjectDoc(%q) = %q, %q, true; want false", s, w, d)
		}
	}
}
