package bucket

import (
	"context"
	"errors"
	"flag"
	"path/filepath"
	"testing"

	"github.com/millrace/millrace/internal/envflag"
)

// The flag names a directory or a URL; a value that names no bucket is a
// usage error naming the flag, a bucket that does not open is not.
func TestOptionsOpen(t *testing.T) {
	ctx := context.Background()
	t.Setenv("MILLRACE_BUCKET_URL", "")
	var o Options
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	o.RegisterFlags(fs)
	if o.URL != "" {
		t.Fatalf("MILLRACE_BUCKET_URL set empty gave %q", o.URL)
	}
	_, err := o.Open(ctx)
	if !errors.As(err, new(envflag.UsageError)) || err.Error() != "--bucket-url: bucket: no URL or directory" {
		t.Fatalf("no URL: %v; want a usage error naming --bucket-url", err)
	}
	dir := filepath.Join(t.TempDir(), "b")
	if err := fs.Parse([]string{"-bucket-url", dir}); err != nil {
		t.Fatal(err)
	}
	b, err := o.Open(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Close()
	if b.URL() != "file://"+filepath.ToSlash(dir) {
		t.Fatalf("a directory opened %s", b.URL())
	}
	if err := b.Put(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if _, err := (Options{URL: "nope://x"}).Open(ctx); err == nil || errors.As(err, new(envflag.UsageError)) {
		t.Fatalf("an unknown scheme: %v; want an error that is not a usage error", err)
	}
}
