package placer

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"
)

// TestReleaseWaitsForUnbound: a released allocation's GPUs are not booked
// again until its own node reports UNBOUND; a sibling's report does not
// count; the gateways are asked again while it waits.
func TestReleaseWaitsForUnbound(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	e.addNode("n2", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{UnbindRetry: 10 * time.Second})
	e.apply(p, e.request("r", "p", 4))
	e.report("r/1/0", "bound")
	e.apply(p, e.request("filler", "p", 4)) // n2 is full too
	e.apply(p, e.cancel("r", "p"), e.request("next", "p", 4))
	if got := e.liveOf("next"); got != nil {
		t.Fatalf("next on %v before n1 confirmed the unbind of r", got)
	}
	e.reportAs("p", "n2", "r/1/0", "unbound") // a sibling cannot confirm it
	e.sweep(p)
	if got := e.liveOf("next"); got != nil {
		t.Fatalf("next on %v after a sibling's UNBOUND", got)
	}
	var booked int
	e.pool.QueryRow(context.Background(), `select count(*) from fleet_bookings where node_id = 'n1' and reservation_id = 'r'`).Scan(&booked)
	if booked != 4 {
		t.Errorf("%d bookings of r left on n1, want 4 (releasing)", booked)
	}
	e.checkIndex(p)
	e.advance(11 * time.Second)
	e.sweep(p)
	if d := e.decisions(); !slices.Contains(d, "r unbind-again n1:r/1/0") {
		t.Errorf("no UnbindAgain after the retry: %q", d)
	}
	e.report("r/1/0", "unbound")
	e.sweep(p)
	if got := e.liveOf("next"); !slices.Equal(got, []string{"n1:[0 1 2 3]"}) {
		t.Errorf("next on %v after n1 confirmed, want n1", got)
	}
	if d := e.decisions(); !slices.Contains(d, "r/1/0/freed freed unbound [r/1/0] fenced=[]") {
		t.Errorf("no Freed: %q", d)
	}
	e.checkInvariants()
	e.checkIndex(p)
	live := e.digest()
	if got := e.replay(1); !mapsEqual(got, live) {
		t.Errorf("replay differs:\n got  %v\n want %v", got, live)
	}
}

// TestUnreachableFreesAndFences: a releasing allocation on a node declared
// unreachable is freed and fences the node; when the node is back, it is
// asked to drop the allocation and takes nothing new until it has.
func TestUnreachableFreesAndFences(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{UnbindRetry: 10 * time.Second})
	e.apply(p, e.request("r", "p", 4))
	e.report("r/1/0", "bound")
	e.apply(p, e.cancel("r", "p"))
	e.setNode("n1", "unreachable", false)
	e.sweep(p)
	if d := e.decisions(); !slices.Contains(d, "r/1/0/freed freed node_unreachable [r/1/0] fenced=[r/1/0]") {
		t.Fatalf("no fencing Freed: %q", d)
	}
	var booked, fences int
	e.pool.QueryRow(context.Background(), `select count(*) from fleet_bookings where node_id = 'n1'`).Scan(&booked)
	e.pool.QueryRow(context.Background(), `select count(*) from fleet_fences where pool = 'p' and node_id = 'n1'`).Scan(&fences)
	if booked != 0 || fences != 1 {
		t.Errorf("n1: %d bookings, %d fences; want 0 and 1", booked, fences)
	}
	// Back, still holding r as far as anyone knows: fenced.
	e.setNode("n1", "healthy", true)
	e.apply(p, e.request("next", "p", 4))
	if got := e.liveOf("next"); got != nil {
		t.Fatalf("next on %v: n1 is fenced", got)
	}
	e.checkIndex(p)
	e.sweep(p) // first sight of the fence on a connected node starts the retry clock
	e.advance(11 * time.Second)
	e.sweep(p)
	if d := e.decisions(); !slices.Contains(d, "r unbind-again n1:r/1/0") {
		t.Errorf("the fenced node was not asked to drop r: %q", d)
	}
	e.report("r/1/0", "unbound")
	e.sweep(p)
	if d := e.decisions(); !slices.ContainsFunc(d, func(s string) bool { return strings.HasPrefix(s, "r/1/0/unfenced unfenced n1") }) {
		t.Errorf("no Unfenced: %q", d)
	}
	if got := e.liveOf("next"); !slices.Equal(got, []string{"n1:[0 1 2 3]"}) {
		t.Errorf("next on %v after the unfence, want n1", got)
	}
	e.checkInvariants()
	e.checkIndex(p)
	live := e.digest()
	if got := e.replay(2); !mapsEqual(got, live) {
		t.Errorf("replay differs:\n got  %v\n want %v", got, live)
	}
}

// TestNodeLostReplaces: an allocation its node reported BOUND, and that
// the node's next Connected does not list (it rebooted), is released
// ("node_lost", requeued) and placed elsewhere once the node has had
// BindTimeout to bind again what the gateway re-sent; one the Connected
// lists, or bound again after it, is left alone.
func TestNodeLostReplaces(t *testing.T) {
	e := newEnv(t)
	e.addNode("n1", "p", 4, "H100", 80000, nil)
	e.addNode("n2", "p", 4, "H100", 80000, nil)
	e.addNode("n3", "p", 4, "H100", 80000, nil)
	e.addNode("n4", "p", 4, "H100", 80000, nil)
	p := e.placer(Config{BindTimeout: 30 * time.Second})
	e.apply(p, e.request("r", "p", 4), e.request("q", "p", 4), e.request("s", "p", 4))
	for rid, node := range map[string]string{"r": "n1", "q": "n2", "s": "n3"} {
		if got := e.liveOf(rid); len(got) != 1 || !strings.HasPrefix(got[0], node+":") {
			t.Fatalf("%s on %v, want %s", rid, got, node)
		}
		e.report(rid+"/1/0", "bound")
	}
	e.advance(time.Second)
	e.held("n1")                     // rebooted: holds nothing
	e.held("n2", e.allocID("q/1/0")) // re-homed: still holds q
	e.held("n3")                     // rebooted too, but binds s again (the gateway re-sent it)
	e.advance(time.Second)
	e.report("s/1/0", "bound")
	e.sweep(p)
	if d := e.decisions(); slices.ContainsFunc(d, func(s string) bool { return strings.Contains(s, "node_lost") }) {
		t.Fatalf("released before the node had BindTimeout to bind again: %q", d)
	}
	e.advance(30 * time.Second)
	e.sweep(p)
	d := e.decisions()
	if !slices.Contains(d, "r/release/1 released node_lost requeued=true [r/1/0]") {
		t.Errorf("r, lost by n1, not released node_lost: %q", d)
	}
	if !slices.Contains(d, "r/place/2 placed n4:[0 1 2 3]") {
		t.Errorf("r not placed again on n4: %q", d)
	}
	for _, rid := range []string{"q", "s"} {
		if slices.ContainsFunc(d, func(s string) bool { return strings.HasPrefix(s, rid+"/release/") }) {
			t.Errorf("%s released, though its node holds it: %q", rid, d)
		}
	}
	// Releasing until n1 answers the Unbind (it holds nothing: UNBOUND).
	var booked int
	e.pool.QueryRow(context.Background(), `select count(*) from fleet_bookings where node_id = 'n1'`).Scan(&booked)
	if booked != 4 {
		t.Errorf("%d bookings left on n1 before its UNBOUND, want 4 (releasing)", booked)
	}
	e.report("r/1/0", "unbound")
	e.sweep(p)
	if d := e.decisions(); !slices.Contains(d, "r/1/0/freed freed unbound [r/1/0] fenced=[]") {
		t.Errorf("no Freed after n1's UNBOUND: %q", d)
	}
	// Each Connected is looked at: n4, checked with nothing to release
	// above, loses r's new allocation at its next one.
	e.report("r/2/0", "bound")
	e.advance(time.Second)
	e.held("n4")
	e.advance(31 * time.Second)
	e.sweep(p)
	if d := e.decisions(); !slices.Contains(d, "r/release/2 released node_lost requeued=true [r/2/0]") {
		t.Errorf("r, lost by n4 at its next Connected, not released: %q", d)
	}
	e.checkInvariants()
	e.checkIndex(p)
	live := e.digest()
	if got := e.replay(1); !mapsEqual(got, live) {
		t.Errorf("replay differs:\n got  %v\n want %v", got, live)
	}
}
