package placer

import (
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
)

// The index is the planner's picture of the fleet: per pool, the nodes that
// can take work (healthy and connected, with GPUs), their healthy GPUs and
// which of them are booked. It is built from fleet_nodes, fleet_devices and
// fleet_bookings, refreshed by fleet_nodes.rev, and changed in place as the
// placer books and frees GPUs; whatever it believes, the commit guards
// decide (commit.go).
//
// Nodes whose GPUs all have one model and memory size are filed by class
// (model, memory, GPU count) in buckets by free GPU count, each bucket a
// heap by node id: best fit for k GPUs looks at the head of the first
// non-empty bucket >= k of each matching class. Other nodes (mixed GPUs)
// and requests with labels or nodes to avoid are served by a scan (of the
// nodes carrying the rarest requested label when there are labels).
type index struct {
	pools map[string]*poolIndex
	nodes map[nodeKey]*node // every node by (pool, id): ids are unique only within a pool

	// rev is the refresh watermark: every change of fleet_nodes with a rev
	// at or below it has been read. A change committed late (its rev was
	// drawn before others that committed first) is not lost: the
	// watermark only moves to the highest rev of an earlier read once
	// every transaction that was in progress at that read has ended
	// (candSnap, a pg_snapshot). Rows read again are skipped by their rev.
	rev      int64
	candRev  int64
	candSnap string
}

type device struct {
	index int32
	model string
	mem   uint64
	ok    bool
}

// nodeKey is a node's identity: its pool and id, as in its certificate and
// its subject. A node of the same id in another pool is another node; every
// map, lookup and SQL statement of the placer uses the pair.
type nodeKey struct{ pool, id string }

func compareKeys(a, b nodeKey) int {
	return cmp.Or(strings.Compare(a.pool, b.pool), strings.Compare(a.id, b.id))
}

// keyColumns splits keys into the two arrays that the SQL statements
// unnest as (pool, node_id).
func keyColumns(keys []nodeKey) (pools, ids []string) {
	pools, ids = make([]string, len(keys)), make([]string, len(keys))
	for i, k := range keys {
		pools[i], ids[i] = k.pool, k.id
	}
	return pools, ids
}

type node struct {
	id        string
	pool      string
	labels    map[string]string
	state     string
	connected bool
	rev       int64
	gpus      []device // by index
	booked    map[int32]struct{}
	free      int // healthy GPUs not booked
	// fences counts allocations freed while the node was unreachable that
	// it has not confirmed it dropped (fleet_fences): nothing new is
	// placed on it until they are none.
	fences int
	// heldAt is when the node last connected, listing what it holds
	// (fleet_nodes.held_at; zero: unknown): the lost-allocation repair
	// looks at a node once per such time.
	heldAt time.Time

	cls     *class // set while filed in a class bucket
	bucket  int
	heapIdx int
	inMixed bool
}

func (n *node) key() nodeKey { return nodeKey{n.pool, n.id} }

func (n *node) placeable() bool {
	return n.state == "healthy" && n.connected && n.fences == 0 && len(n.gpus) > 0
}

// fence changes the node's fence count by d.
func (x *index) fence(n *node, d int) {
	pi := x.pool(n.pool)
	pi.unfile(n)
	n.fences = max(n.fences+d, 0)
	pi.file(n)
}

func (n *node) isBooked(g int32) bool {
	_, ok := n.booked[g]
	return ok
}

func (n *node) recount() {
	n.free = 0
	for _, d := range n.gpus {
		if d.ok && !n.isBooked(d.index) {
			n.free++
		}
	}
}

// classKey is the class of a node whose GPUs are all alike.
type classKey struct {
	model string
	mem   uint64
	ngpu  int
}

func (n *node) classKey() (classKey, bool) {
	k := classKey{model: n.gpus[0].model, mem: n.gpus[0].mem, ngpu: len(n.gpus)}
	for _, d := range n.gpus[1:] {
		if d.model != k.model || d.mem != k.mem {
			return k, false
		}
	}
	return k, true
}

func (n *node) labelsMatch(s *spec) bool {
	for k, v := range s.labels {
		if got, ok := n.labels[k]; !ok || got != v {
			return false
		}
	}
	return true
}

func gpuMatches(d *device, s *spec) bool {
	return d.ok && (s.model == "" || d.model == s.model) && d.mem >= s.minMem
}

// matchingFree counts the free GPUs of n that match s.
func (n *node) matchingFree(s *spec) int {
	c := 0
	for i := range n.gpus {
		if gpuMatches(&n.gpus[i], s) && !n.isBooked(n.gpus[i].index) {
			c++
		}
	}
	return c
}

// wholeFree says whether every GPU of n is free and matches s.
func (n *node) wholeFree(s *spec) bool {
	for i := range n.gpus {
		if !gpuMatches(&n.gpus[i], s) || n.isBooked(n.gpus[i].index) {
			return false
		}
	}
	return len(n.gpus) > 0
}

// pick returns the k lowest-indexed free GPUs of n that match s.
func (n *node) pick(s *spec, k int) []int32 {
	out := make([]int32, 0, k)
	for i := range n.gpus {
		if len(out) == k {
			break
		}
		if gpuMatches(&n.gpus[i], s) && !n.isBooked(n.gpus[i].index) {
			out = append(out, n.gpus[i].index)
		}
	}
	return out
}

func (n *node) allGPUs() []int32 {
	out := make([]int32, len(n.gpus))
	for i, d := range n.gpus {
		out[i] = d.index
	}
	return out
}

type class struct {
	classKey
	buckets []nodeHeap // by free GPU count, 0..ngpu
}

func (c *class) matches(s *spec) bool {
	return (s.model == "" || c.model == s.model) && c.mem >= s.minMem
}

// poolIndex is one pool's nodes, keyed by id (unique within the pool).
type poolIndex struct {
	name      string
	nodes     map[string]*node
	classes   map[classKey]*class
	classList []*class // in key order, for a deterministic walk
	mixed     map[string]*node
	byLabel   map[string]map[*node]struct{} // "key\x00value" → nodes of the pool
}

func newIndex() *index {
	return &index{pools: map[string]*poolIndex{}, nodes: map[nodeKey]*node{}}
}

func (x *index) pool(name string) *poolIndex {
	pi := x.pools[name]
	if pi == nil {
		pi = &poolIndex{name: name, nodes: map[string]*node{}, classes: map[classKey]*class{},
			mixed: map[string]*node{}, byLabel: map[string]map[*node]struct{}{}}
		x.pools[name] = pi
	}
	return pi
}

func labelKey(k, v string) string { return k + "\x00" + v }

func (pi *poolIndex) class(k classKey) *class {
	c := pi.classes[k]
	if c == nil {
		c = &class{classKey: k, buckets: make([]nodeHeap, k.ngpu+1)}
		pi.classes[k] = c
		pi.classList = append(pi.classList, c)
		slices.SortFunc(pi.classList, func(a, b *class) int {
			return cmp.Or(strings.Compare(a.model, b.model), cmp.Compare(a.mem, b.mem), cmp.Compare(a.ngpu, b.ngpu))
		})
	}
	return c
}

// unfile takes n out of the placement structures; file puts it back where
// its state and free count say.
func (pi *poolIndex) unfile(n *node) {
	if n.cls != nil {
		n.cls.buckets[n.bucket].remove(n)
		n.cls = nil
	}
	if n.inMixed {
		delete(pi.mixed, n.id)
		n.inMixed = false
	}
}

func (pi *poolIndex) file(n *node) {
	if !n.placeable() {
		return
	}
	if k, ok := n.classKey(); ok {
		c := pi.class(k)
		n.cls, n.bucket = c, n.free
		c.buckets[n.free].push(n)
		return
	}
	pi.mixed[n.id] = n
	n.inMixed = true
}

func (pi *poolIndex) addNode(n *node) {
	pi.nodes[n.id] = n
	for k, v := range n.labels {
		lk := labelKey(k, v)
		set := pi.byLabel[lk]
		if set == nil {
			set = map[*node]struct{}{}
			pi.byLabel[lk] = set
		}
		set[n] = struct{}{}
	}
	pi.file(n)
}

func (pi *poolIndex) removeNode(n *node) {
	pi.unfile(n)
	delete(pi.nodes, n.id)
	for k, v := range n.labels {
		lk := labelKey(k, v)
		delete(pi.byLabel[lk], n)
		if len(pi.byLabel[lk]) == 0 {
			delete(pi.byLabel, lk)
		}
	}
}

// book marks GPUs of n booked; unbook frees them.
func (x *index) book(n *node, gpus []int32) {
	pi := x.pool(n.pool)
	pi.unfile(n)
	if n.booked == nil {
		n.booked = make(map[int32]struct{}, len(gpus))
	}
	for _, g := range gpus {
		n.booked[g] = struct{}{}
	}
	n.recount()
	pi.file(n)
}

func (x *index) unbook(n *node, gpus []int32) {
	pi := x.pool(n.pool)
	pi.unfile(n)
	for _, g := range gpus {
		delete(n.booked, g)
	}
	n.recount()
	pi.file(n)
}

// setBooked replaces the booked GPUs of n with what the database holds.
func (x *index) setBooked(n *node, gpus []int32) {
	pi := x.pool(n.pool)
	pi.unfile(n)
	n.booked = make(map[int32]struct{}, len(gpus))
	for _, g := range gpus {
		n.booked[g] = struct{}{}
	}
	n.recount()
	pi.file(n)
}

// nodeOf returns the node, creating an empty, unplaceable one (in its
// pool) for a booking on a node the index has not seen.
func (x *index) nodeOf(k nodeKey) *node {
	n := x.nodes[k]
	if n == nil {
		n = &node{id: k.id, pool: k.pool, state: "unknown"}
		x.nodes[k] = n
		x.pool(k.pool).addNode(n)
	}
	return n
}

type nodeRow struct {
	id, pool, labels, state string
	connected               bool
	rev                     int64
	heldAt                  *time.Time
}

func (r nodeRow) key() nodeKey { return nodeKey{r.pool, r.id} }

// held is the row's held_at (zero: null).
func (r nodeRow) held() time.Time {
	if r.heldAt == nil {
		return time.Time{}
	}
	return r.heldAt.UTC()
}

// upsert applies a fleet_nodes row (and, when devs is not nil, the node's
// devices) to the index.
func (x *index) upsert(r nodeRow, devs []device, setDevs bool) {
	k := r.key()
	n := x.nodes[k]
	labels := parseLabels(r.labels)
	if n == nil {
		n = &node{id: r.id, pool: r.pool, labels: labels}
		x.nodes[k] = n
	} else {
		x.pool(n.pool).removeNode(n)
		n.labels = labels
	}
	n.state, n.connected, n.rev = r.state, r.connected, r.rev
	n.heldAt = r.held()
	if setDevs {
		n.gpus = devs
	}
	n.recount()
	x.pool(n.pool).addNode(n)
}

func parseLabels(s string) map[string]string {
	if s == "" || s == "{}" {
		return nil
	}
	var m map[string]string
	if err := json.Unmarshal([]byte(s), &m); err == nil {
		return m
	}
	var anyMap map[string]any
	if err := json.Unmarshal([]byte(s), &anyMap); err != nil {
		return nil
	}
	m = make(map[string]string, len(anyMap))
	for k, v := range anyMap {
		if str, ok := v.(string); ok {
			m[k] = str
		} else {
			b, _ := json.Marshal(v)
			m[k] = string(b)
		}
	}
	return m
}

// ---------------------------------------------------------------- load --

const (
	sqlLoadNodes = `select s.snap::text, true, n.node_id, n.pool, n.labels::text, n.connected, n.state, n.rev, n.held_at
		from (select pg_current_snapshot() as snap) s left join fleet_nodes n on true`
	sqlChangedNodes = `select s.snap::text,
			coalesce((select bool_and(pg_visible_in_snapshot(x, s.snap)) from pg_snapshot_xip($2::pg_snapshot) as x), true),
			n.node_id, n.pool, n.labels::text, n.connected, n.state, n.rev, n.held_at
		from (select pg_current_snapshot() as snap) s left join fleet_nodes n on n.rev > $1`
	sqlLoadDevices = `select pool, node_id, gpu_index, model, memory_mib, health from fleet_devices
		order by pool, node_id, gpu_index`
	sqlNodeDevices = `select d.pool, d.node_id, d.gpu_index, d.model, d.memory_mib, d.health
		from unnest($1::text[], $2::text[]) as u(pool, id)
		join fleet_devices d on d.pool = u.pool and d.node_id = u.id order by d.pool, d.node_id, d.gpu_index`
	sqlLoadBookings = `select pool, node_id, gpu_index from fleet_bookings`
	sqlLoadFences   = `select pool, node_id, count(*) from fleet_fences group by pool, node_id`
	sqlNodeBookings = `select b.pool, b.node_id, b.gpu_index from unnest($1::text[], $2::text[]) as u(pool, id)
		join fleet_bookings b on b.pool = u.pool and b.node_id = u.id`
	sqlLockNodes = `select n.node_id, n.pool, n.labels::text, n.connected, n.state, n.rev, n.held_at
		from unnest($1::text[], $2::text[]) as u(pool, id) join fleet_nodes n on n.pool = u.pool and n.node_id = u.id
		order by n.pool, n.node_id for share of n`
)

// scanNodes reads the rows of sqlLoadNodes or sqlChangedNodes: the
// statement's snapshot, whether the previous candidate's transactions had
// all ended by then, and the node rows.
func scanNodes(rows pgx.Rows) (snap string, candDone bool, out []nodeRow, err error) {
	defer rows.Close()
	for rows.Next() {
		var id, pool, labels, state *string
		var connected *bool
		var rev *int64
		var heldAt *time.Time
		if err := rows.Scan(&snap, &candDone, &id, &pool, &labels, &connected, &state, &rev, &heldAt); err != nil {
			return "", false, nil, err
		}
		if id == nil {
			continue // the left join's row when no node matched
		}
		out = append(out, nodeRow{id: *id, pool: *pool, labels: *labels, connected: *connected, state: *state, rev: *rev, heldAt: heldAt})
	}
	return snap, candDone, out, rows.Err()
}

func scanDevices(rows pgx.Rows) (map[nodeKey][]device, error) {
	out := map[nodeKey][]device{}
	var k nodeKey
	var model, health string
	var d device
	var mem int64
	_, err := pgx.ForEachRow(rows, []any{&k.pool, &k.id, &d.index, &model, &mem, &health}, func() error {
		d.model, d.mem, d.ok = model, uint64(max(mem, 0)), health == "ok"
		out[k] = append(out[k], d)
		return nil
	})
	return out, err
}

func scanBookings(rows pgx.Rows) (map[nodeKey][]int32, error) {
	out := map[nodeKey][]int32{}
	var k nodeKey
	var g int32
	_, err := pgx.ForEachRow(rows, []any{&k.pool, &k.id, &g}, func() error {
		out[k] = append(out[k], g)
		return nil
	})
	return out, err
}

// loadIndex builds the index from the database.
func loadIndex(ctx context.Context, tx pgx.Tx) (*index, error) {
	x := newIndex()
	rows, err := tx.Query(ctx, sqlLoadNodes)
	if err != nil {
		return nil, fmt.Errorf("placer: load nodes: %w", err)
	}
	snap, _, nodes, err := scanNodes(rows)
	if err != nil {
		return nil, fmt.Errorf("placer: load nodes: %w", err)
	}
	rows, err = tx.Query(ctx, sqlLoadDevices)
	if err != nil {
		return nil, fmt.Errorf("placer: load devices: %w", err)
	}
	devs, err := scanDevices(rows)
	if err != nil {
		return nil, fmt.Errorf("placer: load devices: %w", err)
	}
	rows, err = tx.Query(ctx, sqlLoadBookings)
	if err != nil {
		return nil, fmt.Errorf("placer: load bookings: %w", err)
	}
	booked, err := scanBookings(rows)
	if err != nil {
		return nil, fmt.Errorf("placer: load bookings: %w", err)
	}
	rows, err = tx.Query(ctx, sqlLoadFences)
	if err != nil {
		return nil, fmt.Errorf("placer: load fences: %w", err)
	}
	fences := map[nodeKey]int{}
	var fk nodeKey
	var fn int
	if _, err := pgx.ForEachRow(rows, []any{&fk.pool, &fk.id, &fn}, func() error {
		fences[fk] = fn
		return nil
	}); err != nil {
		return nil, fmt.Errorf("placer: load fences: %w", err)
	}
	var maxRev int64
	for _, r := range nodes {
		n := &node{id: r.id, pool: r.pool, labels: parseLabels(r.labels), state: r.state,
			connected: r.connected, rev: r.rev, heldAt: r.held(), gpus: devs[r.key()], fences: fences[r.key()]}
		if b := booked[r.key()]; len(b) > 0 {
			n.booked = make(map[int32]struct{}, len(b))
			for _, g := range b {
				n.booked[g] = struct{}{}
			}
		}
		n.recount()
		x.nodes[n.key()] = n
		x.pool(n.pool).addNode(n)
		maxRev = max(maxRev, r.rev)
	}
	for k, gs := range booked {
		if x.nodes[k] == nil {
			x.setBooked(x.nodeOf(k), gs)
		}
	}
	// Everything committed at snap has been read; what was in progress
	// may still commit revs at or below maxRev, so the watermark stays at
	// 0 until it has ended (the next refresh reads every node row once
	// more and skips those it knows).
	x.rev, x.candRev, x.candSnap = 0, maxRev, snap
	return x, nil
}

// refresh reads the nodes changed since the last look (and their devices).
func (x *index) refresh(ctx context.Context, tx pgx.Tx) error {
	var cand any
	if x.candSnap != "" {
		cand = x.candSnap
	}
	rows, err := tx.Query(ctx, sqlChangedNodes, x.rev, cand)
	if err != nil {
		return fmt.Errorf("placer: refresh nodes: %w", err)
	}
	snap, candDone, changed, err := scanNodes(rows)
	if err != nil {
		return fmt.Errorf("placer: refresh nodes: %w", err)
	}
	seen := x.rev
	var keys []nodeKey
	var fresh []nodeRow
	for _, r := range changed {
		seen = max(seen, r.rev)
		if n := x.nodes[r.key()]; n != nil && n.rev >= r.rev && n.state != "unknown" {
			continue // read before
		}
		keys = append(keys, r.key())
		fresh = append(fresh, r)
	}
	if len(fresh) > 0 {
		pools, ids := keyColumns(keys)
		rows, err := tx.Query(ctx, sqlNodeDevices, pools, ids)
		if err != nil {
			return fmt.Errorf("placer: refresh devices: %w", err)
		}
		devs, err := scanDevices(rows)
		if err != nil {
			return fmt.Errorf("placer: refresh devices: %w", err)
		}
		for _, r := range fresh {
			x.upsert(r, devs[r.key()], true)
		}
	}
	if candDone {
		if x.candSnap != "" {
			x.rev = max(x.rev, x.candRev)
		}
		x.candRev, x.candSnap = max(seen, x.rev), snap
	}
	return nil
}

// view is a canonical picture of the index, for tests that compare it
// with a fresh load.
func (x *index) view() map[string]string {
	out := make(map[string]string, len(x.nodes))
	for k, n := range x.nodes {
		var b strings.Builder
		fmt.Fprintf(&b, "pool=%s state=%s connected=%t free=%d fences=%d placeable=%t held_at=%s", n.pool, n.state, n.connected, n.free, n.fences, n.placeable(), n.heldAt.Format(time.RFC3339Nano))
		for _, k := range slices.Sorted(maps.Keys(n.labels)) {
			fmt.Fprintf(&b, " %s=%s", k, n.labels[k])
		}
		for _, d := range n.gpus {
			fmt.Fprintf(&b, " gpu%d:%s/%d/%t", d.index, d.model, d.mem, d.ok)
		}
		fmt.Fprintf(&b, " booked=%v", slices.Sorted(maps.Keys(n.booked)))
		if n.cls != nil {
			fmt.Fprintf(&b, " bucket=%d", n.bucket)
		}
		if n.inMixed {
			b.WriteString(" mixed")
		}
		out[k.pool+"/"+k.id] = b.String()
	}
	return out
}

// -------------------------------------------------------------- heaps --

// nodeHeap is a binary min-heap of nodes by id; each node knows its slot.
type nodeHeap []*node

func (h *nodeHeap) push(n *node) {
	*h = append(*h, n)
	n.heapIdx = len(*h) - 1
	h.up(n.heapIdx)
}

func (h *nodeHeap) remove(n *node) {
	i := n.heapIdx
	last := len(*h) - 1
	if i != last {
		h.swap(i, last)
	}
	(*h)[last] = nil
	*h = (*h)[:last]
	if i != last {
		if !h.down(i) {
			h.up(i)
		}
	}
	n.heapIdx = -1
}

func (h nodeHeap) swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].heapIdx, h[j].heapIdx = i, j
}

func (h nodeHeap) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if h[p].id <= h[i].id {
			return
		}
		h.swap(i, p)
		i = p
	}
}

func (h nodeHeap) down(i int) bool {
	start := i
	for {
		l := 2*i + 1
		if l >= len(h) {
			break
		}
		m := l
		if r := l + 1; r < len(h) && h[r].id < h[l].id {
			m = r
		}
		if h[i].id <= h[m].id {
			break
		}
		h.swap(i, m)
		i = m
	}
	return i > start
}
