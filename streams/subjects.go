package streams

import (
	"strings"
)

// Stream names. One stream per subject family, so that every consumer's
// filter equals its stream's subjects: a narrower filter over a mixed stream
// measured 3-4x slower here (docs/design.md, "Measured facts").
const (
	StreamBES        = "BES"
	StreamDead       = "DEAD"
	StreamFleetNodes = "FLEET_NODES"
	StreamFleetResv  = "FLEET_RESV"
	StreamFleetPlace = "FLEET_PLACE"
	StreamCommits    = "COMMITS"
)

// Subject prefixes.
const (
	besPrefix  = "bes."
	deadPrefix = "dead."
)

// BESSubjects is the filter of the BES stream and of its consumers.
const BESSubjects = "bes.>"

// Filters of the fleet streams and of their consumers.
const (
	FleetNodeSubjects  = "fleet.node.>"
	FleetResvSubjects  = "fleet.resv.>"
	FleetPlaceSubjects = "fleet.place.>"
)

const (
	fleetNodePrefix  = "fleet.node."
	fleetResvPrefix  = "fleet.resv."
	fleetPlacePrefix = "fleet.place."
)

// FleetNodeSubject is where a gateway publishes one node's transitions
// (connected, disconnected, status changed, allocation reports):
// fleet.node.<pool>.<node>.
func FleetNodeSubject(pool, node string) string {
	return fleetNodePrefix + Token(pool) + "." + Token(node)
}

// FleetLivenessSubject is where a gateway publishes the heartbeat ages of
// one pool's nodes in batches: fleet.node.<pool> (one token shorter than a
// node's subject, in the same stream).
func FleetLivenessSubject(pool string) string { return fleetNodePrefix + Token(pool) }

// FleetResvSubject is where reservation requests and cancellations of one
// pool go: fleet.resv.<pool>.
func FleetResvSubject(pool string) string { return fleetResvPrefix + Token(pool) }

// FleetPlaceSubject is where the placer publishes one pool's placement
// decisions: fleet.place.<pool>.
func FleetPlaceSubject(pool string) string { return fleetPlacePrefix + Token(pool) }

// FleetSubjectPool returns the pool token of a fleet.node, fleet.resv or
// fleet.place subject, decoded, and the node when the subject names one.
func FleetSubjectPool(subject string) (pool, node string, ok bool) {
	var rest string
	switch {
	case strings.HasPrefix(subject, fleetNodePrefix):
		rest = subject[len(fleetNodePrefix):]
	case strings.HasPrefix(subject, fleetResvPrefix):
		rest = subject[len(fleetResvPrefix):]
	case strings.HasPrefix(subject, fleetPlacePrefix):
		rest = subject[len(fleetPlacePrefix):]
	default:
		return "", "", false
	}
	pt, nt, hasNode := strings.Cut(rest, ".")
	if pool, ok = Untoken(pt); !ok {
		return "", "", false
	}
	if hasNode {
		if strings.Contains(nt, ".") {
			return "", "", false
		}
		if node, ok = Untoken(nt); !ok {
			return "", "", false
		}
	}
	return pool, node, true
}

// CommitsSubjects is the filter of the COMMITS stream and of its consumers.
const CommitsSubjects = "commits.>"

const commitsPrefix = "commits."

// CommitsSubject is where the versions of one document of one world go:
// commits.<world>.<doc>, both tokens encoded with Token. Compare-and-set
// on a document is JetStream's expected last sequence of this subject.
func CommitsSubject(world, doc string) string {
	return commitsPrefix + Token(world) + "." + Token(doc)
}

// CommitsWorldFilter is the filter of every document of one world:
// commits.<world>.>.
func CommitsWorldFilter(world string) string { return commitsPrefix + Token(world) + ".>" }

// CommitsSubjectDoc returns the world and document a commits subject
// names, decoded; ok is false for any other subject.
func CommitsSubjectDoc(subject string) (world, doc string, ok bool) {
	rest, found := strings.CutPrefix(subject, commitsPrefix)
	if !found {
		return "", "", false
	}
	wt, dt, found := strings.Cut(rest, ".")
	if !found || strings.Contains(dt, ".") {
		return "", "", false
	}
	if world, ok = Untoken(wt); !ok {
		return "", "", false
	}
	if doc, ok = Untoken(dt); !ok {
		return "", "", false
	}
	return world, doc, true
}

// BESSubject is where the events of one BES stream go:
// bes.<project>.<invocation>, both tokens encoded with Token.
func BESSubject(project, invocation string) string {
	return besPrefix + Token(project) + "." + Token(invocation)
}

// BESProjectSubjects is the filter of every BES subject of one project:
// bes.<project>.>.
func BESProjectSubjects(project string) string { return besPrefix + Token(project) + ".>" }

// DeadSubject is where a consumer parks messages it cannot apply.
func DeadSubject(consumer string) string { return deadPrefix + Token(consumer) }

// Token encodes s so that it is one safe subject token: letters, digits,
// '-' and '_' stay as they are, every other byte (including '.', '*', '>',
// spaces and '%') becomes %XX. The empty string becomes "_" so that no
// subject has an empty token. Token is reversible with Untoken.
func Token(s string) string {
	switch s {
	case "":
		return "_"
	case "_":
		return "%5F" // "_" alone stands for the empty string
	}
	if isPlain(s) {
		return s
	}
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	b.Grow(len(s) + 8)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if plain(c) {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&15])
	}
	return b.String()
}

// Untoken reverses Token; ok is false when t is not the Token encoding of
// any string (including non-canonical escapes such as "%41" for "A", so
// that one id has exactly one subject).
func Untoken(t string) (s string, ok bool) {
	if t == "_" {
		return "", true
	}
	var b strings.Builder
	for i := 0; i < len(t); i++ {
		c := t[i]
		if c != '%' {
			b.WriteByte(c)
			continue
		}
		if i+2 >= len(t) {
			return "", false
		}
		hi, ok1 := unhex(t[i+1])
		lo, ok2 := unhex(t[i+2])
		if !ok1 || !ok2 {
			return "", false
		}
		b.WriteByte(hi<<4 | lo)
		i += 2
	}
	s = b.String()
	return s, Token(s) == t
}

func plain(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}

func isPlain(s string) bool {
	for i := 0; i < len(s); i++ {
		if !plain(s[i]) {
			return false
		}
	}
	return s != "_"
}

func unhex(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}
