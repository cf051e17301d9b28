package subjects_test

import (
	"strings"
	"testing"

	"github.com/millrace/millrace/subjects"
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
		if got := subjects.Token(c.in); got != c.want {
			t.Errorf("Token(%q) = %q, want %q", c.in, got, c.want)
		}
		if got, ok := subjects.Untoken(c.want); !ok || got != c.in {
			t.Errorf("Untoken(%q) = %q, %v, want %q", c.want, got, ok, c.in)
		}
	}
}

func TestUntokenRefuses(t *testing.T) {
	for _, tok := range []string{
		"%", "%4", "a%4", "%4G", "%g0", "%2e", // cut short, not hex, lower case
		"a.b", "a b", "*", ">", "a*", "x>y", "é",
	} {
		if s, ok := subjects.Untoken(tok); ok {
			t.Errorf("Untoken(%q) = %q, true; want false", tok, s)
		}
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
		tok := subjects.Token(s)
		if !safeToken(tok) {
			t.Fatalf("Token(%q) = %q is not a safe subject token", s, tok)
		}
		back, ok := subjects.Untoken(tok)
		if !ok || back != s {
			t.Fatalf("Untoken(Token(%q)) = %q, %v", s, back, ok)
		}
		subject := subjects.BES(s, s)
		if toks := strings.Split(subject, "."); len(toks) != 3 || toks[0] != "bes" || toks[1] != tok || toks[2] != tok {
			t.Fatalf("BES(%q, %q) = %q", s, s, subject)
		}

		// Untoken of anything: no panic, and what it accepts encodes again
		// to a safe token that decodes to the same string.
		if u, ok := subjects.Untoken(s); ok {
			again := subjects.Token(u)
			if !safeToken(again) {
				t.Fatalf("Token(Untoken(%q)) = %q is not safe", s, again)
			}
			if u2, ok := subjects.Untoken(again); !ok || u2 != u {
				t.Fatalf("Untoken(Token(Untoken(%q))) = %q, %v, want %q", s, u2, ok, u)
			}
		}
	})
}

func TestUntokenRefusesNonCanonical(t *testing.T) {
	for _, tok := range []string{"%41", "a%2e", "%5F%5F"} {
		if s, ok := subjects.Untoken(tok); ok {
			t.Errorf("Untoken(%q) = %q, ok; want refused (not how Token writes it)", tok, s)
		}
	}
}
