package console

import (
	"bytes"
	"context"
	"net/http"
	"os"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams/projection"
)

// TestConsoleArchivedOutput: once a build's console output has moved into
// its archive object, its pages come from the object, byte for byte as
// PostgreSQL served them; without a bucket the page is 503, and with its
// object gone it is an error that names the build and the object.
func TestConsoleArchivedOutput(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	f, err := os.Open("../loadtest/fixtures/bazel-test-60.besrec")
	if err != nil {
		t.Fatal(err)
	}
	bs, err := archive.FromRecording(f, 1)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	b := bs[0]
	for _, x := range bs {
		if len(x.Messages) > len(b.Messages) {
			b = x
		}
	}
	project, id := b.Messages[0].Header("Millrace-Project"), b.Messages[0].Header("Millrace-Invocation-Id")
	msgs := make([]projection.Message, len(b.Messages))
	for i, m := range b.Messages {
		msgs[i] = m
	}
	p, err := builds.New(builds.Config{})
	if err != nil {
		t.Fatal(err)
	}
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error { return p.Apply(ctx, tx, msgs) }); err != nil {
		t.Fatal(err)
	}
	bk, err := bucket.Open(ctx, "file://"+t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer bk.Close()
	objects := archive.NewObjects(bk)
	var withBucket atomic.Bool // the server's goroutines read it
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }, Archive: func() builds.Archive {
		if withBucket.Load() {
			return objects
		}
		return nil
	}})
	get := serve(t, mux)
	page := BuildPath(project, id) + "/output/stderr/0"
	code, inPG := get(page)
	if code != http.StatusOK || inPG == "" {
		t.Fatalf("the page in PostgreSQL: %d %q", code, inPG)
	}

	// Archived, and its output moved, as the archiver does.
	key := archive.BuildKey(project, id)
	var obj bytes.Buffer
	w, err := archive.NewWriter(&obj, nil, archive.Level)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range b.Messages {
		if err := w.Write(m); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := w.Close(); err != nil {
		t.Fatal(err)
	}
	if err := bk.Put(ctx, key, obj.Bytes()); err != nil {
		t.Fatal(err)
	}
	last := b.Messages[len(b.Messages)-1].Sequence
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		res, err := builds.MoveOutput(ctx, tx, builds.ConsumerName, project, id, 0, [2]int64{}, func(fn func(projection.Message) error) error {
			return objects.Messages(ctx, key, fn)
		})
		if err != nil || !res.Moved {
			t.Fatalf("move: %+v, %v", res, err)
		}
		_, err = tx.Exec(ctx, `insert into archived_builds (invocation_id, project, object_key, dict_id, events, first_seq, last_seq,
			last_event_at, raw_bytes, stored_bytes, archived_at, output_seq, output_stdout_bytes, output_stderr_bytes)
			values ($1, $2, $3, 0, $4, 1, $5, now(), 0, 0, now(), $5, $6, $7)`,
			id, project, key, len(b.Messages), last, res.Bytes[0], res.Bytes[1])
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if code, body := get(page); code != http.StatusServiceUnavailable || !strings.Contains(body, key) {
		t.Fatalf("moved, no bucket: %d %q", code, body)
	}
	withBucket.Store(true)
	if code, body := get(page); code != http.StatusOK || body != inPG {
		t.Fatalf("from the archive: %d, %d bytes; want 200 and the %d bytes PostgreSQL served", code, len(body), len(inPG))
	}
	if err := bk.Delete(ctx, key); err != nil {
		t.Fatal(err)
	}
	if code, body := get(page); code != http.StatusInternalServerError || !strings.Contains(body, key) || !strings.Contains(body, id) {
		t.Fatalf("the object gone: %d %q", code, body)
	}
}
