package builds

import (
	"errors"
	"fmt"
	"sync"

	"github.com/jackc/pgx/v5/pgconn"
)

// cache remembers what the tables hold of the invocations that recent
// batches wrote: what a batch's load would read of them (last_sequence,
// status, stream_done) and, for those whose row a batch it saw inserted,
// exactly which target and test rows they have. A batch then reads only
// the invocations and rows it does not know. At 1,000 paced streams a
// batch of 800 events names about 550 running invocations, nearly all
// written by the batches before it, and reading them and probing their
// target and test rows was a third of PostgreSQL's work
// (BenchmarkApplyPaced).
//
// It holds only what committed transactions wrote: the runner calls
// Committed after each transaction that committed and Aborted after one
// that did not and whenever it takes the lead (projection.Committer). A
// batch changes the cache as it writes; Aborted forgets everything, and so
// does a batch that finds the previous one never settled (a caller that is
// not the runner); a sweep drops the invocations it abandons, a reset
// everything. Only the projector's runner writes these rows and columns
// (builds scrub rewrites text columns the cache does not hold), so the
// cache cannot go stale while the runner leads; should it disagree with a
// row all the same, the batch's writes notice (errStale) and the runner
// retries the batch without it.
type cache struct {
	mu     sync.Mutex
	invs   map[invKey]*known
	labels int  // in the invocations' target and test sets
	dirty  bool // a batch wrote since the last Committed or Aborted

	// weeks are the partitions known to exist (partitions.go);
	// pendingWeeks those a batch made that has not committed yet.
	weeks        map[int32]bool
	pendingWeeks []int32
}

// Bounds of the cache. Past maxCached invocations it starts again empty;
// finished invocations leave it. An invocation whose labels would take the
// cache past maxLabels, or that has more than maxInvLabels of them, keeps
// no sets: its rows are probed, as without a cache. (About 100 bytes a
// label: a build of 60 targets at 1,000 streams takes 6 MB.) The cap per
// invocation keeps one build of a million events from filling the cache
// with its labels for its whole life; a batch of such a build names a few
// thousand rows, and probing them is one indexed query.
const (
	maxCached    = 100_000
	maxLabels    = 1 << 18
	maxInvLabels = 4096
)

// known is what the tables held of one invocation after the last batch
// that wrote it.
type known struct {
	seq      int64
	status   string
	done     bool
	buildKey int64
	// rows: the invocation's target and test rows are exactly these
	// labels (a batch the cache saw inserted its row, when it had none).
	rows           bool
	targets, tests map[string]bool
}

// begin returns the cache for a batch; when a batch wrote and nobody said
// whether its transaction committed, the cache forgets everything first.
func (c *cache) begin() *cache {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.dirty || len(c.invs) > maxCached {
		c.invs, c.labels, c.dirty = nil, 0, false
		c.pendingWeeks = nil
	}
	if c.invs == nil {
		c.invs = make(map[invKey]*known)
	}
	return c
}

// wrote marks the cache as changed by a transaction not yet settled.
func (c *cache) wrote() {
	c.mu.Lock()
	c.dirty = true
	c.mu.Unlock()
}

func (c *cache) committed() {
	c.mu.Lock()
	c.dirty = false
	if len(c.pendingWeeks) > 0 {
		if c.weeks == nil {
			c.weeks = make(map[int32]bool)
		}
		for _, w := range c.pendingWeeks {
			c.weeks[w] = true
		}
		c.pendingWeeks = nil
	}
	c.mu.Unlock()
}

func (c *cache) forget() {
	c.mu.Lock()
	c.invs, c.labels, c.dirty = nil, 0, false
	c.weeks, c.pendingWeeks = nil, nil
	c.mu.Unlock()
}

// dropAll forgets the invocations ks (whatever becomes of the transaction:
// forgetting is always safe).
func (c *cache) dropAll(ks []invKey) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, k := range ks {
		c.drop(k)
	}
}

// Committed keeps what the batches since the last call taught the cache
// (projection.Committer).
func (p *Projector) Committed() { p.cache.committed() }

// Aborted forgets the cache; the next batch reads its invocations from the
// tables (projection.Committer).
func (p *Projector) Aborted() { p.cache.forget() }

// errStale marks a batch whose writes found a row other than the cache
// said. It is no PostgreSQL error, so the runner counts it transient and
// retries the batch, after Aborted has emptied the cache.
var errStale = errors.New("builds: a row differs from what the cache of the last batches holds; retrying without it")

// stale turns a unique violation of a batch that trusted the cache for
// which rows exist into errStale (a permanent data error otherwise: the
// batch would be dead-lettered).
func stale(err error, trusted bool) error {
	var pe *pgconn.PgError
	if trusted && errors.As(err, &pe) && pe.Code == "23505" {
		return fmt.Errorf("%w (%v)", errStale, err)
	}
	return err
}

// recall takes what the cache knows of the batch's invocations, and which
// target and test rows exist for those whose rows it knows, so that load
// reads only the rest.
func (s *state) recall(c *cache) {
	s.cache = c
	for _, k := range s.ids {
		c := c.invs[k]
		if c == nil {
			continue
		}
		v := s.invs[k]
		v.stored, v.storedSeq, v.storedStatus, v.storedDone, v.recalled = true, c.seq, c.status, c.done, true
		v.buildKey = c.buildKey
		s.rowsKnown = s.rowsKnown || c.rows
	}
	if !s.rowsKnown {
		return
	}
	s.targetKeys = s.resolve(s.targetKeys, &s.targetExists, func(c *known) map[string]bool { return c.targets })
	s.testKeys = s.resolve(s.testKeys, &s.testExists, func(c *known) map[string]bool { return c.tests })
}

// resolve answers from the cache whether the rows of ks exist, for the
// invocations whose rows it knows, and returns the keys left to probe.
func (s *state) resolve(ks keys, exists *map[rowKey]bool, labels func(*known) map[string]bool) keys {
	var left keys
	*exists = make(map[rowKey]bool)
	for i := range ks.inv {
		k := invKey{ks.project[i], ks.inv[i]}
		if c := s.cache.invs[k]; c != nil && c.rows {
			if labels(c)[ks.label[i]] {
				(*exists)[rowKey{k, ks.label[i]}] = true
			}
			continue
		}
		left.add(k, ks.label[i])
	}
	return left
}

// remember records in the cache what the batch left in the tables: for
// each of its invocations, what write read back or what the batch itself
// set, and the target and test rows it inserted. A finished invocation
// leaves the cache: few events come after its end.
func (s *state) remember(after map[invKey]known) {
	if s.cache == nil {
		return
	}
	cached := s.cache.invs
	for _, k := range s.ids {
		v := s.invs[k]
		var c known
		switch r, ok := after[k]; {
		case ok:
			c = r
		case v.write && !v.progressOnly(): // not read back: unknown
			s.cache.drop(k)
			continue
		case v.stored: // unchanged but for the progress statement's columns
			c = known{seq: max(v.maxSeq, v.storedSeq), status: v.storedStatus, done: v.storedDone, buildKey: v.buildKey}
		default: // all its events were resends of nothing stored
			continue
		}
		prev := cached[k]
		switch {
		case !v.stored: // its row is the batch's: it had no target or test rows before
			c.rows = true
		case prev != nil && prev.rows:
			c.rows, c.targets, c.tests = true, prev.targets, prev.tests
		}
		if c.status != "running" && c.done {
			s.cache.drop(k)
			continue
		}
		if c.rows {
			c.rows = s.cache.addLabels(&c, v.newTargets, v.newTests)
		}
		cached[k] = &c
	}
}

// drop forgets invocation k.
func (c *cache) drop(k invKey) {
	if prev := c.invs[k]; prev != nil {
		c.labels -= len(prev.targets) + len(prev.tests)
		delete(c.invs, k)
	}
}

// addLabels adds the labels of new target and test rows to k's sets, or
// drops the sets when they would take the cache past maxLabels. It reports
// whether k keeps them.
func (c *cache) addLabels(k *known, targets, tests []string) bool {
	before := len(k.targets) + len(k.tests)
	if c.labels+len(targets)+len(tests) > maxLabels || before+len(targets)+len(tests) > maxInvLabels {
		c.labels -= before
		k.targets, k.tests = nil, nil
		return false
	}
	k.targets = addTo(k.targets, targets)
	k.tests = addTo(k.tests, tests)
	c.labels += len(k.targets) + len(k.tests) - before
	return true
}

func addTo(m map[string]bool, labels []string) map[string]bool {
	if m == nil {
		m = make(map[string]bool, len(labels))
	}
	for _, l := range labels {
		m[l] = true
	}
	return m
}
