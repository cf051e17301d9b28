package streams

import (
	"testing"

	"github.com/millrace/millrace/subjects"
)

func TestStreamOf(t *testing.T) {
	for _, c := range []struct {
		filter, stream string
	}{
		{"bes.>", subjects.StreamBES},
		{"bes.p.*", subjects.StreamBES},
		{"fleet.place.>", subjects.StreamFleetPlace},
		{"fleet.node.pool.*", subjects.StreamFleetNodes},
		{"commits.w.>", subjects.StreamCommits},
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
}
