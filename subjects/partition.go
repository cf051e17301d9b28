package subjects

import (
	"fmt"
	"hash/fnv"
)

// Partitions (docs/design.md, "Planned": one stream per partition).
//
// A partition is a deterministic hash of subject tokens, the very one
// nats-server computes for the subject mapping function
// {{partition(n,i,...)}}: FNV-1a (32 bits) of the chosen tokens written
// one after the other, modulo n. So a subject mapping on the server and a
// process of millrace (a projector instance that must know which
// invocations are its own, a tool that reads one partition) agree on
// where each entity lives. The tokens are the subject's, as Token escapes
// them.

// Partition is the partition, 0..n-1, of the entity whose subject tokens
// are tokens (for a build: the escaped project and invocation). n below 1
// is taken as 1.
func Partition(n int, tokens ...string) int {
	if n <= 1 {
		return 0
	}
	h := fnv.New32a()
	for _, t := range tokens {
		h.Write([]byte(t))
	}
	return int(h.Sum32() % uint32(n))
}

// BESPartition is the partition of a build's subject bes.<project>.<invocation>.
func BESPartition(n int, project, invocation string) int {
	return Partition(n, Token(project), Token(invocation))
}

// BESPartitionMapping is the destination of a subject mapping of
// bes.*.* that puts a build's partition of n as the subject's second
// token: bes.<partition>.<project>.<invocation>.
func BESPartitionMapping(n int) string {
	return fmt.Sprintf("bes.{{partition(%d,1,2)}}.{{wildcard(1)}}.{{wildcard(2)}}", n)
}
