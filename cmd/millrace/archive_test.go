package main

import (
	"bytes"
	"context"
	"path/filepath"
	"testing"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/envflag/envflagtest"
)

// zstd train on the recorded builds stores a dictionary in the bucket and
// makes it current.
func TestZstdTrainFromRecordings(t *testing.T) {
	envflagtest.Clean(t)
	dir := filepath.Join(t.TempDir(), "bucket")
	var out, errb bytes.Buffer
	code := run(context.Background(), []string{"zstd", "train", "--bucket-url", dir,
		"../../loadtest/fixtures/bazel-test-60.besrec", "../../loadtest/fixtures/bazel-build-10.besrec"}, &out, &errb)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, errb.String())
	}
	bk, err := bucket.Open(context.Background(), "file://"+dir)
	if err != nil {
		t.Fatal(err)
	}
	defer bk.Close()
	d, err := archive.NewDicts(bk).Current(context.Background())
	if err != nil || d == nil || !archive.PrivateID(d.ID) {
		t.Fatalf("current dictionary: %v, %v", d, err)
	}
	if code := run(context.Background(), []string{"zstd", "train", "--bucket-url", dir}, &out, &errb); code == 0 {
		t.Fatal("zstd train without recordings or --from-stream succeeded")
	}
}
