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
	ns := testenv.NATS(t)
	db := testenv.Database(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	f, err := os.Open("../../loadtest/fixtures/bazel-test-60.besrec")
	if err != nil {
		t.Fatal(err)
	}
	builds, err := archive.FromRecording(f, 1)
	f.Close()
	if err != nil || len(builds) != 1 {
		t.Fatalf("recording: %d builds, %v", len(builds), err)
	}
	for _, m := range builds[0].Messages {
		if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: m.SubjectName, Header: nats.Header(m.Headers), Data: m.Payload}); err != nil {
			t.Fatal(err)
		}
	}
	dir := filepath.Join(t.TempDir(), "bucket")
	env := []string{"MILLRACE_NATS_URL=" + ns.ClientURL(), "DATABASE_URL=" + db, "MILLRACE_BUCKET_URL=" + dir}
	// Not trimmed: verify compares the object with the stream, and zstd
	// train reads the stream (TestArchiveTrimEndToEnd trims).
	cmd := exec.Command(binary(t), "project", "builds", "--http-listen", "127.0.0.1:0", "--archive-after", "1s", "--archive-interval", "100ms", "--archive-trim=false")
	cmd.Env = append(os.Environ(), env...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() }()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	const id = "ea8ce61d-03a8-4221-bbab-4581a0acff79"
	var events int64
	poll.Until(t, "the build archived", func() bool {
		return pool.QueryRow(ctx, `select events from archived_builds where invocation_id = $1`, id).Scan(&events) == nil
	}, poll.Within(60*time.Second))
	if events != int64(len(builds[0].Messages)) {
		t.Fatalf("archived %d events, the stream holds %d", events, len(builds[0].Messages))
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
	ns := testenv.NATS(t)
	db := testenv.Database(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
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
	var subject string
	for _, b := range builds {
		for _, m := range b.Messages {
			if _, err := js.PublishMsg(ctx, &nats.Msg{Subject: m.SubjectName, Header: nats.Header(m.Headers), Data: m.Payload}); err != nil {
				t.Fatal(err)
			}
		}
		if len(b.Messages) > 100 {
			subject = b.Messages[0].SubjectName
		}
	}
	env := []string{"MILLRACE_NATS_URL=" + ns.ClientURL(), "DATABASE_URL=" + db, "MILLRACE_BUCKET_URL=" + filepath.Join(t.TempDir(), "bucket")}
	cmd := exec.Command(binary(t), "project", "builds", "--http-listen", "127.0.0.1:0", "--archive-after", "1s", "--archive-interval", "100ms")
	cmd.Env = append(os.Environ(), env...)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() }()
	pool, err := pgxpool.New(ctx, db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
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

func mustOpen(t *testing.T, dir string) *bucket.Bucket {
	t.Helper()
	bk, err := bucket.Open(context.Background(), "file://"+dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bk.Close() })
	return bk
}
