package bucket

import (
	"context"
	"fmt"
	"io"

	"gocloud.dev/blob"
	"gocloud.dev/gcerrors"
)

// Writer streams one object into the bucket: what is written goes out in
// parts (a multipart upload on S3, a resumable one on GCS, a temporary
// file on file://), so an object of any size is written in bounded
// memory. The object appears, whole, only when Close succeeds; Abort (or
// a failed Close) leaves whatever was at the key before.
type Writer struct {
	w      *blob.Writer
	cancel context.CancelFunc
	key    string
}

// NewWriter starts writing the object at key, replacing what is there
// once Close succeeds. Unlike Create it is not conditional: a streamed
// write has no atomic "if none exists" on every store.
func (b *Bucket) NewWriter(ctx context.Context, key string) (*Writer, error) {
	if err := CheckKey(key); err != nil {
		return nil, err
	}
	// gocloud aborts a write whose context ends before Close: the cancel
	// is how Abort throws the object away.
	ctx, cancel := context.WithCancel(ctx)
	w, err := b.b.NewWriter(ctx, key, &blob.WriterOptions{ContentType: "application/octet-stream"})
	if err != nil {
		cancel()
		return nil, fmt.Errorf("bucket: write %s: %w", key, err)
	}
	return &Writer{w: w, cancel: cancel, key: key}, nil
}

// Write writes p to the object.
func (w *Writer) Write(p []byte) (int, error) {
	n, err := w.w.Write(p)
	if err != nil {
		return n, fmt.Errorf("bucket: write %s: %w", w.key, err)
	}
	return n, nil
}

// Close finishes the object: once it returns nil, the object is stored.
func (w *Writer) Close() error {
	defer w.cancel()
	if err := w.w.Close(); err != nil {
		return fmt.Errorf("bucket: write %s: %w", w.key, err)
	}
	return nil
}

// Abort gives the write up: nothing is stored. Safe after Close (then it
// does nothing).
func (w *Writer) Abort() {
	w.cancel()
	w.w.Close() // the context has ended: the driver discards the object
}

// NewReader opens the object at key for reading as a stream
// (ErrNotFound when there is none). The caller closes it.
func (b *Bucket) NewReader(ctx context.Context, key string) (io.ReadCloser, error) {
	if err := CheckKey(key); err != nil {
		return nil, err
	}
	r, err := b.b.NewReader(ctx, key, nil)
	if gcerrors.Code(err) == gcerrors.NotFound {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, key)
	}
	if err != nil {
		return nil, fmt.Errorf("bucket: read %s: %w", key, err)
	}
	return reader{r: r, key: key}, nil
}

// reader names the key in its errors.
type reader struct {
	r   *blob.Reader
	key string
}

func (r reader) Read(p []byte) (int, error) {
	n, err := r.r.Read(p)
	if err != nil && err != io.EOF {
		return n, fmt.Errorf("bucket: read %s: %w", r.key, err)
	}
	return n, err
}

func (r reader) Close() error { return r.r.Close() }
