package subjects

import (
	"fmt"
	"strings"
)

// NATS subject patterns: tokens separated by '.', where a token "*" matches
// any one token and a last token ">" matches one or more. The functions here
// follow the server's rules so that a route, an export or a filter chosen in
// millrace means what JetStream will make of it.

// CheckPattern reports what makes p no subject pattern: an empty token, a
// '>' that is not the last token, or a token holding a space or a wildcard
// among other characters.
func CheckPattern(p string) error {
	toks := strings.Split(p, ".")
	for i, t := range toks {
		switch {
		case t == "":
			return fmt.Errorf("subject pattern %q has an empty token", p)
		case t == ">" && i != len(toks)-1:
			return fmt.Errorf("subject pattern %q: '>' must be the last token", p)
		case strings.ContainsAny(t, " \t") || (len(t) > 1 && strings.ContainsAny(t, "*>")):
			return fmt.Errorf("subject pattern %q has a bad token %q", p, t)
		}
	}
	return nil
}

// Match reports whether subject (no wildcards) matches pattern.
func Match(pattern, subject string) bool {
	for {
		pt, prest, pmore := strings.Cut(pattern, ".")
		if pt == ">" {
			return subject != ""
		}
		st, srest, smore := strings.Cut(subject, ".")
		if pt != "*" && pt != st {
			return false
		}
		if !pmore || !smore {
			return pmore == smore
		}
		pattern, subject = prest, srest
	}
}

// Within reports whether every subject filter matches also matches pattern
// (both subject patterns): a consumer filtered on filter reads only from
// the stream whose subjects are pattern.
func Within(filter, pattern string) bool {
	f, p := strings.Split(filter, "."), strings.Split(pattern, ".")
	for i, pt := range p {
		if pt == ">" {
			return len(f) > i
		}
		if i >= len(f) {
			return false
		}
		switch ft := f[i]; {
		case ft == ">":
			return false // the filter reaches further than pattern's token
		case pt == "*":
		case ft == "*" || ft != pt:
			return false
		}
	}
	return len(f) == len(p)
}

// Intersect is the pattern of the subjects both patterns match; false
// when none does.
func Intersect(a, b string) (string, bool) {
	at, bt := strings.Split(a, "."), strings.Split(b, ".")
	out := make([]string, 0, max(len(at), len(bt)))
	for i := 0; ; i++ {
		switch {
		case i == len(at) || i == len(bt):
			if len(at) != len(bt) {
				return "", false
			}
			return strings.Join(out, "."), true
		case at[i] == ">":
			return strings.Join(append(out, bt[i:]...), "."), true
		case bt[i] == ">":
			return strings.Join(append(out, at[i:]...), "."), true
		case at[i] == "*":
			out = append(out, bt[i])
		case bt[i] == "*" || at[i] == bt[i]:
			out = append(out, at[i])
		default:
			return "", false
		}
	}
}

// Overlap reports whether some subject matches both patterns.
func Overlap(a, b string) bool {
	at, bt := strings.Split(a, "."), strings.Split(b, ".")
	for i := 0; ; i++ {
		switch {
		case i == len(at) || i == len(bt):
			return len(at) == len(bt)
		case at[i] == ">" || bt[i] == ">":
			return true
		case at[i] != "*" && bt[i] != "*" && at[i] != bt[i]:
			return false
		}
	}
}
