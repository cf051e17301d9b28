package streams

import (
	"strings"
)

// Names lists millrace's streams.
func Names() []string {
	var out []string
	for _, s := range StreamSpecs(Config{}) {
		out = append(out, s.Name)
	}
	return out
}

// StreamOf names the stream that holds every subject filter can match
// (false: none does, or the filter spans several).
func StreamOf(filter string) (string, bool) {
	for _, s := range StreamSpecs(Config{}) {
		for _, pattern := range s.Subjects {
			if subsetOf(filter, pattern) {
				return s.Name, true
			}
		}
	}
	return "", false
}

// subsetOf reports whether every subject filter matches also matches
// pattern (both NATS subject patterns).
func subsetOf(filter, pattern string) bool {
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

// overlaps reports whether some subject matches both patterns.
func overlaps(a, b string) bool {
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
