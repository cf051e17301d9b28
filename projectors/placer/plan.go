package placer

import (
	"cmp"
	"fmt"
	"math"
	"slices"
	"strings"
)

// allocPlan is one node of a plan: the GPUs it books there.
type allocPlan struct {
	n     *node
	gpus  []int32
	whole bool
}

// plan is what the planner chose for one pending reservation; its GPUs are
// booked in the index (tentatively, until the commit guards accept it).
type plan struct {
	e      *entry
	allocs []allocPlan
}

// planAll plans the pending reservations todo in order against the index,
// booking what it plans. Reservations whose spec can never be placed are
// returned apart.
func (p *Placer) planAll(todo []*entry) (plans []*plan, invalid []*entry) {
	// What did not fit stays unfit for the rest of the round (capacity only
	// shrinks while planning): the smallest amount that failed, per
	// constraints and kind.
	failed := map[string]int{}
	for _, e := range todo {
		if !e.queued {
			continue
		}
		if e.spec.invalid() != "" {
			invalid = append(invalid, e)
			continue
		}
		avoid := e.avoid
		e.avoid = nil // honoured for one attempt only
		pi := p.idx.pools[e.pool]
		if pi == nil {
			continue
		}
		amount := max(e.spec.gpus, e.spec.nodes)
		if len(avoid) == 0 {
			if m, ok := failed[e.key]; ok && amount >= m {
				continue
			}
		}
		allocs := p.idx.place(pi, &e.spec, avoid)
		if allocs == nil && len(avoid) > 0 {
			// Nowhere else: back where it was rather than wait.
			avoid = nil
			allocs = p.idx.place(pi, &e.spec, nil)
		}
		if allocs == nil {
			if m, ok := failed[e.key]; len(avoid) == 0 && (!ok || amount < m) {
				failed[e.key] = amount
			}
			continue
		}
		plans = append(plans, &plan{e: e, allocs: allocs})
	}
	return plans, invalid
}

// place books what s asks for, or returns nil.
func (x *index) place(pi *poolIndex, s *spec, avoid map[string]bool) []allocPlan {
	if s.nodes > 0 {
		return x.placeNodes(pi, s, s.nodes, avoid)
	}
	if a := x.placeGPUs(pi, s, s.gpus, avoid); a != nil {
		return []allocPlan{*a}
	}
	return nil
}

// candidates are the nodes a scan looks at: those carrying the spec's
// rarest label, or every node of the pool.
func (pi *poolIndex) candidates(s *spec) func(yield func(*node) bool) {
	var set map[*node]struct{}
	if len(s.labels) > 0 {
		for k, v := range s.labels {
			l := pi.byLabel[labelKey(k, v)]
			if set == nil || len(l) < len(set) {
				set = l
			}
			if len(set) == 0 {
				return func(func(*node) bool) {}
			}
		}
		return func(yield func(*node) bool) {
			for n := range set {
				if !yield(n) {
					return
				}
			}
		}
	}
	return func(yield func(*node) bool) {
		for _, n := range pi.nodes {
			if !yield(n) {
				return
			}
		}
	}
}

// placeGPUs books k GPUs on one node by best fit: of the nodes with at
// least k free matching GPUs, the one with the fewest (ties: the lowest
// node id), and there its lowest-indexed matching GPUs. Nil when no node
// has room.
func (x *index) placeGPUs(pi *poolIndex, s *spec, k int, avoid map[string]bool) *allocPlan {
	var best *node
	bestF := math.MaxInt
	consider := func(n *node, f int) {
		if f >= k && (f < bestF || f == bestF && n.id < best.id) {
			best, bestF = n, f
		}
	}
	if len(s.labels) == 0 && len(avoid) == 0 {
		for _, c := range pi.classList {
			if c.ngpu < k || !c.matches(s) {
				continue
			}
			for f := k; f <= c.ngpu && f <= bestF; f++ {
				if h := c.buckets[f]; len(h) > 0 {
					consider(h[0], f)
					break
				}
			}
		}
		for _, n := range pi.mixed {
			consider(n, n.matchingFree(s))
		}
	} else {
		for n := range pi.candidates(s) {
			if n.placeable() && !avoid[n.id] && n.labelsMatch(s) {
				consider(n, n.matchingFree(s))
			}
		}
	}
	if best == nil {
		return nil
	}
	gpus := best.pick(s, k)
	x.book(best, gpus)
	return &allocPlan{n: best, gpus: gpus}
}

// placeNodes books count whole nodes whose every GPU is free and matches:
// those with the fewest GPUs first, then by node id. Nil when there are
// not enough.
func (x *index) placeNodes(pi *poolIndex, s *spec, count int, avoid map[string]bool) []allocPlan {
	better := func(n, best *node) bool {
		return best == nil || len(n.gpus) < len(best.gpus) || len(n.gpus) == len(best.gpus) && n.id < best.id
	}
	var out []allocPlan
	if len(s.labels) == 0 && len(avoid) == 0 {
		for len(out) < count {
			var best *node
			for _, c := range pi.classList {
				if !c.matches(s) {
					continue
				}
				if h := c.buckets[c.ngpu]; len(h) > 0 && better(h[0], best) {
					best = h[0]
				}
			}
			for _, n := range pi.mixed {
				if n.wholeFree(s) && better(n, best) {
					best = n
				}
			}
			if best == nil {
				break
			}
			gpus := best.allGPUs()
			x.book(best, gpus)
			out = append(out, allocPlan{n: best, gpus: gpus, whole: true})
		}
		if len(out) < count {
			for _, a := range out {
				x.unbook(a.n, a.gpus)
			}
			return nil
		}
		return out
	}
	var found []*node
	for n := range pi.candidates(s) {
		if n.placeable() && !avoid[n.id] && n.labelsMatch(s) && n.wholeFree(s) {
			found = append(found, n)
		}
	}
	if len(found) < count {
		return nil
	}
	slices.SortFunc(found, func(a, b *node) int {
		return cmp.Or(cmp.Compare(len(a.gpus), len(b.gpus)), strings.Compare(a.id, b.id))
	})
	for _, n := range found[:count] {
		gpus := n.allGPUs()
		x.book(n, gpus)
		out = append(out, allocPlan{n: n, gpus: gpus, whole: true})
	}
	return out
}

// noCapacity says why a reservation found no room, for its Failed reason.
func (x *index) noCapacity(pool string, s *spec) string {
	pi := x.pools[pool]
	fits := 0
	if pi != nil {
		for n := range pi.candidates(s) {
			if !n.labelsMatch(s) || len(n.gpus) == 0 {
				continue
			}
			m := 0
			for i := range n.gpus {
				d := n.gpus[i]
				d.ok = true
				if gpuMatches(&d, s) {
					m++
				}
			}
			if s.nodes > 0 && m == len(n.gpus) || s.nodes == 0 && m >= s.gpus {
				fits++
			}
		}
	}
	need := 1
	if s.nodes > 0 {
		need = s.nodes
	}
	if fits < need {
		return fmt.Sprintf("no capacity: pool %q has no nodes that can hold %s", pool, s.describe())
	}
	return fmt.Sprintf("no capacity: pool %q has %d nodes that could hold %s, not enough of them healthy and free", pool, fits, s.describe())
}
