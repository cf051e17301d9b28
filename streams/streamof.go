package streams

import "github.com/millrace/millrace/subjects"

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
			if subjects.Within(filter, pattern) {
				return s.Name, true
			}
		}
	}
	return "", false
}
