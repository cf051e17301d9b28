package main

import (
	"context"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/schemas/bep"
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
	// messages are the invocation's, as published.
	messages []*archive.Message
	// stop stops `project builds` (and waits for it).
	stop func()
}

func startArchiveRun(t *testing.T, args ...string) *archiveRun {
	t.Helper()
	// Built first: the first test to ask builds the binary, which on a
	// busy machine takes a good part of the run's two minutes.
	bin := binary(t)
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
			r.events, r.subject, r.messages = len(b.Messages), b.Messages[0].SubjectName, b.Messages
		}
	}
	r.env = []string{"MILLRACE_NATS_URL=" + ns.ClientURL(), "DATABASE_URL=" + db, "MILLRACE_BUCKET_URL=" + r.bucket}
	cmd := exec.Command(bin, append([]string{"project", "builds", "--http-listen", "127.0.0.1:0", "--archive-after", "1s", "--archive-interval", "100ms"}, args...)...)
	cmd.Env = append(os.Environ(), r.env...)
	log := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = log, log
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	r.stop = sync.OnceFunc(func() { cmd.Process.Signal(syscall.SIGTERM); cmd.Wait() })
	t.Cleanup(func() {
		r.stop()
		if t.Failed() { // what the projector said, for the failure's reason
			t.Logf("project builds:\n%s", log)
		}
	})
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

// TestArchiveOutputEndToEnd: once `project builds` has archived the build,
// its console output is no longer in PostgreSQL, and `builds show
// --output` prints it from the archive as Bazel printed it; `replay
// builds` folds it into pages and moves it into the archive again, so
// that it ends where the live run was.
func TestArchiveOutputEndToEnd(t *testing.T) {
	// Trimmed (the default): the stream of this one build ends up empty,
	// and the replay reads it all from the archive, then stops at the end
	// of what the stream still holds.
	r := startArchiveRun(t)
	ctx, pool, env := r.ctx, r.pool, r.env
	const id = "ea8ce61d-03a8-4221-bbab-4581a0acff79"
	moved := func() (seq *int64, rows int) {
		pool.QueryRow(ctx, `select output_seq from archived_builds where invocation_id = $1`, id).Scan(&seq)
		pool.QueryRow(ctx, `select count(*) from build_output_pages where invocation_id = $1`, id).Scan(&rows)
		return seq, rows
	}
	poll.Until(t, "the build's output moved into the archive", func() bool {
		seq, rows := moved()
		return seq != nil && rows == 0
	}, poll.Within(60*time.Second))
	wantOut, wantErr := bazelOutput(t, r.messages)
	if wantOut+wantErr == "" {
		t.Fatal("the recorded build printed nothing")
	}
	show := func(what string) {
		t.Helper()
		out, errOut := millrace(t, env, false, "builds", "show", "--output", id)
		if out != wantOut || errOut != wantErr {
			t.Fatalf("%s: builds show --output printed %d and %d bytes, Bazel %d and %d", what, len(out), len(errOut), len(wantOut), len(wantErr))
		}
	}
	show("from the archive")
	if _, errOut := millrace(t, append(env, "MILLRACE_BUCKET_URL="+t.TempDir()), true, "builds", "show", "--output", id); !strings.Contains(errOut, archive.BuildKey("millrace-fixtures", id)) {
		t.Fatalf("builds show --output, the object missing: %q", errOut)
	}

	r.stop()
	digest := func() map[string]string {
		d, err := builds.Digest(ctx, pool)
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	before := digest()
	_, errOut := millrace(t, env, false, "replay", "builds")
	if !strings.Contains(errOut, "the console output of 1 archived builds moved into the archive again") {
		t.Fatalf("replay builds: %q", errOut)
	}
	if seq, rows := moved(); seq == nil || rows != 0 {
		t.Fatalf("after the replay: output_seq %v, %d pages in PostgreSQL", seq, rows)
	}
	if after := digest(); !maps.Equal(after, before) {
		t.Fatalf("the replay did not end where the live run was:\n got %v\nwant %v", after, before)
	}
	show("after the replay")
}

// bazelOutput is the console output of a recorded build as Bazel printed
// it: its progress events' stdout and stderr, each sequence number once.
func bazelOutput(t *testing.T, msgs []*archive.Message) (stdout, stderr string) {
	t.Helper()
	var last int64
	var o, e strings.Builder
	for _, m := range msgs {
		var obe buildpb.OrderedBuildEvent
		if m.Header("Millrace-Kind") != "tool" || proto.Unmarshal(m.Payload, &obe) != nil || obe.SequenceNumber <= last {
			continue
		}
		last = obe.SequenceNumber
		var be bep.BuildEvent
		if a := obe.GetEvent().GetBazelEvent(); a == nil || proto.Unmarshal(a.GetValue(), &be) != nil {
			continue
		}
		o.WriteString(be.GetProgress().GetStdout())
		e.WriteString(be.GetProgress().GetStderr())
	}
	return o.String(), e.String()
}
