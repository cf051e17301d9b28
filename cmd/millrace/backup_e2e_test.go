package main

import (
	"context"
	"maps"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/millrace/millrace/internal/testenv"
	commitspb "github.com/millrace/millrace/schemas/commits"
)

// envOf is the value dev was started with for key.
func envOf(d *devProcess, key string) string {
	for _, kv := range d.env {
		if v, ok := strings.CutPrefix(kv, key+"="); ok {
			return v
		}
	}
	return ""
}

// devCommitsKey is the development key of dev's commits API (every world).
func devCommitsKey(t *testing.T, dev *devProcess) string {
	t.Helper()
	keyFile := filepath.Join(dev.fleetDir, "commits-api-keys")
	waitUntil(t, "the development commits key", func() bool {
		b, err := os.ReadFile(keyFile)
		return err == nil && strings.HasSuffix(string(b), "\n")
	})
	b, err := os.ReadFile(keyFile)
	if err != nil {
		t.Fatal(err)
	}
	_, key, _ := strings.Cut(strings.TrimSpace(string(b)), "=")
	return key
}

// commitsClient calls dev's commits API with its development key.
func commitsClient(t *testing.T, dev *devProcess) (commitspb.CommitsClient, context.Context) {
	t.Helper()
	key := devCommitsKey(t, dev)
	conn, err := grpc.NewClient(dev.commitsAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return commitspb.NewCommitsClient(conn), metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+key)
}

// TestBackupRestore follows ops/runbooks/backup-restore.md: a running
// system's streams are backed up (streams backup), then its bucket; on a
// fresh backbone, bucket and database (another machine) the streams are
// restored (streams restore) and the builds replayed (replay builds). The
// projection is the same, row for row, and the commit log's documents
// have their versions, with compare-and-set going on from them.
func TestBackupRestore(t *testing.T) {
	dbA := testenv.Database(t)
	dev := newDev(t, dbA)
	dev.start()
	id := replayBuild(t, dev.besAddr, "backup")
	waitUntil(t, "the build projected", func() bool {
		return lastSeen(testPool(t, dbA), "backup", id) > 0 && count(t, testPool(t, dbA), "select count(*) from invocations where status <> 'running'") == 1
	})
	client, ctx := commitsClient(t, dev)
	var put *commitspb.PutResponse
	var err error
	waitUntil(t, "the commits API", func() bool {
		put, err = client.Put(ctx, &commitspb.PutRequest{World: "w", Id: "doc", Body: []byte("v1")})
		return err == nil
	})
	if put, err = client.Put(ctx, &commitspb.PutRequest{World: "w", Id: "doc", Body: []byte("v2"), ExpectedVersion: &put.Version}); err != nil {
		t.Fatal(err)
	}

	backup := filepath.Join(t.TempDir(), "backup")
	natsEnv := []string{"MILLRACE_NATS_URL=" + dev.natsURL, "MILLRACE_NATS_NKEY=" + dev.natsNKey}
	out, _ := millrace(t, natsEnv, false, "streams", "backup", "--out", backup)
	if !strings.Contains(out, "backed up BES:") || !strings.Contains(out, "backed up COMMITS:") {
		t.Fatalf("streams backup printed:\n%s", out)
	}
	millrace(t, natsEnv, true, "streams", "backup", "--out", backup) // a second backup into the same directory is refused
	bucket := filepath.Join(t.TempDir(), "bucket")
	if err := os.CopyFS(bucket, os.DirFS(envOf(dev, "MILLRACE_BUCKET_URL"))); err != nil {
		t.Fatal(err)
	}
	dev.stop()
	want := digest(t, dbA)

	// Another machine: a fresh embedded server's store, bucket and database.
	natsDir := filepath.Join(t.TempDir(), "nats")
	fresh := []string{"MILLRACE_NATS_DIR=" + natsDir, "MILLRACE_NATS_LISTEN=" + freePort(t)}
	out, _ = millrace(t, fresh, false, "streams", "restore", "--from", backup)
	if !strings.Contains(out, "restored BES:") {
		t.Fatalf("streams restore printed:\n%s", out)
	}
	millrace(t, fresh, true, "streams", "restore", "--from", backup) // the streams hold messages now: refused
	dbB := testenv.Database(t)
	millrace(t, append(fresh, "DATABASE_URL="+dbB, "MILLRACE_BUCKET_URL="+bucket), false, "replay", "builds")
	if got := digest(t, dbB); !maps.Equal(got, want) {
		t.Fatalf("the restored system's projection differs from the backed-up one's:\n got %v\nwant %v", got, want)
	}

	again := newDev(t, dbB)
	for i, kv := range again.env {
		switch {
		case strings.HasPrefix(kv, "MILLRACE_NATS_DIR="):
			again.env[i] = "MILLRACE_NATS_DIR=" + natsDir
		case strings.HasPrefix(kv, "MILLRACE_BUCKET_URL="):
			again.env[i] = "MILLRACE_BUCKET_URL=" + bucket
		}
	}
	again.start()
	client, ctx = commitsClient(t, again)
	var d *commitspb.Document
	waitUntil(t, "the restored commit log", func() bool {
		d, err = client.Get(ctx, &commitspb.GetRequest{World: "w", Id: "doc"})
		return err == nil
	})
	if d.Version != put.Version || string(d.Body) != "v2" {
		t.Fatalf("restored document: version %d %q, want %d \"v2\"", d.Version, d.Body, put.Version)
	}
	if _, err := client.Put(ctx, &commitspb.PutRequest{World: "w", Id: "doc", Body: []byte("v3"), ExpectedVersion: &put.Version}); err != nil {
		t.Fatalf("compare-and-set on the restored version: %v", err)
	}
	again.stop()
}
