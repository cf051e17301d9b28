package commits

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc/codes"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/compactor"
	commitspb "github.com/millrace/millrace/schemas/commits"
	"github.com/millrace/millrace/subjects"
)

// A test-only import of the compactor: it makes the bucket state the edge
// reads (the edge itself depends on commitlog/layout alone).

func fold(t *testing.T, js jetstream.JetStream, bk *bucket.Bucket, world string) commitlog.FoldStats {
	t.Helper()
	st, err := commitlog.FoldWorld(context.Background(), js, compactor.MustNew(compactor.Config{ShardDocs: 2, HistoryVersions: 2}, bk), world)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func memBucket(t testing.TB) *bucket.Bucket {
	t.Helper()
	bk, err := bucket.Open(context.Background(), "mem://")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bk.Close() })
	return bk
}

func TestReadsFoldedVersions(t *testing.T) {
	bk := memBucket(t)
	e := startEdge(t, Config{Store: bk})
	ctx := as(keyW1)
	put := func(id, body string) uint64 {
		t.Helper()
		r, err := e.client.Put(ctx, &commitspb.PutRequest{World: "w1", Id: id, Body: []byte(body)})
		if err != nil {
			t.Fatal(err)
		}
		return r.Version
	}
	var versions []uint64
	for i := range 5 {
		versions = append(versions, put("a", fmt.Sprint("a", i)))
	}
	put("b", "b0")
	c := put("c", "c0")
	if _, err := e.client.Delete(ctx, &commitspb.DeleteRequest{World: "w1", Id: "c"}); err != nil {
		t.Fatal(err)
	}
	if st := fold(t, e.js, bk, "w1"); st.Dropped != 5 { // a's first four, c's put
		t.Fatalf("the pass dropped %d versions, want 5", st.Dropped)
	}
	stream, _ := e.js.Stream(context.Background(), subjects.StreamCommits)
	if _, err := stream.GetMsg(context.Background(), versions[1]); !errors.Is(err, jetstream.ErrMsgNotFound) {
		t.Fatalf("version %d is still in the stream (%v): the test reads nothing from the bucket", versions[1], err)
	}
	after := put("a", "a5")
	versions = append(versions, after)

	// Every version of a, folded or not.
	for i, v := range versions {
		d, err := e.client.Get(ctx, &commitspb.GetRequest{World: "w1", Id: "a", Version: v})
		if err != nil || string(d.Body) != fmt.Sprint("a", i) || d.Version != v {
			t.Fatalf("version %d of a: %v, %v", v, d, err)
		}
	}
	if d, err := e.client.Get(ctx, &commitspb.GetRequest{World: "w1", Id: "c", Version: c}); err != nil || string(d.Body) != "c0" {
		t.Fatalf("the folded version of deleted c: %v, %v", d, err)
	}
	if _, err := e.client.Get(ctx, &commitspb.GetRequest{World: "w1", Id: "b", Version: versions[1]}); code(err) != codes.NotFound {
		t.Fatalf("a's folded version asked as b's: %v", err)
	}
	if _, err := e.client.Get(ctx, &commitspb.GetRequest{World: "w1", Id: "c"}); code(err) != codes.NotFound {
		t.Fatalf("deleted c: %v", err)
	}

	// History pages across the bucket and the stream.
	var listed []uint64
	var afterV uint64
	for pages := 0; ; pages++ {
		h, err := e.client.History(ctx, &commitspb.HistoryRequest{World: "w1", Id: "a", AfterVersion: afterV, PageSize: 4})
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range h.Versions {
			listed = append(listed, v.Version)
		}
		if h.NextAfterVersion == 0 || pages > 5 {
			break
		}
		afterV = h.NextAfterVersion
	}
	if fmt.Sprint(listed) != fmt.Sprint(versions) {
		t.Fatalf("history of a: %v, want %v", listed, versions)
	}
	if testenv.Metric(t, e.reg, "millrace_commits_folded_reads_total") == 0 {
		t.Fatal("no read counted as answered from the bucket")
	}
}

func listAll(t *testing.T, e *edge, prefix string, pageSize uint32) []string {
	t.Helper()
	var out []string
	after := ""
	for {
		r, err := e.client.List(as(keyW1), &commitspb.ListRequest{World: "w1", Prefix: prefix, AfterId: after, PageSize: pageSize})
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range r.Docs {
			out = append(out, fmt.Sprintf("%s@%d", d.Id, d.Version))
		}
		if r.NextAfterId == "" {
			return out
		}
		if len(r.Docs) != int(pageSize) {
			t.Fatalf("a page of %d documents with a next page (page size %d)", len(r.Docs), pageSize)
		}
		after = r.NextAfterId
	}
}

func TestListOpensFromTheCheckpoint(t *testing.T) {
	bk := memBucket(t)
	e := startEdge(t, Config{Store: bk})
	ctx := as(keyW1)
	want := map[string]uint64{}
	put := func(id string) {
		t.Helper()
		r, err := e.client.Put(ctx, &commitspb.PutRequest{World: "w1", Id: id, Body: []byte("x")})
		if err != nil {
			t.Fatal(err)
		}
		want[id] = r.Version
	}
	for _, id := range []string{"b/2", "a", "b/1", "c", "b/3", "b/1", "d"} {
		put(id)
	}
	if _, err := e.client.Delete(ctx, &commitspb.DeleteRequest{World: "w1", Id: "d"}); err != nil {
		t.Fatal(err)
	}
	delete(want, "d")
	fold(t, e.js, bk, "w1")
	put("b/0") // the tail after the checkpoint
	expect := func(ids ...string) []string {
		var out []string
		for _, id := range ids {
			out = append(out, fmt.Sprintf("%s@%d", id, want[id]))
		}
		return out
	}

	// A new edge: its world opens from the checkpoint plus one message.
	cold := serveEdge(t, Config{Store: bk}, e.js)
	if got := listAll(t, cold, "", 2); fmt.Sprint(got) != fmt.Sprint(expect("a", "b/0", "b/1", "b/2", "b/3", "c")) {
		t.Fatalf("list: %v", got)
	}
	w := cold.srv.index.worlds["w1"]
	w.mu.Lock()
	tail := w.tail
	w.mu.Unlock()
	if tail != 1 {
		t.Fatalf("the world opened with %d messages read from the stream, want 1 (the rest from the checkpoint)", tail)
	}
	if got := listAll(t, cold, "b/", 1); fmt.Sprint(got) != fmt.Sprint(expect("b/0", "b/1", "b/2", "b/3")) {
		t.Fatalf("list b/: %v", got)
	}

	// Writes acknowledged before a List are in it, on any edge.
	put("b/4")
	put("a")
	if _, err := e.client.Delete(ctx, &commitspb.DeleteRequest{World: "w1", Id: "c"}); err != nil {
		t.Fatal(err)
	}
	delete(want, "c")
	if got := listAll(t, cold, "", 100); fmt.Sprint(got) != fmt.Sprint(expect("a", "b/0", "b/1", "b/2", "b/3", "b/4")) {
		t.Fatalf("list after writes: %v", got)
	}
	if got := listAll(t, cold, "b/3", 10); fmt.Sprint(got) != fmt.Sprint(expect("b/3")) {
		t.Fatalf("list b/3: %v", got)
	}
	if got := listAll(t, e, "zz", 10); len(got) != 0 {
		t.Fatalf("list zz: %v", got)
	}

	// Over HTTP.
	h := httptest.NewServer(cold.srv.Handler())
	defer h.Close()
	resp, body := httpClient{t, h, keyW1}.do("GET", Prefix+"w1/docs?prefix=b%2F&page_size=2", "")
	if resp.StatusCode != 200 || !strings.Contains(body, `"id":"b/0"`) || !strings.Contains(body, `"next_after_id":"b/1"`) {
		t.Fatalf("HTTP list: %d %s", resp.StatusCode, body)
	}

	// Bad input.
	if _, err := cold.client.List(ctx, &commitspb.ListRequest{World: "w1", PageSize: MaxPageSize + 1}); code(err) != codes.InvalidArgument {
		t.Fatalf("page size over the limit: %v", err)
	}
	if _, err := cold.client.List(as("not-a-key-at-all-000"), &commitspb.ListRequest{World: "w1"}); code(err) != codes.Unauthenticated {
		t.Fatalf("bad key: %v", err)
	}
	if _, err := cold.client.List(as(keyW1), &commitspb.ListRequest{World: "w2"}); code(err) != codes.PermissionDenied {
		t.Fatalf("other world: %v", err)
	}
}

// The least recently listed world closes when more than IndexWorlds are
// open, and opens again when listed.
func TestListEvictsWorlds(t *testing.T) {
	e := startEdge(t, Config{IndexWorlds: 2})
	ctx := as(keyAll)
	for i := range 4 {
		world := fmt.Sprint("w", i)
		if _, err := e.client.Put(ctx, &commitspb.PutRequest{World: world, Id: "x", Body: []byte("x")}); err != nil {
			t.Fatal(err)
		}
		r, err := e.client.List(ctx, &commitspb.ListRequest{World: world})
		if err != nil || len(r.Docs) != 1 {
			t.Fatalf("list %s: %v, %v", world, r, err)
		}
		time.Sleep(time.Millisecond) // distinct last-use times
	}
	e.srv.index.mu.Lock()
	n := len(e.srv.index.worlds)
	e.srv.index.mu.Unlock()
	if n > 2 {
		t.Fatalf("%d worlds open, more than IndexWorlds 2", n)
	}
	if r, err := e.client.List(ctx, &commitspb.ListRequest{World: "w0"}); err != nil || len(r.Docs) != 1 {
		t.Fatalf("list w0 again: %v, %v", r, err)
	}
}

// A List waits for the world's index to apply every write acknowledged
// before it, even when the index is slow to apply what it receives.
func TestListWaitsForItsWorld(t *testing.T) {
	e := startEdge(t, Config{})
	ctx := as(keyW1)
	if _, err := e.client.Put(ctx, &commitspb.PutRequest{World: "w1", Id: "a", Body: []byte("x")}); err != nil {
		t.Fatal(err)
	}
	if got := listAll(t, e, "", 10); len(got) != 1 {
		t.Fatalf("list: %v", got)
	}
	applyHook = func() { time.Sleep(30 * time.Millisecond) }
	defer func() { applyHook = nil }()
	for i := range 5 {
		id := fmt.Sprint("b", i)
		r, err := e.client.Put(ctx, &commitspb.PutRequest{World: "w1", Id: id, Body: []byte("x")})
		if err != nil {
			t.Fatal(err)
		}
		got := listAll(t, e, id, 10)
		if len(got) != 1 || got[0] != fmt.Sprintf("%s@%d", id, r.Version) {
			t.Fatalf("list right after the put of %s@%d: %v", id, r.Version, got)
		}
	}
}
