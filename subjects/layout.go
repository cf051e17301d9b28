package subjects

import (
	"strconv"
	"strings"
)

// BESLayout is how build events lie on the backbone (docs/design.md,
// "Partitions"). With one partition (the default, and every backbone made
// before partitions) one stream, BES, holds bes.<project>.<invocation>.
// With n > 1, stream BES_<p> holds partition p's builds as
// bes.<p>.<project>.<invocation>: one stream per partition, so that a
// partition's reader reads its stream whole (a consumer filter narrower
// than its stream read 1.57x slower, loadtest/results/partition-layout.json).
// A build's partition is BESPartition of its project and invocation, the
// hash nats-server's {{partition()}} mapping computes, so an account
// mapping and millrace agree where a build lives.
//
// Every process of one backbone must use the same layout: the edges
// publish by it and every reader finds a build's stream and subject by it.
// streams.CheckLayout refuses a process whose layout is not the one the
// backbone's streams were made with.
type BESLayout struct {
	// Partitions is how many partitions build events are spread over;
	// below 2 is the one-stream layout.
	Partitions int
}

// N is the number of partitions, at least 1.
func (l BESLayout) N() int { return max(l.Partitions, 1) }

// Partitioned reports whether the layout has more than one partition.
func (l BESLayout) Partitioned() bool { return l.N() > 1 }

// Partition is the partition of a build.
func (l BESLayout) Partition(project, invocation string) int {
	return BESPartition(l.N(), project, invocation)
}

// Subject is where the events of one build go.
func (l BESLayout) Subject(project, invocation string) string {
	if !l.Partitioned() {
		return BES(project, invocation)
	}
	return besPrefix + strconv.Itoa(l.Partition(project, invocation)) + "." + Token(project) + "." + Token(invocation)
}

// Stream names partition p's stream.
func (l BESLayout) Stream(p int) string {
	if !l.Partitioned() {
		return StreamBES
	}
	return StreamBES + "_" + strconv.Itoa(p)
}

// Streams names every partition's stream, in partition order.
func (l BESLayout) Streams() []string {
	out := make([]string, l.N())
	for p := range out {
		out[p] = l.Stream(p)
	}
	return out
}

// Filter is partition p's stream's subjects, and its readers' filter.
func (l BESLayout) Filter(p int) string {
	if !l.Partitioned() {
		return BESFilter
	}
	return besPrefix + strconv.Itoa(p) + ".>"
}

// StreamOf names the stream that holds a build.
func (l BESLayout) StreamOf(project, invocation string) string {
	return l.Stream(l.Partition(project, invocation))
}

// ProjectFilter is the filter of one project's subjects in partition p's
// stream.
func (l BESLayout) ProjectFilter(p int, project string) string {
	if !l.Partitioned() {
		return BESProjectFilter(project)
	}
	return besPrefix + strconv.Itoa(p) + "." + Token(project) + ".>"
}

// PartitionOf is the partition a subject of this layout is in: its second
// token when partitioned, 0 otherwise. ok is false when the subject is not
// a build's subject of this layout.
func (l BESLayout) PartitionOf(subject string) (int, bool) {
	_, _, p, ok := l.Parse(subject)
	return p, ok
}

// Parse returns the project, invocation and partition of a build's
// subject in this layout, decoded; ok is false for any other subject, a
// partition out of range among them.
func (l BESLayout) Parse(subject string) (project, invocation string, partition int, ok bool) {
	rest, found := strings.CutPrefix(subject, besPrefix)
	if !found {
		return "", "", 0, false
	}
	if l.Partitioned() {
		pt, r, found := strings.Cut(rest, ".")
		if !found {
			return "", "", 0, false
		}
		p, err := strconv.Atoi(pt)
		if err != nil || p < 0 || p >= l.N() || strconv.Itoa(p) != pt {
			return "", "", 0, false
		}
		partition, rest = p, r
	}
	pt, it, found := strings.Cut(rest, ".")
	if !found || strings.Contains(it, ".") {
		return "", "", 0, false
	}
	if project, ok = Untoken(pt); !ok {
		return "", "", 0, false
	}
	if invocation, ok = Untoken(it); !ok {
		return "", "", 0, false
	}
	if l.Partitioned() && l.Partition(project, invocation) != partition {
		return "", "", 0, false // a subject no edge of this layout writes
	}
	return project, invocation, partition, true
}

// Durable names partition p's durable consumer of a consumer named name:
// name itself in the one-stream layout, name_<p> otherwise (a durable's
// name may not hold a dot).
func (l BESLayout) Durable(name string, p int) string {
	if !l.Partitioned() {
		return name
	}
	return name + "_" + strconv.Itoa(p)
}
