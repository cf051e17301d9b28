package subjects

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

// BESFilter is the filter of the BES stream and of its consumers.
const BESFilter = "bes.>"

// DeadFilter is the filter of the DEAD stream.
const DeadFilter = "dead.>"

// Filters of the fleet streams and of their consumers.
const (
	FleetNodeFilter  = "fleet.node.>"
	FleetResvFilter  = "fleet.resv.>"
	FleetPlaceFilter = "fleet.place.>"
)

const (
	fleetNodePrefix  = "fleet.node."
	fleetResvPrefix  = "fleet.resv."
	fleetPlacePrefix = "fleet.place."
)

// FleetNode is where a gateway publishes one node's transitions
// (connected, disconnected, status changed, allocation reports):
// fleet.node.<pool>.<node>.
func FleetNode(pool, node string) string {
	return fleetNodePrefix + Token(pool) + "." + Token(node)
}

// FleetLiveness is where a gateway publishes the heartbeat ages of
// one pool's nodes in batches: fleet.node.<pool> (one token shorter than a
// node's subject, in the same stream).
func FleetLiveness(pool string) string { return fleetNodePrefix + Token(pool) }

// FleetResv is where reservation requests and cancellations of one
// pool go: fleet.resv.<pool>.
func FleetResv(pool string) string { return fleetResvPrefix + Token(pool) }

// FleetPlace is where the placer publishes one pool's placement
// decisions: fleet.place.<pool>.
func FleetPlace(pool string) string { return fleetPlacePrefix + Token(pool) }

// ParseFleet returns the pool token of a fleet.node, fleet.resv or
// fleet.place subject, decoded, and the node when the subject names one.
func ParseFleet(subject string) (pool, node string, ok bool) {
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

// CommitsFilter is the filter of the COMMITS stream and of its consumers.
const CommitsFilter = "commits.>"

const commitsPrefix = "commits."

// Commits is where the versions of one document of one world go:
// commits.<world>.<doc>, both tokens encoded with Token. Compare-and-set
// on a document is JetStream's expected last sequence of this subject.
func Commits(world, doc string) string {
	return commitsPrefix + Token(world) + "." + Token(doc)
}

// CommitsWorldFilter is the filter of every document of one world:
// commits.<world>.>.
func CommitsWorldFilter(world string) string { return commitsPrefix + Token(world) + ".>" }

// ParseCommits returns the world and document a commits subject
// names, decoded; ok is false for any other subject.
func ParseCommits(subject string) (world, doc string, ok bool) {
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

// BES is where the events of one BES stream go:
// bes.<project>.<invocation>, both tokens encoded with Token.
func BES(project, invocation string) string {
	return besPrefix + Token(project) + "." + Token(invocation)
}

// BESProjectFilter is the filter of every BES subject of one project:
// bes.<project>.>.
func BESProjectFilter(project string) string { return besPrefix + Token(project) + ".>" }

// Dead is where a consumer parks messages it cannot apply.
func Dead(consumer string) string { return deadPrefix + Token(consumer) }
