package fleet

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/envelope"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

var update = flag.Bool("update", false, "rewrite the golden files in testdata/")

// golden compares got with testdata/name, or rewrites it with -update.
func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run the test with -update to create it)", err)
	}
	if !bytes.Equal(want, got) {
		t.Errorf("%s differs from the projection (run with -update to accept):\n--- want\n%s\n--- got\n%s", path, want, got)
	}
}

const (
	okH       = fleetpb.GpuHealth_GPU_HEALTH_OK
	degradedH = fleetpb.GpuHealth_GPU_HEALTH_DEGRADED
	failedH   = fleetpb.GpuHealth_GPU_HEALTH_FAILED
)

// scenario is a small fleet's stream with one of each situation the
// projection must get right. Times are offsets from t0 (stored times):
//
//   - n1 (pool gpu-a) connects via gw-1, closes its session at 20s and
//     reconnects via gw-2 at 26s with a changed inventory; a late
//     disconnect and status of its old session arrive after that and are
//     ignored;
//   - n2 (gpu-a) reports a status change and allocations, re-homes to gw-2
//     at 28s, goes silent (its gateway stops listing it) and is heard again
//     at 70s: suspect in between for any sweep after 53s, healthy again
//     since 69.5s;
//   - n3 (gpu-b, gw-2) is last heard at 36s and never again: suspect since
//     61s, unreachable since 96s;
//   - "ghost" is listed by a gateway but was never connected (retention).
func scenario() *stream {
	s := newStream()
	s.at(0).connect("gpu-a", "n1", "gw-1", "s1a", map[string]string{"zone": "a", "rack": "r1"},
		gpu(0, "A100", 81920, okH), gpu(1, "A100", 81920, degradedH))
	s.at(500*time.Millisecond).connect("gpu-a", "n2", "gw-1", "s2a", map[string]string{"zone": "a"},
		gpu(3, "H100", 81559, okH), gpu(0, "H100", 81559, okH), gpu(1, "H100", 81559, okH), gpu(2, "H100", 81559, okH))
	s.at(time.Second).connect("gpu-b", "n3", "gw-2", "s3a", map[string]string{"zone": "b", "rack": "r7", "spot": "true"},
		gpu(0, "L4", 23034, okH))

	n1 := heard{"n1", "s1a", 2000}
	n2session := "s2a"
	for sec := 5; sec <= 95; sec += 5 {
		d := time.Duration(sec) * time.Second
		var a []heard
		if sec < 20 || sec >= 30 {
			a = append(a, n1)
		}
		if sec < 30 || sec >= 70 {
			age := uint32(1000)
			if sec == 70 {
				age = 500
			}
			a = append(a, heard{"n2", n2session, age})
		}
		if sec == 5 {
			a = append(a, heard{"ghost", "s-g", 10})
		}
		gw := "gw-1"
		if sec >= 30 {
			gw = "gw-2" // n1 lives on gw-2 now; n2 re-homed with it
		}
		s.at(d).liveness("gpu-a", gw, a...)
		if sec <= 40 {
			s.at(d+100*time.Millisecond).liveness("gpu-b", "gw-2", heard{"n3", "s3a", 4000})
		} else {
			s.at(d+100*time.Millisecond).liveness("gpu-b", "gw-2") // gw-2 hears nobody in gpu-b
		}

		switch sec {
		case 10:
			s.at(12*time.Second).status("gpu-a", "n2", "gw-1", "s2a", "h-1",
				[]*fleetpb.GpuState{{Index: 2, Health: degradedH}, {Index: 9, Health: failedH}},
				&fleetpb.Condition{Type: "Ready", Status: true},
				&fleetpb.Condition{Type: "XidErrors", Status: false, Reason: "Xid 79 on GPU 2"})
			s.at(13*time.Second).alloc("gpu-a", "n2", "gw-1", "s2a", "alloc-1", fleetpb.AllocationState_ALLOCATION_STATE_PENDING, "")
			s.at(14*time.Second).alloc("gpu-a", "n2", "gw-1", "s2a", "alloc-1", fleetpb.AllocationState_ALLOCATION_STATE_BOUND, "")
			s.at(14500*time.Millisecond).alloc("gpu-a", "n1", "gw-1", "s1a", "alloc-2", fleetpb.AllocationState_ALLOCATION_STATE_FAILED, "device busy")
		case 15:
			s.at(20*time.Second).disconnect("gpu-a", "n1", "gw-1", "s1a", "closed")
		case 25:
			n1 = heard{"n1", "s1b", 1500}
			s.at(26*time.Second).connect("gpu-a", "n1", "gw-2", "s1b", map[string]string{"zone": "a", "rack": "r2"},
				gpu(0, "A100", 81920, okH), gpu(1, "A100", 81920, okH))
			s.at(26500*time.Millisecond).disconnect("gpu-a", "n1", "gw-1", "s1a", "replaced")
			s.at(27*time.Second).status("gpu-a", "n1", "gw-1", "s1a", "h-stale",
				[]*fleetpb.GpuState{{Index: 0, Health: failedH}})
			// n2 re-homes too, keeping its status.
			n2session = "s2b"
			s.at(28*time.Second).connect("gpu-a", "n2", "gw-2", "s2b", map[string]string{"zone": "a"},
				gpu(0, "H100", 81559, okH), gpu(1, "H100", 81559, okH), gpu(2, "H100", 81559, degradedH), gpu(3, "H100", 81559, okH))
		case 75:
			s.at(76*time.Second).status("gpu-a", "n2", "gw-2", "s2b", "h-2",
				[]*fleetpb.GpuState{{Index: 2, Health: okH}}, &fleetpb.Condition{Type: "Ready", Status: true})
			s.at(77*time.Second).alloc("gpu-a", "n2", "gw-2", "s2b", "alloc-1", fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND, "")
		}
	}
	return s
}

// end is when the scenario's final sweep runs: its clock is at 95.1s, so
// the horizon is 110.1s.
var end = t0.Add(2 * time.Minute)

// TestScenarioGolden applies the scenario in batches of several sizes and
// records the projection at milestones (after n2's status change, n1's
// disconnect, the re-homes, the end of the stream, and a sweep after it).
func TestScenarioGolden(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{})
	marks := []time.Duration{12500 * time.Millisecond, 20500 * time.Millisecond, 28500 * time.Millisecond}
	var want map[string]string
	var wantDump []byte
	for _, n := range []int{1000, 1, 3, 7, 64} {
		t.Run(fmt.Sprintf("batch%d", n), func(t *testing.T) {
			truncate(t, pool)
			msgs := scenario().msgs
			var buf bytes.Buffer
			var st Stats
			add := func(s Stats) {
				st.Liveness += s.Liveness
				st.IgnoredLiveness += s.IgnoredLiveness
				st.IgnoredEvents += s.IgnoredEvents
			}
			for _, mark := range marks {
				k := slices.IndexFunc(msgs, func(m *msg) bool { return m.at.After(t0.Add(mark)) })
				add(applyAll(t, pool, p, msgs[:k], n))
				msgs = msgs[k:]
				fmt.Fprintf(&buf, "== stream up to %s\n%s", rel(t0.Add(mark)), dump(t, pool))
			}
			add(applyAll(t, pool, p, msgs, n))
			fmt.Fprintf(&buf, "== end of the stream\n%s", dump(t, pool))
			sweep(t, pool, p, end)
			fmt.Fprintf(&buf, "== swept at %s\n%s", rel(end), dump(t, pool))
			if st.IgnoredLiveness != 1 || st.IgnoredEvents != 2 {
				// ghost; the late disconnect and status of s1a.
				t.Errorf("stats %+v, want 1 ignored liveness entry, 2 ignored events", st)
			}
			d := digestOf(t, pool)
			if want == nil {
				want, wantDump = d, buf.Bytes()
				golden(t, "scenario.golden", buf.Bytes())
				return
			}
			if !maps.Equal(want, d) {
				t.Errorf("digest with batches of %d differs from batches of 1000", n)
			}
			if !bytes.Equal(buf.Bytes(), wantDump) {
				t.Errorf("batches of %d:\n%s\nwant\n%s", n, buf.Bytes(), wantDump)
			}
		})
	}
}

// TestSweepsBetweenBatches: a live runner sweeps whenever it is idle, a
// replay only at its end. With a sweep before every batch (at that
// batch's first stored time, as a live runner would have), n2 turns
// suspect during its silence and healthy when heard again; the rows must
// come out as without those sweeps.
func TestSweepsBetweenBatches(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{})
	s := scenario()
	applyAll(t, pool, p, s.msgs, 1000)
	sweep(t, pool, p, end)
	want := digestOf(t, pool)

	for _, n := range []int{1, 4, 9} {
		t.Run(fmt.Sprintf("batch%d", n), func(t *testing.T) {
			truncate(t, pool)
			suspect := false
			for i := 0; i < len(s.msgs); i += n {
				batch := s.msgs[i:min(i+n, len(s.msgs))]
				sweep(t, pool, p, batch[0].at)
				if n2, err := Show(context.Background(), pool, "gpu-a", "n2"); err == nil && n2.State == StateSuspect {
					suspect = true
				}
				applyBatch(t, pool, p, batch)
			}
			if !suspect {
				t.Error("no sweep found n2 suspect during its silence")
			}
			sweep(t, pool, p, end)
			if got := digestOf(t, pool); !maps.Equal(want, got) {
				t.Errorf("digest with sweeps between batches of %d differs:\n%s", n, dump(t, pool))
			}
		})
	}
}

// TestRedeliveredBatchChangesNothing: the same batch applied twice in a
// row (a redelivery the runner's position did not catch) leaves the rows
// as they were after the first.
func TestRedeliveredBatchChangesNothing(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{})
	s := scenario()
	applyAll(t, pool, p, s.msgs, 1000)
	want := digestOf(t, pool)
	for _, n := range []int{1, 7, 64} {
		truncate(t, pool)
		for i := 0; i < len(s.msgs); i += n {
			batch := s.msgs[i:min(i+n, len(s.msgs))]
			applyBatch(t, pool, p, batch)
			applyBatch(t, pool, p, batch)
		}
		if got := digestOf(t, pool); !maps.Equal(want, got) {
			t.Errorf("batches of %d applied twice: digest differs\n%s", n, dump(t, pool))
		}
	}
}

// TestOlderSessionDisconnect: a node re-homes through another gateway; the
// disconnect (and a status) of its older session, published late by the
// gateway it left, change nothing, not even the rev.
func TestOlderSessionDisconnect(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{})
	s := newStream()
	s.at(0).connect("p", "n", "gw-1", "s-old", nil, gpu(0, "A10", 24576, okH))
	s.at(time.Second).liveness("p", "gw-1", heard{"n", "s-old", 100})
	s.at(8*time.Second).connect("p", "n", "gw-2", "s-new", nil, gpu(0, "A10", 24576, okH))
	s.at(9*time.Second).liveness("p", "gw-2", heard{"n", "s-new", 100})
	applyAll(t, pool, p, s.msgs, 1000)
	before := show(t, pool, "n")

	mark := len(s.msgs)
	s.at(10*time.Second).disconnect("p", "n", "gw-1", "s-old", "heartbeat_timeout")
	s.at(11*time.Second).status("p", "n", "gw-1", "s-old", "h-old", []*fleetpb.GpuState{{Index: 0, Health: failedH}})
	st := applyAll(t, pool, p, s.msgs[mark:], 1000)
	if st.IgnoredEvents != 2 {
		t.Errorf("ignored %d events, want 2", st.IgnoredEvents)
	}
	after := show(t, pool, "n")
	if !equalNodes(before, after) {
		t.Fatalf("an older session's events changed the node:\nbefore %+v\nafter  %+v", before, after)
	}
	if !after.Connected || after.GatewayID != "gw-2" || after.SessionID != "s-new" || after.Devices[0].Health != "ok" {
		t.Fatalf("node after re-home: %+v", after)
	}

	// The current session's disconnect does apply, and keeps the session
	// id; the state is the sweep's to change.
	s.at(12*time.Second).disconnect("p", "n", "gw-2", "s-new", "closed")
	applyAll(t, pool, p, s.msgs[len(s.msgs)-1:], 1)
	n := show(t, pool, "n")
	if n.Connected || n.GatewayID != "" || n.SessionID != "s-new" || n.State != StateHealthy || n.Rev <= after.Rev {
		t.Fatalf("after its own disconnect: %+v", n)
	}
}

// TestRehomeKeepsDevices: a re-homed node's Connected event lists the same
// GPUs; their rows are not rewritten (the same xmin), but a changed health
// is applied, and changed hardware replaces the devices.
func TestRehomeKeepsDevices(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{})
	s := newStream()
	s.at(0).connect("p", "n", "gw-1", "s-1", nil, gpu(0, "A10", 24576, okH), gpu(1, "A10", 24576, okH))
	applyAll(t, pool, p, s.msgs, 1000)
	xmins := func() map[int32]string {
		rows, err := pool.Query(context.Background(), `select gpu_index, xmin::text from fleet_devices where node_id = 'n'`)
		if err != nil {
			t.Fatal(err)
		}
		m := map[int32]string{}
		var i int32
		var x string
		if _, err := pgx.ForEachRow(rows, []any{&i, &x}, func() error { m[i] = x; return nil }); err != nil {
			t.Fatal(err)
		}
		return m
	}
	before := xmins()

	mark := len(s.msgs)
	s.at(5*time.Second).connect("p", "n", "gw-2", "s-2", nil, gpu(0, "A10", 24576, okH), gpu(1, "A10", 24576, failedH))
	applyAll(t, pool, p, s.msgs[mark:], 1000)
	after := xmins()
	if len(after) != 2 || after[0] != before[0] {
		t.Errorf("device rows of an unchanged GPU rewritten by a re-home: xmin %v -> %v", before, after)
	}
	if after[1] == before[1] {
		t.Errorf("GPU 1's new health was not written")
	}
	n := show(t, pool, "n")
	if n.GatewayID != "gw-2" || n.Devices[0].Health != "ok" || n.Devices[1].Health != "failed" {
		t.Fatalf("after re-home: %+v", n)
	}

	mark = len(s.msgs)
	s.at(10*time.Second).connect("p", "n", "gw-1", "s-3", nil, gpu(0, "H100", 81559, okH))
	applyAll(t, pool, p, s.msgs[mark:], 1000)
	if n := show(t, pool, "n"); len(n.Devices) != 1 || n.Devices[0].Model != "H100" {
		t.Fatalf("new hardware not stored: %+v", n.Devices)
	}
}

func equalNodes(a, b *Node) bool {
	return fmt.Sprintf("%+v", *a) == fmt.Sprintf("%+v", *b)
}

// keeper returns liveness batches every 5 s from..to (offsets from t0) of
// a node that is always there, so that the clock runs.
func keeper(s *stream, from, to time.Duration) {
	for d := from; d <= to; d += 5 * time.Second {
		s.at(d).liveness("p", "gw-k", heard{"keeper", "sk", 0})
	}
}

// TestSweepThresholds: the runner's Sweep, at the wall clock's now, marks
// nodes at the thresholds exactly. (SweepTick is set out of the way: the
// stream's own sweeps are TestStreamSweeps'.)
func TestSweepThresholds(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{SweepTick: 24 * time.Hour})
	s := newStream()
	s.at(0).connect("p", "keeper", "gw-k", "sk", nil)
	s.at(0).connect("p", "n", "gw-1", "s1", nil, gpu(0, "A10", 24576, okH))
	keeper(s, 5*time.Second, 5*time.Second) // the clock starts (resumed at 5s)
	// n is last heard at 10s - 1.5s = 8.5s.
	s.at(10*time.Second).liveness("p", "gw-1", heard{"n", "s1", 1500})
	keeper(s, 10*time.Second, 120*time.Second)
	applyAll(t, pool, p, s.msgs, 1000)
	last := t0.Add(8500 * time.Millisecond)

	check := func(now time.Time, state string, since time.Time) {
		t.Helper()
		sweep(t, pool, p, now)
		n := show(t, pool, "n")
		if n.State != state || !n.StateSince.Equal(since) {
			t.Fatalf("sweep at %s: %s since %s, want %s since %s", rel(now), n.State, rel(n.StateSince), state, rel(since))
		}
	}
	check(last.Add(DefaultSuspectAfter), StateHealthy, t0)
	check(last.Add(DefaultSuspectAfter+time.Microsecond), StateSuspect, last.Add(DefaultSuspectAfter))
	check(last.Add(DefaultUnreachableAfter), StateSuspect, last.Add(DefaultSuspectAfter))
	check(last.Add(DefaultUnreachableAfter+time.Microsecond), StateUnreachable, last.Add(DefaultUnreachableAfter))
	check(last.Add(time.Hour), StateUnreachable, last.Add(DefaultUnreachableAfter)) // clock guard: horizon 135s
	un, err := Unreachable(context.Background(), pool, last.Add(DefaultUnreachableAfter-time.Microsecond))
	if err != nil || !slices.Equal(un, []NodeRef{{"p", "n"}}) {
		t.Fatalf("Unreachable = %v, %v; want [n]", un, err)
	}
	if un, _ := Unreachable(context.Background(), pool, last.Add(DefaultUnreachableAfter)); len(un) != 0 {
		t.Fatalf("Unreachable after it entered = %v, want none", un)
	}
	revBefore := show(t, pool, "n").Rev
	sweep(t, pool, p, last.Add(2*time.Hour))
	if show(t, pool, "n").Rev != revBefore {
		t.Fatal("a sweep that changes nothing moved the rev")
	}

	// Heard again: an entry older than SuspectAfter moves last_seen only;
	// a fresh one makes it healthy since it was heard.
	mark := len(s.msgs)
	s.at(130*time.Second).liveness("p", "gw-2", heard{"n", "s1", 26000})
	applyAll(t, pool, p, s.msgs[mark:], 1)
	if n := show(t, pool, "n"); n.State != StateUnreachable || !n.LastSeen.Equal(t0.Add(104*time.Second)) {
		t.Fatalf("after a stale entry: %s, last seen %s", n.State, rel(n.LastSeen))
	}
	s.at(131*time.Second).liveness("p", "gw-2", heard{"n", "s1", 700})
	applyAll(t, pool, p, s.msgs[mark+1:], 1)
	n := show(t, pool, "n")
	if n.State != StateHealthy || !n.StateSince.Equal(t0.Add(130300*time.Millisecond)) {
		t.Fatalf("heard again: %s since %s", n.State, rel(n.StateSince))
	}
	if n.Rev <= revBefore {
		t.Fatal("recovery did not move the rev")
	}
	// A liveness entry that moves last_seen alone keeps the rev.
	s.at(135*time.Second).liveness("p", "gw-2", heard{"n", "s1", 100})
	applyAll(t, pool, p, s.msgs[len(s.msgs)-1:], 1)
	if m := show(t, pool, "n"); m.Rev != n.Rev || !m.LastSeen.Equal(t0.Add(134900*time.Millisecond)) {
		t.Fatalf("heartbeat: rev %d -> %d, last seen %s", n.Rev, m.Rev, rel(m.LastSeen))
	}
	counts, err := Counts(context.Background(), pool)
	if err != nil || counts["p"] != (PoolCounts{Healthy: 2, Connected: 2}) {
		t.Fatalf("counts %+v, %v", counts, err)
	}
}

// TestStreamSweeps: Apply ages every node as of the stream's own clock
// (each SweepTick it crosses, and when it resumes after a silence), so a
// dead node becomes unreachable even if the runner never sweeps (it only
// does when the stream is idle); and a live run that did sweep in the
// silence yields the same rows as a replay that sweeps only at its end.
func TestStreamSweeps(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{})
	s := newStream()
	s.at(0).connect("p", "keeper", "gw-k", "sk", nil)
	s.at(0).connect("p", "dead", "gw-1", "s-d", nil)
	s.at(0).connect("p", "y", "gw-1", "s-y", nil)
	s.at(0).connect("p", "z", "gw-1", "s-z", nil)
	for d := 5 * time.Second; d <= 30*time.Second; d += 5 * time.Second {
		a := []heard{{"keeper", "sk", 0}, {"z", "s-z", 0}}
		if d <= 10*time.Second {
			a = append(a, heard{"dead", "s-d", 500}) // last heard at 9.5s
		}
		if d <= 20*time.Second {
			a = append(a, heard{"y", "s-y", 2000}) // last heard at 18s
		}
		s.at(d).liveness("p", "gw-1", a...)
	}
	silent := len(s.msgs) // the control plane is silent from 30s to 300s
	for d := 300 * time.Second; d <= 400*time.Second; d += 5 * time.Second {
		a := []heard{{"keeper", "sk", 0}, {"z", "s-z", 0}}
		if d >= 310*time.Second {
			a = append(a, heard{"y", "s-y", 500}) // y is back at 309.5s
		}
		s.at(d).liveness("p", "gw-2", a...)
	}

	// Up to the silence, no threshold is crossed: the stream's last tick
	// is at 30s. A sweep in the silence ages to 45s (clock + slack).
	applyAll(t, pool, p, s.msgs[:silent], 1000)
	if n := show(t, pool, "dead"); n.State != StateHealthy {
		t.Fatalf("dead after 30s of stream: %s", n.State)
	}
	sweep(t, pool, p, t0.Add(10*time.Minute))
	for id, since := range map[string]time.Duration{"dead": 34500 * time.Millisecond, "y": 43 * time.Second} {
		if n := show(t, pool, id); n.State != StateSuspect || !n.StateSince.Equal(t0.Add(since)) {
			t.Fatalf("%s in the silence: %s since %s, want suspect since %s", id, n.State, rel(n.StateSince), since)
		}
	}
	applyAll(t, pool, p, s.msgs[silent:], 1000)
	want := dump(t, pool)
	// Nobody sweeps after the silence: the stream's ticks alone make dead
	// unreachable, a grace period after the stream resumed (300s + 60s).
	if n := show(t, pool, "dead"); n.State != StateUnreachable || !n.StateSince.Equal(t0.Add(6*time.Minute)) {
		t.Fatalf("dead: %s since %s, want unreachable since +6m0s", n.State, rel(n.StateSince))
	}
	// y, back at 309.5s, is healthy since then.
	if n := show(t, pool, "y"); n.State != StateHealthy || !n.StateSince.Equal(t0.Add(309500*time.Millisecond)) {
		t.Fatalf("y: %s since %s, want healthy since +5m9.5s", n.State, rel(n.StateSince))
	}
	if n := show(t, pool, "z"); n.State != StateHealthy || !n.StateSince.Equal(t0) {
		t.Fatalf("z: %s since %s, want healthy since +0s", n.State, rel(n.StateSince))
	}

	// Replay: the whole stream in one batch, no sweep; the fold splits at
	// the resume to age nodes as the sweeps in the silence could have.
	truncate(t, pool)
	if st := applyAll(t, pool, p, s.msgs, 1000); st.Messages != len(s.msgs) {
		t.Fatalf("stats %+v", st)
	}
	if got := dump(t, pool); !bytes.Equal(got, want) {
		t.Errorf("replay:\n%s\nwant\n%s", got, want)
	}

	// Live: batches of 1, 2 or 7 with a sweep before each (during the
	// silence at the wall clock's now, long after the last batch), as a
	// runner would. Same rows.
	for _, n := range []int{1, 2, 7} {
		truncate(t, pool)
		for i := 0; i < len(s.msgs); i += n {
			batch := s.msgs[i:min(i+n, len(s.msgs))]
			sweep(t, pool, p, batch[0].at)
			applyBatch(t, pool, p, batch)
		}
		if got := dump(t, pool); !bytes.Equal(got, want) {
			t.Errorf("batches of %d with sweeps:\n%s\nwant\n%s", n, got, want)
		}
	}
}

// TestClockGuard: when no liveness batch arrives (every gateway down, or
// the stream stalled), time passes on the wall clock but not for the
// sweep; and when batches resume, nodes still reconnecting get a whole
// grace period from then.
func TestClockGuard(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{})
	s := newStream()
	for _, id := range []string{"a", "b", "c"} {
		s.at(0).connect("p", id, "gw-1", "s-"+id, nil)
	}
	for d := 5 * time.Second; d <= 30*time.Second; d += 5 * time.Second {
		s.at(d).liveness("p", "gw-1", heard{"a", "s-a", 1000}, heard{"b", "s-b", 1000}, heard{"c", "s-c", 1000})
	}
	applyAll(t, pool, p, s.msgs, 1000)
	want := dump(t, pool)
	// The control plane is silent from 30s. An hour of sweeps marks nothing.
	for _, d := range []time.Duration{time.Minute, 10 * time.Minute, time.Hour} {
		sweep(t, pool, p, t0.Add(d))
		if got := dump(t, pool); !bytes.Equal(got, want) {
			t.Fatalf("sweep at %s during the silence changed nodes:\n%s", d, got)
		}
	}

	// Gateways come back at 1h: a reconnects at once; b after 50 s (it
	// was refused and backed off); c never.
	back := time.Hour
	mark := len(s.msgs)
	s.at(back).connect("p", "a", "gw-2", "s-a2", nil)
	for d := back; d <= back+2*time.Minute; d += 5 * time.Second {
		a := []heard{{"a", "s-a2", 500}}
		if d >= back+50*time.Second {
			a = append(a, heard{"b", "s-b2", 500})
		}
		if d == back+50*time.Second {
			s.at(d).connect("p", "b", "gw-2", "s-b2", nil)
		}
		s.at(d+time.Second).liveness("p", "gw-2", a...)
	}
	resumed := t0.Add(back + time.Second)
	for i := mark; i < len(s.msgs); i++ {
		applyAll(t, pool, p, s.msgs[i:i+1], 1)
		sweep(t, pool, p, s.msgs[i].at.Add(time.Second))
		if n := show(t, pool, "b"); n.State == StateUnreachable {
			t.Fatalf("b is unreachable at %s, during its grace period after the outage", rel(s.msgs[i].at))
		}
	}
	if b := show(t, pool, "b"); b.State != StateHealthy || !b.StateSince.Equal(t0.Add(back+50*time.Second)) {
		t.Fatalf("b: %s since %s, want healthy since its reconnect", b.State, rel(b.StateSince))
	}
	c := show(t, pool, "c")
	if c.State != StateUnreachable || !c.StateSince.Equal(resumed.Add(DefaultUnreachableAfter)) {
		t.Fatalf("c: %s since %s, want unreachable since %s", c.State, rel(c.StateSince), rel(resumed.Add(DefaultUnreachableAfter)))
	}
	// Replayed without any sweep in between: the same rows.
	live := digestOf(t, pool)
	truncate(t, pool)
	applyAll(t, pool, p, s.msgs, 1000)
	sweep(t, pool, p, t0.Add(3*time.Hour))
	if got := digestOf(t, pool); !maps.Equal(live, got) {
		t.Fatalf("replay differs from the live run:\n%s", dump(t, pool))
	}
}

// TestGatewayDied: a node's gateway dies without publishing a disconnect;
// the node's last heartbeat was at 10s, and it re-homes through another
// gateway at 22s. Whenever the sweep runs, and however the stream is
// batched, it is never unreachable, nor even suspect.
func TestGatewayDied(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{})
	s := newStream()
	s.at(0).connect("p", "keeper", "gw-k", "sk", nil)
	s.at(0).connect("p", "n", "gw-1", "s1", nil, gpu(0, "A10", 24576, okH))
	for d := 5 * time.Second; d <= 90*time.Second; d += 5 * time.Second {
		keeper(s, d, d)
		switch {
		case d == 5*time.Second:
			s.at(d).liveness("p", "gw-1", heard{"n", "s1", 3000})
		case d == 10*time.Second:
			s.at(d).liveness("p", "gw-1", heard{"n", "s1", 0}) // the last heartbeat: gw-1 dies now
		case d == 20*time.Second:
			s.at(22*time.Second).connect("p", "n", "gw-2", "s2", nil, gpu(0, "A10", 24576, okH))
		case d >= 25*time.Second:
			s.at(d+time.Second).liveness("p", "gw-2", heard{"n", "s2", 1000})
		}
	}

	for _, n := range []int{1, 2, 5, 1000} {
		truncate(t, pool)
		for i := 0; i < len(s.msgs); i += n {
			batch := s.msgs[i:min(i+n, len(s.msgs))]
			applyBatch(t, pool, p, batch)
			// Sweeps every 500 ms of stored time until the next batch.
			next := t0.Add(2 * time.Minute)
			if i+n < len(s.msgs) {
				next = s.msgs[i+n].at
			}
			for now := batch[len(batch)-1].at; now.Before(next); now = now.Add(500 * time.Millisecond) {
				sweep(t, pool, p, now)
				if node := show(t, pool, "n"); node.State != StateHealthy || !node.StateSince.Equal(t0) {
					t.Fatalf("batches of %d: node %s since %s at %s", n, node.State, rel(node.StateSince), rel(now))
				}
			}
		}
		if node := show(t, pool, "n"); node.GatewayID != "gw-2" || !node.Connected {
			t.Fatalf("node after re-home: %+v", node)
		}
	}
}

func TestPoison(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := mustNew(Config{})
	good := scenario().msgs[:12]

	bad := func(name string, mutate func(m *msg)) {
		t.Run(name, func(t *testing.T) {
			truncate(t, pool)
			msgs := make([]*msg, len(good))
			for i, m := range good {
				c := *m
				c.hdr = maps.Clone(m.hdr)
				msgs[i] = &c
			}
			victim := msgs[1] // n2's connected event
			mutate(victim)
			err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.Apply(ctx, tx, toMessages(msgs)) })
			pe, ok := projection.AsPoison(err)
			if !ok {
				t.Fatalf("Apply = %v, want a PoisonError", err)
			}
			if pe.Seq != victim.seq {
				t.Fatalf("poison seq %d, want %d (%v)", pe.Seq, victim.seq, err)
			}
			t.Logf("reason: %v", pe.Reason)
			if n, _ := Nodes(ctx, pool, ""); len(n) != 0 {
				t.Fatalf("a poisoned batch wrote %d nodes", len(n))
			}
			// The runner applies the rest without it.
			rest := slices.Delete(slices.Clone(msgs), 1, 2)
			applyAll(t, pool, p, rest, 1000)
			if _, err := Show(ctx, pool, "gpu-a", "n1"); err != nil {
				t.Fatal(err)
			}
		})
	}
	bad("truncated protobuf", func(m *msg) { m.data = m.data[:len(m.data)-3] })
	bad("garbage", func(m *msg) { m.data = []byte{0xff, 0xff, 0xff, 0xff} })
	bad("empty body", func(m *msg) { m.data = nil })
	bad("unknown schema", func(m *msg) { m.hdr[envelope.Schema] = "fleet.v9" })
	bad("unknown kind", func(m *msg) { m.hdr[envelope.Kind] = "reservation" })
	bad("liveness kind on a node subject", func(m *msg) { m.hdr[envelope.Kind] = envelope.KindLiveness })
	bad("node kind on a liveness subject", func(m *msg) { m.subject = subjects.FleetLiveness("gpu-a") })
	bad("not a fleet.node subject", func(m *msg) { m.subject = "fleet.resv.gpu-a" })
	bad("pool token not as Token writes it", func(m *msg) { m.subject = "fleet.node.gpu%2Da.n1" })
	bad("node token not a token", func(m *msg) { m.subject = "fleet.node.gpu-a.n%1" })
	bad("header names another node", func(m *msg) { m.hdr[envelope.Node] = "n9" })
	bad("no stored time", func(m *msg) { m.at = time.Time{} })
	reencode := func(f func(ev *fleetpb.NodeEvent)) func(m *msg) {
		return func(m *msg) {
			ev := &fleetpb.NodeEvent{}
			if err := proto.Unmarshal(m.data, ev); err != nil {
				panic(err)
			}
			f(ev)
			m.data, _ = proto.Marshal(ev)
		}
	}
	bad("no body", reencode(func(ev *fleetpb.NodeEvent) { ev.Body = nil }))
	bad("no node id", reencode(func(ev *fleetpb.NodeEvent) { ev.NodeId = "" }))
	bad("NUL in session id", reencode(func(ev *fleetpb.NodeEvent) { ev.SessionId = "s\x00" }))
	bad("duplicate GPU index", reencode(func(ev *fleetpb.NodeEvent) {
		c := ev.GetConnected()
		c.Gpus = append(c.Gpus, gpu(0, "X", 1, okH))
	}))
	bad("allocation without state", reencode(func(ev *fleetpb.NodeEvent) {
		ev.Body = &fleetpb.NodeEvent_Allocation{Allocation: &fleetpb.AllocationReport{AllocationId: "a"}}
	}))
	bad("invalid UTF-8", func(m *msg) {
		// Field 5 of Gpu (uuid) is a proto3 string: the runtime refuses it.
		m.data = append(m.data, 0x52, 0x07, 0x12, 0x05, 0x2a, 0x03, 0xff, 0xfe, 0xfd)
	})
}

// TestFreeTextIsStored: text PostgreSQL refuses as is (NUL) is stored with
// U+FFFD in its place rather than making the batch fail.
func TestFreeTextIsStored(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{})
	s := newStream()
	s.connect("p", "n", "gw", "s", map[string]string{"k\x00": "v\x00<&>"}, gpu(0, "A\x00", 1, okH))
	s.status("p", "n", "gw", "s", "h\x00", nil, &fleetpb.Condition{Type: "T\x00", Reason: "r\x00"})
	s.alloc("p", "n", "gw", "s", "a", fleetpb.AllocationState_ALLOCATION_STATE_FAILED, "e\x00")
	applyAll(t, pool, p, s.msgs, 1000)
	n := show(t, pool, "n")
	if n.Labels["k\uFFFD"] != "v\uFFFD<&>" || n.Devices[0].Model != "A\uFFFD" || n.Conditions[0].Reason != "r\uFFFD" {
		t.Fatalf("node: %+v", n)
	}
}

func TestReadHelpers(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := mustNew(Config{})
	applyAll(t, pool, p, scenario().msgs, 1000)
	sweep(t, pool, p, end)

	a, err := Nodes(ctx, pool, "gpu-a")
	if err != nil || len(a) != 2 || a[0].ID != "n1" || a[1].ID != "n2" || a[0].Devices != nil {
		t.Fatalf("Nodes(gpu-a) = %+v, %v", a, err)
	}
	all, _ := Nodes(ctx, pool, "")
	if len(all) != 3 {
		t.Fatalf("Nodes() = %d nodes, want 3", len(all))
	}
	if none, err := Nodes(ctx, pool, "nope"); err != nil || len(none) != 0 {
		t.Fatalf("Nodes(nope) = %v, %v", none, err)
	}
	n2 := show(t, pool, "n2")
	if len(n2.Devices) != 4 || n2.Devices[2].Health != "ok" || n2.StatusHash != "h-2" || n2.Labels["zone"] != "a" {
		t.Fatalf("Show(n2) = %+v", n2)
	}
	if _, err := Show(ctx, pool, "gpu-a", "nope"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Show(nope) = %v, want ErrNotFound", err)
	}
	counts, err := Counts(ctx, pool)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]PoolCounts{"gpu-a": {Healthy: 2, Connected: 2}, "gpu-b": {Unreachable: 1, Connected: 1}}
	if !maps.Equal(counts, want) {
		t.Fatalf("Counts = %+v, want %+v", counts, want)
	}
	un, err := Unreachable(ctx, pool, t0)
	if err != nil || !slices.Equal(un, []NodeRef{{"gpu-b", "n3"}}) {
		t.Fatalf("Unreachable = %v, %v", un, err)
	}
	// Every read helper works on a transaction too.
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		_, err := Nodes(ctx, tx, "")
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
}

func TestResetEmptiesEveryTable(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := mustNew(Config{})
	applyAll(t, pool, p, scenario().msgs, 1000)
	var revBefore int64
	pool.QueryRow(ctx, `select max(rev) from fleet_nodes`).Scan(&revBefore)
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.Reset(ctx, tx) }); err != nil {
		t.Fatal(err)
	}
	for _, table := range DigestTables {
		var n int
		if err := pool.QueryRow(ctx, "select count(*) from "+table).Scan(&n); err != nil {
			t.Fatal(err)
		}
		if n != 0 {
			t.Errorf("%s has %d rows after Reset", table, n)
		}
	}
	// Replayed rows take revs above every rev seen before the reset.
	applyAll(t, pool, p, scenario().msgs, 1000)
	var revMin int64
	pool.QueryRow(ctx, `select min(rev) from fleet_nodes`).Scan(&revMin)
	if revMin <= revBefore {
		t.Fatalf("replayed rev %d is not above %d", revMin, revBefore)
	}
}

func TestConfigValidate(t *testing.T) {
	for _, c := range []struct {
		cfg Config
		ok  bool
	}{
		{Config{}, true},
		{Config{SuspectAfter: 10 * time.Second, UnreachableAfter: 20 * time.Second, ClockSlack: time.Second}, true},
		{Config{SuspectAfter: 90 * time.Second}, false}, // above the default UnreachableAfter
		{Config{UnreachableAfter: 25 * time.Second}, false},
		{Config{SuspectAfter: -time.Second}, false},
		{Config{ClockSlack: -time.Second}, false},
		{Config{SuspectAfter: time.Nanosecond}, false},
	} {
		if err := c.cfg.Validate(); (err == nil) != c.ok {
			t.Errorf("Validate(%+v) = %v", c.cfg, err)
		}
	}
}

// mustNew is New for the tests' configurations, all valid.
func mustNew(cfg Config) *Projector {
	p, err := New(cfg)
	if err != nil {
		panic(err)
	}
	return p
}

// TestNewConfig: New refuses each negative duration, naming it; a zero
// one takes its default.
func TestNewConfig(t *testing.T) {
	for field, c := range map[string]Config{
		"SuspectAfter":     {SuspectAfter: -1},
		"UnreachableAfter": {UnreachableAfter: -1},
		"ClockSlack":       {ClockSlack: -1},
		"SweepTick":        {SweepTick: -1},
	} {
		if _, err := New(c); err == nil || !strings.Contains(err.Error(), "fleet: "+field+" -1ns is negative; set 0 for the default") {
			t.Errorf("%s negative: New returned %v, want an error naming it and saying what to set", field, err)
		}
	}
	c := mustNew(Config{}).cfg
	if c.SuspectAfter != DefaultSuspectAfter || c.UnreachableAfter != DefaultUnreachableAfter ||
		c.ClockSlack != DefaultClockSlack || c.SweepTick != DefaultSweepTick || c.Logger == nil {
		t.Errorf("defaults %+v", c)
	}
}

// TestPoolsKeepNodesApart: a node is (pool, node id). A node of pool
// "sandbox" named like a node of pool "prod" has a row, devices, liveness
// and reports of its own; nothing it sends changes prod's node, whether
// its events are folded with others or go to the single-statement path
// (one message per batch).
func TestPoolsKeepNodesApart(t *testing.T) {
	for _, n := range []int{1, 1000} {
		t.Run(fmt.Sprintf("batch%d", n), func(t *testing.T) {
			pool, _ := testenv.Pool(t)
			ctx := context.Background()
			p := mustNew(Config{})
			s := newStream()
			s.at(0).connect("prod", "n1", "gw-1", "s-prod", map[string]string{"tier": "prod"},
				gpu(0, "A100", 81920, okH), gpu(1, "A100", 81920, okH))
			s.at(time.Second).liveness("prod", "gw-1", heard{"n1", "s-prod", 0})
			s.at(2*time.Second).alloc("prod", "n1", "gw-1", "s-prod", "alloc-prod", fleetpb.AllocationState_ALLOCATION_STATE_BOUND, "")
			applyAll(t, pool, p, s.msgs, n)
			before, err := Show(ctx, pool, "prod", "n1")
			if err != nil {
				t.Fatal(err)
			}
			reportsBefore := reportRows(t, pool, "prod")

			mark := len(s.msgs)
			s.at(5*time.Second).connect("sandbox", "n1", "gw-2", "s-sandbox", map[string]string{"tier": "sandbox"},
				gpu(0, "T4", 16384, okH))
			s.at(6*time.Second).status("sandbox", "n1", "gw-2", "s-sandbox", "h-bad",
				[]*fleetpb.GpuState{{Index: 0, Health: failedH}, {Index: 1, Health: failedH}})
			s.at(7*time.Second).alloc("sandbox", "n1", "gw-2", "s-sandbox", "alloc-prod", fleetpb.AllocationState_ALLOCATION_STATE_UNBOUND, "")
			for d := 10 * time.Second; d <= 40*time.Second; d += 5 * time.Second {
				s.at(d).liveness("sandbox", "gw-2", heard{"n1", "s-sandbox", 0})
			}
			s.at(41*time.Second).disconnect("sandbox", "n1", "gw-2", "s-sandbox", "closed")
			applyAll(t, pool, p, s.msgs[mark:], n)

			after, err := Show(ctx, pool, "prod", "n1")
			if err != nil {
				t.Fatal(err)
			}
			// The stream's own sweeps age prod's node, which nobody heard
			// since 1 s: that is its own silence, not sandbox's doing.
			if after.State != StateSuspect || !after.StateSince.Equal(t0.Add(time.Second+DefaultSuspectAfter)) {
				t.Errorf("prod/n1 is %s since %s, want suspect since %s (sandbox's heartbeats must not keep it alive)",
					after.State, after.StateSince, t0.Add(time.Second+DefaultSuspectAfter))
			}
			before.State, before.StateSince, before.Rev = after.State, after.StateSince, after.Rev
			if !equalNodes(before, after) {
				t.Fatalf("sandbox/n1 changed prod/n1:\nbefore %+v\nafter  %+v", before, after)
			}
			if got := reportRows(t, pool, "prod"); !slices.Equal(got, reportsBefore) {
				t.Fatalf("prod's reports changed: %v, was %v", got, reportsBefore)
			}
			sb, err := Show(ctx, pool, "sandbox", "n1")
			if err != nil {
				t.Fatal(err)
			}
			if sb.Connected || sb.State != StateHealthy || len(sb.Devices) != 1 || sb.Devices[0].Model != "T4" ||
				sb.Devices[0].Health != "failed" || sb.Labels["tier"] != "sandbox" || !sb.LastSeen.Equal(t0.Add(40*time.Second)) {
				t.Fatalf("sandbox/n1 = %+v", sb)
			}
			if got := reportRows(t, pool, "sandbox"); !slices.Equal(got, []string{"alloc-prod sandbox/n1 unbound"}) {
				t.Fatalf("sandbox's reports = %v", got)
			}
			nodes, err := Nodes(ctx, pool, "")
			if err != nil || len(nodes) != 2 || nodes[0].Pool != "prod" || nodes[1].Pool != "sandbox" {
				t.Fatalf("Nodes = %+v, %v; want prod/n1 and sandbox/n1", nodes, err)
			}
		})
	}
}

// reportRows lists the allocation reports of a pool's nodes.
func reportRows(t testing.TB, q Querier, pool string) []string {
	t.Helper()
	rows, err := q.Query(context.Background(), `select allocation_id || ' ' || pool || '/' || node_id || ' ' || state
		from fleet_allocation_reports where pool = $1 order by 1`, pool)
	if err != nil {
		t.Fatal(err)
	}
	out, err := pgx.CollectRows(rows, pgx.RowTo[string])
	if err != nil {
		t.Fatal(err)
	}
	return out
}

// TestConnectedStoresHeld: a Connected stores the allocations the node
// holds (sorted, once each) and its stored time; other events keep them;
// the next Connected replaces them, whatever the batch boundaries.
func TestConnectedStoresHeld(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	s := newStream()
	connect := func(session string, allocs ...string) {
		s.node("p", "n", "gw-1", session, &fleetpb.NodeEvent{Body: &fleetpb.NodeEvent_Connected{
			Connected: &fleetpb.NodeConnected{Gpus: []*fleetpb.Gpu{gpu(0, "A10", 24576, okH)}, Allocations: allocs}}})
	}
	held := func() (ids []string, at *time.Time) {
		t.Helper()
		if err := pool.QueryRow(ctx, `select held_allocations, held_at from fleet_nodes where pool = 'p' and node_id = 'n'`).Scan(&ids, &at); err != nil {
			t.Fatal(err)
		}
		return ids, at
	}
	s.at(0)
	connect("s-1", "r2/1/0.b", "r1/1/0.a", "r2/1/0.b")
	s.at(time.Second).status("p", "n", "gw-1", "s-1", "h1", nil)
	p := mustNew(Config{})
	applyAll(t, pool, p, s.msgs, 1)
	ids, at := held()
	if !slices.Equal(ids, []string{"r1/1/0.a", "r2/1/0.b"}) || at == nil || !at.Equal(t0) {
		t.Fatalf("after the first Connected: held %q at %v, want [r1/1/0.a r2/1/0.b] at %v", ids, at, t0)
	}

	mark := len(s.msgs)
	s.at(5 * time.Second)
	connect("s-2") // rebooted: holds nothing
	s.at(6*time.Second).status("p", "n", "gw-1", "s-2", "h2", nil)
	applyAll(t, pool, p, s.msgs[mark:], 1)
	ids, at = held()
	if len(ids) != 0 || at == nil || !at.Equal(t0.Add(5*time.Second)) {
		t.Fatalf("after the second Connected: held %q at %v, want [] at %v", ids, at, t0.Add(5*time.Second))
	}
	live := digestOf(t, pool)

	truncate(t, pool)
	applyAll(t, pool, mustNew(Config{}), s.msgs, 1000)
	if got := digestOf(t, pool); !maps.Equal(got, live) {
		t.Errorf("one batch differs from one message at a time:\n got  %v\n want %v", got, live)
	}
	truncate(t, pool)
	applyAll(t, pool, mustNew(Config{}), s.msgs[:mark], 1000)
	if got := digestOf(t, pool); got["fleet_nodes"] == live["fleet_nodes"] {
		t.Errorf("the digest of fleet_nodes does not cover what the node holds")
	}
}

// TestIdle: the projector says its sweeps have nothing to do only after a
// sweep that found no liveness clock, and not once a batch is applied or
// a transaction did not commit.
func TestIdle(t *testing.T) {
	pool, _ := testenv.Pool(t)
	p := mustNew(Config{})
	if p.Idle() {
		t.Fatal("idle before any sweep")
	}
	sweep(t, pool, p, t0)
	if !p.Idle() {
		t.Fatal("not idle after a sweep of an empty projection")
	}
	s := scenario()
	applyAll(t, pool, p, s.msgs, 1000)
	if p.Idle() {
		t.Fatal("idle after a batch")
	}
	sweep(t, pool, p, end)
	if p.Idle() {
		t.Fatal("idle after a sweep with a liveness clock")
	}
	truncate(t, pool)
	sweep(t, pool, p, end)
	p.Aborted()
	if p.Idle() {
		t.Fatal("idle after Aborted")
	}
}
