package fleetsim

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/loadtest/replay"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/subjects"
)

// matcher pairs each allocation's placement decision with the node's BOUND
// answer, whichever is seen first: place-to-active.
type matcher struct {
	mu       sync.Mutex
	decided  map[string]time.Time // allocation -> decision at, not yet bound
	bounds   map[string]time.Time // allocation -> bound at, decision not yet seen
	done     map[string]struct{}
	released int64 // released before bound
	hist     replay.Histogram
}

func newMatcher() *matcher {
	return &matcher{decided: map[string]time.Time{}, bounds: map[string]time.Time{}, done: map[string]struct{}{}}
}

func (m *matcher) decision(id string, at time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.done[id]; ok {
		return
	}
	if b, ok := m.bounds[id]; ok {
		delete(m.bounds, id)
		m.done[id] = struct{}{}
		m.hist.Record(b.Sub(at))
		return
	}
	if _, ok := m.decided[id]; !ok {
		m.decided[id] = at
	}
}

func (m *matcher) bound(id string, at time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.done[id]; ok {
		return
	}
	if d, ok := m.decided[id]; ok {
		delete(m.decided, id)
		m.done[id] = struct{}{}
		m.hist.Record(at.Sub(d))
		return
	}
	if _, ok := m.bounds[id]; !ok {
		m.bounds[id] = at
	}
}

func (m *matcher) release(id string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if _, ok := m.decided[id]; ok {
		delete(m.decided, id)
		m.done[id] = struct{}{}
		m.released++
	}
}

// pending is the allocations decided and not yet bound.
func (m *matcher) pending() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	return len(m.decided)
}

func (m *matcher) matched() uint64 { return m.hist.Count() }

// subscribeDecisions reads PlacementDecisions of the pool from NATS (a
// plain subscription: the placer's publishes to FLEET_PLACE reach it as
// they are stored).
func (s *sim) subscribeDecisions(url string) (*nats.Conn, error) {
	opts := []nats.Option{nats.Name("millrace-fleetsim"), nats.MaxReconnects(-1)}
	if s.cfg.NATSNKey != "" {
		o, err := nats.NkeyOptionFromSeed(s.cfg.NATSNKey)
		if err != nil {
			return nil, fmt.Errorf("NATS nkey %s: %w", s.cfg.NATSNKey, err)
		}
		opts = append(opts, o)
	}
	nc, err := nats.Connect(url, opts...)
	if err != nil {
		return nil, fmt.Errorf("NATS %s: %w", url, err)
	}
	sub, err := nc.Subscribe(subjects.FleetPlace(s.cfg.Pool), func(msg *nats.Msg) {
		var d fleetpb.PlacementDecision
		if err := proto.Unmarshal(msg.Data, &d); err != nil {
			s.errorf("decode a placement decision: %v", err)
			return
		}
		s.decision(&d)
	})
	if err != nil {
		nc.Close()
		return nil, err
	}
	_ = sub.SetPendingLimits(-1, -1)
	if err := nc.Flush(); err != nil {
		nc.Close()
		return nil, err
	}
	return nc, nil
}

func (s *sim) decision(d *fleetpb.PlacementDecision) {
	at := d.GetAt().AsTime()
	switch b := d.Body.(type) {
	case *fleetpb.PlacementDecision_Placed:
		mine := false
		for _, al := range b.Placed.GetAllocations() {
			if _, ok := s.byID[al.GetNodeId()]; !ok {
				continue
			}
			mine = true
			s.allocations.Add(1)
			s.match.decision(al.GetId(), at)
		}
		if mine {
			s.placed.Add(1)
		}
	case *fleetpb.PlacementDecision_Released:
		s.released.Add(1)
		for _, id := range b.Released.GetAllocationIds() {
			s.match.release(id)
		}
	case *fleetpb.PlacementDecision_Failed:
		s.failed.Add(1)
	}
}

// pollAllocations is the placement source without NATS: new rows of
// fleet_allocations, their placed_at taken as the decision time.
func (s *sim) pollAllocations(ctx context.Context, db *pgxpool.Pool, since time.Time) {
	seenDecision := map[string]bool{}
	seenAlloc := map[string]bool{}
	t := time.NewTicker(250 * time.Millisecond)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		rows, err := db.Query(ctx, `select id, node_id, decision_id, placed_at, released_at is not null
			from fleet_allocations where pool = $1 and placed_at >= $2 order by placed_at`, s.cfg.Pool, since)
		if err != nil {
			if ctx.Err() == nil {
				s.errorf("poll fleet_allocations: %v", err)
			}
			continue
		}
		for rows.Next() {
			var id, node, dec string
			var at time.Time
			var released bool
			if err := rows.Scan(&id, &node, &dec, &at, &released); err != nil {
				break
			}
			if _, ok := s.byID[node]; !ok || seenAlloc[id] {
				continue
			}
			seenAlloc[id] = true
			if !seenDecision[dec] {
				seenDecision[dec] = true
				s.placed.Add(1)
			}
			s.allocations.Add(1)
			s.match.decision(id, at)
			if released {
				s.match.release(id)
			}
		}
		rows.Close()
	}
}

// liveSample takes a heartbeat's send time for the liveness-lag poller.
func (s *sim) liveSample(n *node, at time.Time) {
	select {
	case s.samples <- sample{n.id, at}:
	default:
	}
}

type sample struct {
	node string
	at   time.Time
}

// Liveness lag: a sampled heartbeat is covered when last_seen reaches its
// send time (less a little for timestamp rounding).
const (
	livenessPoll      = 50 * time.Millisecond
	livenessTolerance = 5 * time.Millisecond
	livenessTimeout   = time.Minute
)

// pollLiveness follows sampled heartbeats into fleet_nodes.last_seen.
func (s *sim) pollLiveness(ctx context.Context, db *pgxpool.Pool) {
	pending := map[string]time.Time{}
	t := time.NewTicker(livenessPoll)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case sm := <-s.samples:
			if _, ok := pending[sm.node]; !ok && len(pending) < 1000 {
				pending[sm.node] = sm.at
			}
			continue
		case <-t.C:
		}
		if len(pending) == 0 {
			continue
		}
		ids := make([]string, 0, len(pending))
		for id := range pending {
			ids = append(ids, id)
		}
		rows, err := db.Query(ctx, `select node_id, last_seen from fleet_nodes where pool = $2 and node_id = any($1)`, ids, s.cfg.Pool)
		if err != nil {
			if ctx.Err() == nil {
				s.errorf("poll fleet_nodes.last_seen: %v", err)
			}
			continue
		}
		now := time.Now()
		for rows.Next() {
			var id string
			var seen time.Time
			if rows.Scan(&id, &seen) != nil {
				break
			}
			if at, ok := pending[id]; ok && !seen.Before(at.Add(-livenessTolerance)) {
				s.liveLag.Record(now.Sub(at))
				delete(pending, id)
			}
		}
		rows.Close()
		for id, at := range pending {
			if now.Sub(at) > livenessTimeout {
				s.liveUnseen.Add(1)
				delete(pending, id)
			}
		}
	}
}

// pollUnreachable records this run's unreachable marks of our nodes.
func (s *sim) pollUnreachable(ctx context.Context, db *pgxpool.Pool, since time.Time) {
	t := time.NewTicker(2 * time.Second)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		s.unreachableOnce(ctx, db, since)
	}
}

func (s *sim) unreachableOnce(ctx context.Context, db *pgxpool.Pool, since time.Time) {
	rows, err := db.Query(ctx, `select node_id, state_since from fleet_nodes
		where pool = $1 and state = 'unreachable' and state_since >= $2`, s.cfg.Pool, since)
	if err != nil {
		if ctx.Err() == nil {
			s.errorf("poll unreachable nodes: %v", err)
		}
		return
	}
	defer rows.Close()
	now := time.Now()
	for rows.Next() {
		var id string
		var at time.Time
		if rows.Scan(&id, &at) != nil {
			return
		}
		n := s.byID[id]
		if n == nil {
			continue
		}
		s.mu.Lock()
		if _, ok := s.marks[id]; !ok {
			// Judge now, while the outage it marks is fresh.
			s.marks[id] = mark{since: at, longest: n.longestDown(now)}
		}
		s.mu.Unlock()
	}
}

type mark struct {
	since   time.Time
	longest time.Duration
}

// nodeStates counts this pool's nodes by state.
func nodeStates(ctx context.Context, db *pgxpool.Pool, pool string) (map[string]int64, error) {
	rows, err := db.Query(ctx, `select state, count(*) from fleet_nodes where pool = $1 group by state`, pool)
	if err != nil {
		return nil, err
	}
	defer rows.Close()
	out := map[string]int64{}
	for rows.Next() {
		var st string
		var n int64
		if err := rows.Scan(&st, &n); err != nil {
			return nil, err
		}
		out[st] = n
	}
	return out, rows.Err()
}

// doubleBookings checks fleet_allocations: no GPU may be held by two live
// allocations, and a live whole-node allocation shares its node with none.
func doubleBookings(ctx context.Context, db *pgxpool.Pool, pool string) (*DoubleBookings, error) {
	d := &DoubleBookings{CheckedPool: pool}
	err := db.QueryRow(ctx, `
		with live as (
			select id, node_id, gpu_indices, whole_node from fleet_allocations
			where pool = $1 and released_at is null
		)
		select
			(select count(*) from live),
			(select count(*) from (
				select node_id, g from live, unnest(gpu_indices) as g
				group by node_id, g having count(*) > 1) d),
			(select count(*) from live w join live o on o.node_id = w.node_id and o.id <> w.id where w.whole_node)`,
		pool).Scan(&d.LiveAllocs, &d.GPUs, &d.WholeNode)
	if err != nil {
		return nil, err
	}
	d.Total = d.GPUs + d.WholeNode
	return d, nil
}

// readCPU returns a process's user + system CPU time (/proc/<pid>/stat,
// fields 14 and 15, counted after the ')' that ends the command name).
func readCPU(pid int) (time.Duration, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, err
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, fmt.Errorf("pid %d: malformed stat", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("pid %d: short stat", pid)
	}
	u, _ := strconv.ParseInt(f[11], 10, 64)
	sy, _ := strconv.ParseInt(f[12], 10, 64)
	return time.Duration(u+sy) * time.Second / 100, nil // USER_HZ
}

// readRSS returns a process's resident set in KiB (VmRSS).
func readRSS(pid int) (int64, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			return strconv.ParseInt(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
		}
	}
	return 0, fmt.Errorf("pid %d: no VmRSS", pid)
}
