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

// NamesIn lists millrace's streams with build events in layout l.
func NamesIn(l subjects.BESLayout) []string {
	var out []string
	for _, s := range StreamSpecs(Config{BESPartitions: l.Partitions}) {
		out = append(out, s.Name)
	}
	return out
}

// StreamsOf names the streams of layout l that hold the subjects filter
// can match, each with filter narrowed to the subjects it holds: one
// stream for any filter of one stream's subjects, or, for a filter of
// build events in a partitioned layout, each partition's stream whose
// subjects it meets (bes.> is bes.<p>.> in each). False: no stream, or
// no set of partitions, holds them all.
func StreamsOf(l subjects.BESLayout, filter string) (map[string]string, bool) {
	for _, s := range StreamSpecs(Config{BESPartitions: l.Partitions}) {
		for _, pattern := range s.Subjects {
			if subjects.Within(filter, pattern) {
				return map[string]string{s.Name: filter}, true
			}
		}
	}
	if !l.Partitioned() || !subjects.Within(filter, subjects.BESFilter) {
		return nil, false
	}
	out := map[string]string{}
	for p := range l.N() {
		if narrowed, ok := subjects.Intersect(filter, l.Filter(p)); ok {
			out[l.Stream(p)] = narrowed
		}
	}
	return out, len(out) > 0
}

// StreamOf names the stream that holds every subject filter can match
// (false: none does, or the filter spans several), in the one-stream
// layout of build events (StreamsOf for any).
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
