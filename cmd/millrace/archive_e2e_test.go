package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
)

// TestArchiveEndToEnd: a recorded build stored on the BES stream as the
// edge stores it is projected and, --archive-after its last event,
// archived by `project builds`; `archive verify` finds it good against the
// stream and the projection, and bad once its object is tampered with.
func TestArchiveEndToEnd(t *testing.T) {
	// Not trimmed: verify compares the object with the stream, and zstd
	// train reads the stream (TestArchiveTrimEndToEnd trims).
	r := startArchiveRun(t, "--archive-trim=false")
	ctx, pool, env, dir := r.ctx, r.pool, r.env, r.bucket
	const id = "ea8ce61d-03a8-4221-bbab-4581a0acff79"
	var events int64
	poll.Until(t, "the build archived", func() bool {
		return pool.QueryRow(ctx, `select events from archived_builds where invocation_id = $1`, id).Scan(&events) == nil
	}, poll.Within(60*time.Second))
	if events != int64(r.events) {
		t.Fatalf("archived %d events, the stream holds %d", events, r.events)
	}
	out, _ := millrace(t, env, false, "archive", "verify")
	if !strings.Contains(out, "archive verify: 1 builds, 0 bad") {
		t.Fatalf("verify: %q", out)
	}
	out, _ = millrace(t, env, false, "archive", "verify", "--json", "--id", id)
	if !strings.Contains(out, `"in_stream": 517`) || !strings.Contains(out, `"bad": 0`) {
		t.Fatalf("verify --json: %q", out)
	}
	// A dictionary trained on the stream's builds becomes current.
	out, _ = millrace(t, env, false, "zstd", "train", "--from-stream", "--builds", "5")
	if !strings.Contains(out, "trained on 1 builds, now current") {
		t.Fatalf("zstd train --from-stream: %q", out)
	}
	if d, err := archive.NewDicts(mustOpen(t, dir)).Current(ctx); err != nil || d == nil {
		t.Fatalf("current dictionary after training on the stream: %v, %v", d, err)
	}
	// One byte of the object changed in the bucket.
	bk := mustOpen(t, dir)
	key := archive.BuildKey("millrace-fixtures", id)
	obj, err := bk.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	obj[len(obj)/2] ^= 0x10
	if err := bk.Put(ctx, key, obj); err != nil {
		t.Fatal(err)
	}
	out, _ = millrace(t, env, true, "archive", "verify", "--project", "millrace-fixtures")
	if !strings.Contains(out, "bad: "+id+" of project millrace-fixtures") || !strings.Contains(out, "1 builds, 1 bad") {
		t.Fatalf("verify of a tampered object: %q", out)
	}
}

// TestArchiveTrimEndToEnd: `project builds` archives a build, and once its
// projector has read it (nothing else holds), trims its raw events from the
// stream; verify finds the object good with the stream holding none of it.
func TestArchiveTrimEndToEnd(t *testing.T) {
	r := startArchiveRun(t)
	ctx, js, pool, env, subject := r.ctx, r.js, r.pool, r.env, r.subject
	s, _ := js.Stream(ctx, "BES")
	poll.Until(t, "the build archived and trimmed", func() bool {
		var trimmed *int64
		pool.QueryRow(ctx, `select trimmed_seq from archived_builds where invocation_id = 'ea8ce61d-03a8-4221-bbab-4581a0acff79'`).Scan(&trimmed)
		info, err := s.Info(ctx, jetstream.WithSubjectFilter(subject))
		return trimmed != nil && err == nil && info.State.Subjects[subject] == 0
	}, poll.Within(60*time.Second))
	out, _ := millrace(t, env, false, "archive", "verify", "--json")
	if !strings.Contains(out, `"in_stream": 0`) || !strings.Contains(out, `"bad": 0`) {
		t.Fatalf("verify --json of a trimmed build: %q", out)
	}
}

// archiveRun is a BES stream holding a recorded build (every subject, as
// the edge stores them) and `project builds` running on it, archiving a
// second after the build's last event.
type archiveRun struct {
	ctx     context.Context
	js      jetstream.JetStream
	pool    *pgxpool.Pool
	env     []string
	bucket  string // its directory
	subject string // the invocation's
	events  int    // its messages
}

func startArchiveRun(t *testing.T, args ...string) *archiveRun {
	t.Helper()
	ns := testenv.NATS(t)
	db := testenv.Database(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	r := &archiveRun{ctx: ctx, bucket: filepath.Join(t.TempDir(), "bucket")}
	r.js, _ = jetstream.New(nc)
	if err := streams.Apply(ctx, r.js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open("../../loadtest/fixtures/bazel-test-60.besrec")
	if err != nil {
		t.Fatal(err)
	}
	builds, err := archive.FromRecording(f, 1)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	for _, b := range builds {
		for _, m := range b.Messages {
			if _, err := r.js.PublishMsg(ctx, &nats.Msg{Subject: m.SubjectName, Header: nats.Header(m.Headers), Data: m.Payload}); err != nil {
				t.Fatal(err)
			}
		}
		if len(b.Messages) > r.events {
			r.events, r.subject = len(b.Messages), b.Messages[0].SubjectName
		}
	}
	r.env = []string{"MILLRACE_NATS_URL=" + ns.ClientURL(), "DATABASE_URL=" + db, "MILLRACE_BUCKET_URL=" + r.bucket}
	cmd := exec.Command(binary(t), append([]string{"project", "builds", "--http-listen", "127.0.0.1:0", "--archive-after", "1s", "--archive-interval", "100ms"}, args...)...)
	cmd.Env = append(os.Environ(), r.env...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() })
	if r.pool, err = pgxpool.New(ctx, db); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.pool.Close)
	return r
}

func mustOpen(t *testing.T, dir string) *bucket.Bucket {
	t.Helper()
	bk, err := bucket.Open(context.Background(), "file://"+dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bk.Close() })
	return bk
}
