package main

import (
	"context"
	"flag"
	"fmt"
	"path/filepath"
	"strings"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/envflag"
)

// bucketOptions name the object storage the commit log is folded into.
type bucketOptions struct {
	url string
}

func (o *bucketOptions) register(fs *flag.FlagSet) {
	envflag.String(fs, &o.url, "bucket-url", "MILLRACE_BUCKET_URL", "var/bucket",
		"object storage of the commit log's checkpoints: a directory, file:///dir, s3://name?region=R[&endpoint=URL&use_path_style=true] or gs://name")
}

// openURL is the bucket URL: a plain path is a file:// bucket at its
// absolute path (gocloud's file URLs are absolute).
func (o *bucketOptions) openURL() (string, error) {
	if strings.Contains(o.url, "://") {
		return o.url, nil
	}
	if o.url == "" {
		return "", usageError{"--bucket-url is empty"}
	}
	abs, err := filepath.Abs(o.url)
	if err != nil {
		return "", fmt.Errorf("--bucket-url %s: %w", o.url, err)
	}
	return "file://" + filepath.ToSlash(abs), nil
}

func (o *bucketOptions) open(ctx context.Context) (*bucket.Bucket, error) {
	u, err := o.openURL()
	if err != nil {
		return nil, err
	}
	return bucket.Open(ctx, u)
}
