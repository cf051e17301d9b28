package bucket

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/johannesboyne/gofakes3"
	"github.com/johannesboyne/gofakes3/backend/s3mem"
)

// backends are the stores the suite runs against: the default file://
// (as `millrace dev` uses it), mem://, and s3:// on an S3-protocol server
// in the test process (gofakes3, which honours If-None-Match: * as S3
// does).
var backends = []struct {
	name string
	open func(t *testing.T) *Bucket
}{
	{"file", func(t *testing.T) *Bucket { return open(t, "file://"+filepath.Join(t.TempDir(), "bucket")) }},
	{"mem", func(t *testing.T) *Bucket { return open(t, "mem://") }},
	{"s3", func(t *testing.T) *Bucket {
		backend := s3mem.New()
		if err := backend.CreateBucket("millrace"); err != nil {
			t.Fatal(err)
		}
		srv := httptest.NewServer(gofakes3.New(backend).Server())
		t.Cleanup(srv.Close)
		t.Setenv("AWS_ACCESS_KEY_ID", "test")
		t.Setenv("AWS_SECRET_ACCESS_KEY", "test")
		return open(t, "s3://millrace?region=us-east-1&use_path_style=true&disable_https=true"+
			"&request_checksum_calculation=when_required&response_checksum_validation=when_required&endpoint="+srv.URL)
	}},
}

func open(t *testing.T, url string) *Bucket {
	t.Helper()
	b, err := Open(context.Background(), url)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// TestConformance runs one suite against every backend: what the
// compactor relies on must hold on each.
func TestConformance(t *testing.T) {
	for _, be := range backends {
		t.Run(be.name, func(t *testing.T) {
			for _, c := range suite {
				t.Run(c.name, func(t *testing.T) { c.run(t, be.open(t)) })
			}
		})
	}
}

var suite = []struct {
	name string
	run  func(t *testing.T, b *Bucket)
}{
	{"put then get", func(t *testing.T, b *Bucket) {
		ctx := context.Background()
		data := bytes.Repeat([]byte{0, 1, 2, 255}, 300_000) // 1.2 MB, binary
		if err := b.Put(ctx, "w/shards/0001", data); err != nil {
			t.Fatal(err)
		}
		got, err := b.Get(ctx, "w/shards/0001")
		if err != nil || !bytes.Equal(got, data) {
			t.Fatalf("read back %d bytes (%v), want %d", len(got), err, len(data))
		}
		if err := b.Put(ctx, "w/shards/0001", []byte("replaced")); err != nil {
			t.Fatal(err)
		}
		if got, _ := b.Get(ctx, "w/shards/0001"); string(got) != "replaced" {
			t.Fatalf("after a second put: %q", got)
		}
		if err := b.Put(ctx, "w/empty", nil); err != nil {
			t.Fatal(err)
		}
		if got, err := b.Get(ctx, "w/empty"); err != nil || len(got) != 0 {
			t.Fatalf("empty object: %q, %v", got, err)
		}
	}},
	{"dirs and times", func(t *testing.T, b *Bucket) {
		ctx := context.Background()
		before := time.Now().Add(-time.Minute)
		for _, k := range []string{"worlds/w-a/checkpoints/1.json", "worlds/w-a/shards/x", "worlds/w-b%2Fc/history/y", "other/z"} {
			if err := b.Put(ctx, k, []byte("v")); err != nil {
				t.Fatal(err)
			}
		}
		dirs, err := b.Dirs(ctx, "worlds/")
		if err != nil || strings.Join(dirs, " ") != "worlds/w-a/ worlds/w-b%2Fc/" {
			t.Fatalf("dirs: %q, %v", dirs, err)
		}
		objs, err := b.List(ctx, "worlds/w-a/checkpoints/")
		if err != nil || len(objs) != 1 || objs[0].ModTime.Before(before) {
			t.Fatalf("a listed object's time: %+v, %v", objs, err)
		}
	}},
	{"not found", func(t *testing.T, b *Bucket) {
		ctx := context.Background()
		if _, err := b.Get(ctx, "nothing/here"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("get: %v, want ErrNotFound", err)
		}
		if ok, err := b.Exists(ctx, "nothing/here"); ok || err != nil {
			t.Fatalf("exists: %v, %v", ok, err)
		}
		if err := b.Delete(ctx, "nothing/here"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("delete: %v, want ErrNotFound", err)
		}
	}},
	{"create is conditional", func(t *testing.T, b *Bucket) {
		ctx := context.Background()
		if err := b.Create(ctx, "w/checkpoints/0000000042", []byte("first")); err != nil {
			t.Fatal(err)
		}
		if err := b.Create(ctx, "w/checkpoints/0000000042", []byte("second")); !errors.Is(err, ErrExists) {
			t.Fatalf("second create: %v, want ErrExists", err)
		}
		if got, _ := b.Get(ctx, "w/checkpoints/0000000042"); string(got) != "first" {
			t.Fatalf("after a refused create the object holds %q", got)
		}
		if ok, err := b.Equal(ctx, "w/checkpoints/0000000042", []byte("first")); !ok || err != nil {
			t.Fatalf("equal: %v, %v", ok, err)
		}
	}},
	{"concurrent creates: one wins", func(t *testing.T, b *Bucket) {
		ctx := context.Background()
		for round := range 5 {
			key := fmt.Sprintf("w/race/%d", round)
			const n = 8
			var wg sync.WaitGroup
			errs := make([]error, n)
			for i := range n {
				wg.Add(1)
				go func() { defer wg.Done(); errs[i] = b.Create(ctx, key, []byte{byte(i)}) }()
			}
			wg.Wait()
			won := -1
			for i, err := range errs {
				switch {
				case err == nil && won >= 0:
					t.Fatalf("round %d: writers %d and %d both created %s", round, won, i, key)
				case err == nil:
					won = i
				case !errors.Is(err, ErrExists):
					t.Fatalf("round %d: writer %d: %v", round, i, err)
				}
			}
			if got, _ := b.Get(ctx, key); won < 0 || !bytes.Equal(got, []byte{byte(won)}) {
				t.Fatalf("round %d: winner %d, object %v", round, won, got)
			}
		}
	}},
	{"list by prefix, sorted", func(t *testing.T, b *Bucket) {
		ctx := context.Background()
		for _, k := range []string{"w/s/b", "w/s/a", "w/s/c/d", "w/t/a", "x/s/a"} {
			if err := b.Put(ctx, k, []byte(k)); err != nil {
				t.Fatal(err)
			}
		}
		got, err := b.List(ctx, "w/s/")
		if err != nil {
			t.Fatal(err)
		}
		for i := range got {
			got[i].ModTime = time.Time{}
		}
		want := []Object{{"w/s/a", 5, time.Time{}}, {"w/s/b", 5, time.Time{}}, {"w/s/c/d", 7, time.Time{}}}
		if fmt.Sprint(got) != fmt.Sprint(want) {
			t.Fatalf("list w/s/: %v, want %v", got, want)
		}
		if err := b.Delete(ctx, "w/s/b"); err != nil {
			t.Fatal(err)
		}
		if got, _ := b.List(ctx, "w/s/"); len(got) != 2 {
			t.Fatalf("after a delete: %v", got)
		}
	}},
	{"streamed write and read", func(t *testing.T, b *Bucket) {
		ctx := context.Background()
		// Larger than a part on every driver (S3's default is 5 MiB), in
		// small writes, as the archive writes its objects.
		part := bytes.Repeat([]byte{7, 0, 255, 1}, 4096)
		w, err := b.NewWriter(ctx, "a/streamed")
		if err != nil {
			t.Fatal(err)
		}
		var want bytes.Buffer
		for i := range 400 {
			part[0] = byte(i)
			want.Write(part)
			if _, err := w.Write(part); err != nil {
				t.Fatal(err)
			}
		}
		if ok, _ := b.Exists(ctx, "a/streamed"); ok {
			t.Fatal("the object is visible before Close")
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		r, err := b.NewReader(ctx, "a/streamed")
		if err != nil {
			t.Fatal(err)
		}
		got, err := io.ReadAll(r)
		r.Close()
		if err != nil || !bytes.Equal(got, want.Bytes()) {
			t.Fatalf("read back %d bytes (%v), want %d", len(got), err, want.Len())
		}
		if _, err := b.NewReader(ctx, "a/none"); !errors.Is(err, ErrNotFound) {
			t.Fatalf("reader of a missing object: %v, want ErrNotFound", err)
		}
	}},
	{"aborted write leaves the old object", func(t *testing.T, b *Bucket) {
		ctx := context.Background()
		if err := b.Put(ctx, "a/obj", []byte("old")); err != nil {
			t.Fatal(err)
		}
		w, err := b.NewWriter(ctx, "a/obj")
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.Write([]byte("half of a new one")); err != nil {
			t.Fatal(err)
		}
		w.Abort()
		if got, err := b.Get(ctx, "a/obj"); err != nil || string(got) != "old" {
			t.Fatalf("after an abort: %q, %v", got, err)
		}
		w, err = b.NewWriter(ctx, "a/never")
		if err != nil {
			t.Fatal(err)
		}
		w.Write([]byte("x"))
		w.Abort()
		if ok, _ := b.Exists(ctx, "a/never"); ok {
			t.Fatal("an aborted write stored its object")
		}
		if _, err := b.NewWriter(ctx, "a//b"); err == nil {
			t.Fatal("writer of a bad key accepted")
		}
	}},
	{"bad keys", func(t *testing.T, b *Bucket) {
		ctx := context.Background()
		for _, k := range []string{"", "/abs", "a//b", "a/../b", "./a", "a/", string(make([]byte, MaxKeyBytes+1)), "\xff"} {
			if err := b.Put(ctx, k, nil); err == nil {
				t.Errorf("put %q accepted", k)
			}
		}
	}},
}

func TestOpenRefusesUnknownScheme(t *testing.T) {
	if _, err := Open(context.Background(), "ftp://x"); err == nil {
		t.Fatal("ftp:// opened")
	}
}
