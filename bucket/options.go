package bucket

import (
	"context"
	"flag"

	"github.com/millrace/millrace/internal/envflag"
)

// Options are the flag that names the bucket, as every command that opens
// it registers it; it lives beside URLFor so that what an operator may
// write (a directory or a URL) is said in one place.
type Options struct {
	// URL is a directory or a bucket URL (URLFor).
	URL string
}

// RegisterFlags registers the bucket's flag on fs, with its environment
// variable (internal/envflag).
func (o *Options) RegisterFlags(fs *flag.FlagSet) {
	envflag.String(fs, &o.URL, "bucket-url", "MILLRACE_BUCKET_URL", "var/bucket",
		"object storage of the commit log's checkpoints and the raw archive of builds: a directory, file:///dir, s3://name?region=R[&endpoint=URL&use_path_style=true] or gs://name")
}

// Open opens the bucket the options name. A value that names no bucket is
// the command line's mistake (an envflag.UsageError naming the flag); a
// bucket that does not open is not.
func (o Options) Open(ctx context.Context) (*Bucket, error) {
	u, err := URLFor(o.URL)
	if err != nil {
		return nil, envflag.Usage("--bucket-url: " + err.Error())
	}
	return Open(ctx, u)
}
