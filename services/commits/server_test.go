package commits

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/testenv"
	commitspb "github.com/millrace/millrace/schemas/commits"
)

func code(err error) codes.Code { return status.Code(err) }

// conflictOf returns the Conflict detail of a FAILED_PRECONDITION.
func conflictOf(t *testing.T, err error) *commitspb.Conflict {
	t.Helper()
	st, _ := status.FromError(err)
	if st.Code() != codes.FailedPrecondition {
		t.Fatalf("got %v, want FAILED_PRECONDITION", err)
	}
	for _, d := range st.Details() {
		if c, ok := d.(*commitspb.Conflict); ok {
			return c
		}
	}
	t.Fatalf("conflict %v carries no Conflict detail", err)
	return nil
}

func TestPutGetAndCompareAndSet(t *testing.T) {
	e := startEdge(t, Config{})
	ctx := as(keyW1)
	put := func(id, body string, expected *uint64) (*commitspb.PutResponse, error) {
		return e.client.Put(ctx, &commitspb.PutRequest{World: "w1", Id: id, Body: []byte(body), ExpectedVersion: expected})
	}

	v1, err := put("doc/ü.1", "one", ptr[uint64](0))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := put("doc/ü.1", "again", ptr[uint64](0)); conflictOf(t, err).GetCurrentVersion() != v1.Version {
		t.Fatalf("create over an existing document: %v", err)
	}
	v2, err := put("doc/ü.1", "two", ptr(v1.Version))
	if err != nil || v2.Version <= v1.Version {
		t.Fatalf("put over the current version: %v, %v", v2, err)
	}
	if _, err := put("doc/ü.1", "stale", ptr(v1.Version)); conflictOf(t, err).GetCurrentVersion() != v2.Version {
		t.Fatalf("put over a stale version: %v", err)
	}
	if _, err := put("other", "x", ptr[uint64](5)); conflictOf(t, err).GetCurrentVersion() != 0 {
		t.Fatalf("put over a version of a document that does not exist: %v", err)
	}
	v3, err := put("doc/ü.1", "three, unconditional", nil)
	if err != nil {
		t.Fatal(err)
	}

	d, err := e.client.Get(ctx, &commitspb.GetRequest{World: "w1", Id: "doc/ü.1"})
	if err != nil || d.Version != v3.Version || string(d.Body) != "three, unconditional" || d.Deleted {
		t.Fatalf("latest: %v, %v", d, err)
	}
	d, err = e.client.Get(ctx, &commitspb.GetRequest{World: "w1", Id: "doc/ü.1", Version: v1.Version})
	if err != nil || string(d.Body) != "one" || d.CommittedAt == nil {
		t.Fatalf("version %d: %v, %v", v1.Version, d, err)
	}
	other, _ := put("other", "x", nil)
	if _, err := e.client.Get(ctx, &commitspb.GetRequest{World: "w1", Id: "doc/ü.1", Version: other.Version}); code(err) != codes.NotFound {
		t.Fatalf("another document's version: %v, want NOT_FOUND", err)
	}
	if _, err := e.client.Get(ctx, &commitspb.GetRequest{World: "w1", Id: "nothing"}); code(err) != codes.NotFound {
		t.Fatalf("a document that does not exist: %v, want NOT_FOUND", err)
	}
}

func TestDeleteAndRecreate(t *testing.T) {
	e := startEdge(t, Config{})
	ctx := as(keyAll)
	v1, err := e.client.Put(ctx, &commitspb.PutRequest{World: "w2", Id: "d", Body: []byte("a")})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.Delete(ctx, &commitspb.DeleteRequest{World: "w2", Id: "d", ExpectedVersion: ptr(v1.Version + 100)}); code(err) != codes.FailedPrecondition {
		t.Fatalf("delete over a wrong version: %v", err)
	}
	tomb, err := e.client.Delete(ctx, &commitspb.DeleteRequest{World: "w2", Id: "d", ExpectedVersion: ptr(v1.Version)})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.client.Get(ctx, &commitspb.GetRequest{World: "w2", Id: "d"}); code(err) != codes.NotFound || !strings.Contains(err.Error(), "deleted") {
		t.Fatalf("get of a deleted document: %v", err)
	}
	if d, err := e.client.Get(ctx, &commitspb.GetRequest{World: "w2", Id: "d", Version: tomb.Version}); err != nil || !d.Deleted {
		t.Fatalf("the tombstone itself: %v, %v", d, err)
	}
	// Expected 0 ("must not exist") accepts a deleted document...
	v3, err := e.client.Put(ctx, &commitspb.PutRequest{World: "w2", Id: "d", Body: []byte("b"), ExpectedVersion: ptr[uint64](0)})
	if err != nil || v3.Version <= tomb.Version {
		t.Fatalf("re-create over the tombstone: %v, %v", v3, err)
	}
	// ...and says so in a conflict once it exists again.
	c := conflictOf(t, func() error {
		_, err := e.client.Put(ctx, &commitspb.PutRequest{World: "w2", Id: "d", ExpectedVersion: ptr[uint64](0)})
		return err
	}())
	if c.CurrentVersion != v3.Version || c.Deleted {
		t.Fatalf("conflict %v, want version %d, not deleted", c, v3.Version)
	}

	h, err := e.client.History(ctx, &commitspb.HistoryRequest{World: "w2", Id: "d"})
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, v := range h.Versions {
		got = append(got, fmt.Sprintf("%d:%v:%d", v.Version, v.Deleted, v.Size))
	}
	want := []string{fmt.Sprintf("%d:false:1", v1.Version), fmt.Sprintf("%d:true:0", tomb.Version), fmt.Sprintf("%d:false:1", v3.Version)}
	if strings.Join(got, " ") != strings.Join(want, " ") || h.NextAfterVersion != 0 {
		t.Fatalf("history %v (next %d), want %v", got, h.NextAfterVersion, want)
	}
}

func TestHistoryPages(t *testing.T) {
	e := startEdge(t, Config{})
	ctx := as(keyW1)
	var versions []uint64
	for i := range 7 {
		r, err := e.client.Put(ctx, &commitspb.PutRequest{World: "w1", Id: "h", Body: []byte{byte(i)}})
		if err != nil {
			t.Fatal(err)
		}
		versions = append(versions, r.Version)
		if _, err := e.client.Put(ctx, &commitspb.PutRequest{World: "w1", Id: "noise", Body: []byte{byte(i)}}); err != nil {
			t.Fatal(err)
		}
	}
	var got []uint64
	after := uint64(0)
	for pages := 0; ; pages++ {
		h, err := e.client.History(ctx, &commitspb.HistoryRequest{World: "w1", Id: "h", AfterVersion: after, PageSize: 3})
		if err != nil {
			t.Fatal(err)
		}
		for _, v := range h.Versions {
			got = append(got, v.Version)
		}
		if h.NextAfterVersion == 0 {
			break
		}
		if pages > 5 {
			t.Fatal("history pages do not end")
		}
		after = h.NextAfterVersion
	}
	if fmt.Sprint(got) != fmt.Sprint(versions) {
		t.Fatalf("paged history %v, want %v", got, versions)
	}
	if _, err := e.client.History(ctx, &commitspb.HistoryRequest{World: "w1", Id: "h", PageSize: MaxPageSize + 1}); code(err) != codes.InvalidArgument {
		t.Fatalf("oversized page: %v", err)
	}
}

// A resend with the same request id answers the first put's version, even
// with compare-and-set (its expected version is no longer current).
func TestRequestIDMakesResendANoop(t *testing.T) {
	e := startEdge(t, Config{})
	ctx := as(keyW1)
	req := &commitspb.PutRequest{World: "w1", Id: "r", Body: []byte("x"), ExpectedVersion: ptr[uint64](0), RequestId: "req-1"}
	first, err := e.client.Put(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	again, err := e.client.Put(ctx, req)
	if err != nil || again.Version != first.Version || !again.Duplicate {
		t.Fatalf("resend: %v, %v; want version %d, duplicate", again, err, first.Version)
	}
	// With a version to replace: the resend's expected version is stale,
	// but the write it repeats is the current version.
	second := &commitspb.PutRequest{World: "w1", Id: "r", Body: []byte("y"), ExpectedVersion: ptr(first.Version), RequestId: "req-2"}
	v2, err := e.client.Put(ctx, second)
	if err != nil {
		t.Fatal(err)
	}
	if again, err := e.client.Put(ctx, second); err != nil || again.Version != v2.Version || !again.Duplicate {
		t.Fatalf("resend of a conditional put: %v, %v; want version %d, duplicate", again, err, v2.Version)
	}
	h, _ := e.client.History(ctx, &commitspb.HistoryRequest{World: "w1", Id: "r"})
	if len(h.GetVersions()) != 2 {
		t.Fatalf("%d versions after two puts and their resends, want 2", len(h.GetVersions()))
	}
}

func TestAuthAndBadInput(t *testing.T) {
	e := startEdge(t, Config{MaxBodyBytes: 1000})
	for _, c := range []struct {
		name string
		ctx  context.Context
		req  *commitspb.PutRequest
		want codes.Code
		text string
	}{
		{"no key", context.Background(), &commitspb.PutRequest{World: "w1", Id: "a"}, codes.Unauthenticated, "needs an API key"},
		{"unknown key", as("not-a-key-at-all-xxxx"), &commitspb.PutRequest{World: "w1", Id: "a"}, codes.Unauthenticated, "not valid"},
		{"another world's key", as(keyW1), &commitspb.PutRequest{World: "w2", Id: "a"}, codes.PermissionDenied, `world "w2"`},
		{"empty id", as(keyW1), &commitspb.PutRequest{World: "w1"}, codes.InvalidArgument, "id is empty"},
		{"id too long", as(keyW1), &commitspb.PutRequest{World: "w1", Id: strings.Repeat("é", 513)}, codes.InvalidArgument, "more than 1024"},
		{"body too large", as(keyW1), &commitspb.PutRequest{World: "w1", Id: "a", Body: bytes.Repeat([]byte("x"), 1001)}, codes.InvalidArgument, "limit of 1000"},
		{"bad world", as(keyAll), &commitspb.PutRequest{World: "a*b", Id: "a"}, codes.InvalidArgument, "contains"},
		{"request id too long", as(keyW1), &commitspb.PutRequest{World: "w1", Id: "a", RequestId: strings.Repeat("r", 257)}, codes.InvalidArgument, "request id"},
	} {
		_, err := e.client.Put(c.ctx, c.req)
		if code(err) != c.want || !strings.Contains(err.Error(), c.text) {
			t.Errorf("%s: %v, want %v mentioning %q", c.name, err, c.want, c.text)
		}
	}
	// Nothing was stored by any of them.
	if _, err := e.client.Get(as(keyW1), &commitspb.GetRequest{World: "w1", Id: "a"}); code(err) != codes.NotFound {
		t.Fatalf("after refused puts: %v, want NOT_FOUND", err)
	}
	// An id with any character round-trips.
	odd := "a.b *>\x00\n/%41 ドキュメント"
	if _, err := e.client.Put(as(keyW1), &commitspb.PutRequest{World: "w1", Id: odd, Body: []byte("ok")}); err != nil {
		t.Fatal(err)
	}
	if d, err := e.client.Get(as(keyW1), &commitspb.GetRequest{World: "w1", Id: odd}); err != nil || d.Id != odd || string(d.Body) != "ok" {
		t.Fatalf("odd id: %v, %v", d, err)
	}
}

// TestConcurrentWritersThroughTheEdge: writers retry on conflict until
// their increment lands; on one server and on a three-node cluster, the
// final counter equals the number of increments (no lost update), and
// false conflicts of the cluster were retried by the edge, not reported.
func TestConcurrentWritersThroughTheEdge(t *testing.T) {
	for _, c := range []struct {
		name    string
		cluster bool
	}{{"one server", false}, {"three-node cluster R3", true}} {
		t.Run(c.name, func(t *testing.T) {
			var e *edge
			if c.cluster {
				e = startEdge(t, Config{}, testenv.NATSCluster(t, 3)...)
			} else {
				e = startEdge(t, Config{})
			}
			const writers, increments = 5, 30
			var wg sync.WaitGroup
			errc := make(chan error, writers)
			conflicts := make([]int, writers)
			for w := range writers {
				wg.Add(1)
				go func() {
					defer wg.Done()
					ctx := as(keyW1)
					for range increments {
						for {
							var n int
							var expected uint64
							d, err := e.client.Get(ctx, &commitspb.GetRequest{World: "w1", Id: "counter"})
							switch {
							case code(err) == codes.NotFound:
							case err != nil:
								errc <- err
								return
							default:
								fmt.Sscan(string(d.Body), &n)
								expected = d.Version
							}
							_, err = e.client.Put(ctx, &commitspb.PutRequest{World: "w1", Id: "counter",
								Body: []byte(fmt.Sprint(n + 1)), ExpectedVersion: ptr(expected)})
							if err == nil {
								break
							}
							if code(err) != codes.FailedPrecondition {
								errc <- err
								return
							}
							conflicts[w]++
						}
					}
				}()
			}
			wg.Wait()
			close(errc)
			for err := range errc {
				t.Fatal(err)
			}
			d, err := e.client.Get(as(keyW1), &commitspb.GetRequest{World: "w1", Id: "counter"})
			if err != nil {
				t.Fatal(err)
			}
			if string(d.Body) != fmt.Sprint(writers*increments) {
				t.Fatalf("counter %s after %d increments: lost updates", d.Body, writers*increments)
			}
			total := 0
			for _, n := range conflicts {
				total += n
			}
			if total == 0 {
				t.Errorf("no writer ever conflicted: the test did not exercise compare-and-set")
			}
			t.Logf("%d increments, %d conflicts reported, %v false conflicts retried by the edge",
				writers*increments, total, testenv.Metric(t, e.reg, "millrace_commits_false_conflicts_total"))
		})
	}
}

func TestParseKeys(t *testing.T) {
	k, err := ParseKeys("# comment\nw1=" + keyW1 + "\n*=" + keyAll + ", w2 = another-key-for-w2-xx=y")
	if err != nil || k.Len() != 3 {
		t.Fatalf("%v, %v", k.Len(), err)
	}
	for _, c := range []struct {
		key, world     string
		known, allowed bool
	}{
		{keyW1, "w1", true, true}, {keyW1, "w2", true, false}, {keyAll, "anything", true, true},
		{"another-key-for-w2-xx=y", "w2", true, true}, {"nope-nope-nope-nope", "w1", false, false}, {"", "w1", false, false},
	} {
		if known, allowed := k.allows(c.key, c.world); known != c.known || allowed != c.allowed {
			t.Errorf("allows(%q, %q) = %v, %v; want %v, %v", c.key, c.world, known, allowed, c.known, c.allowed)
		}
	}
	for _, bad := range []string{"w1", "w1=short", "=" + keyW1, "a*b=" + keyW1, "w1=" + keyW1 + ",w2=" + keyW1} {
		if _, err := ParseKeys(bad); err == nil {
			t.Errorf("ParseKeys(%q) accepted", bad)
		} else if !strings.HasPrefix(err.Error(), "commits: ") {
			t.Errorf("ParseKeys(%q): %v, want the package's name in front", bad, err)
		}
	}
}

func TestCheckIDAndWorld(t *testing.T) {
	for id, ok := range map[string]bool{
		"a": true, strings.Repeat("x", MaxIDBytes): true, strings.Repeat("x", MaxIDBytes+1): false,
		"": false, "\xff": false, "tab\tand\nnewline": true, ".*>": true,
	} {
		if err := checkID(id); (err == nil) != ok {
			t.Errorf("checkID(%q) = %v, want ok %v", id, err, ok)
		}
	}
	for w, ok := range map[string]bool{
		"w1": true, "é": true, "": false, "a*": false, "a=b": false, "a,b": false, "a\nb": false, "\xff": false,
		strings.Repeat("w", MaxWorldBytes+1): false,
	} {
		if err := checkWorld(w); (err == nil) != ok {
			t.Errorf("checkWorld(%q) = %v, want ok %v", w, err, ok)
		}
	}
}
