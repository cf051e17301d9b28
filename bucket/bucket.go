// Package bucket is millrace's object storage: a gocloud.dev/blob bucket
// (file:// by default, s3:// and gs:// in production, mem:// in tests)
// with the few operations the commit log's compactor needs, their errors
// made plain (ErrNotFound, ErrExists), and keys checked.
//
// Create is the conditional create ("if none exists") that lets two
// compactors race for one checkpoint and only one win. On S3 (If-None-Match:
// *), GCS (if-generation-match 0) and mem:// the store makes it atomic.
// gocloud's fileblob does not: it checks for the file, then renames a
// temporary file over it, and the conformance suite caught two of eight
// concurrent creates both succeeding. So on file:// a Create holds an
// exclusive flock on a lock file beside the bucket's directory: atomic
// between all processes of the host that use this package.
package bucket

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"
	"unicode/utf8"

	"gocloud.dev/blob"
	_ "gocloud.dev/blob/fileblob" // file://
	_ "gocloud.dev/blob/gcsblob"  // gs://
	_ "gocloud.dev/blob/memblob"  // mem://
	_ "gocloud.dev/blob/s3blob"   // s3://
	"gocloud.dev/gcerrors"
)

// Errors of the operations, to test with errors.Is.
var (
	ErrNotFound = errors.New("bucket: no such object")
	ErrExists   = errors.New("bucket: the object exists already")
)

// MaxKeyBytes bounds a key: S3's limit.
const MaxKeyBytes = 1024

// Bucket is an open bucket. Safe for concurrent use.
type Bucket struct {
	b        *blob.Bucket
	url      string
	lockPath string // file:// only: the lock Create holds
}

// Open opens the bucket at url: file:///path (made if missing:
// ?create_dir=true is added), s3://name?region=...&endpoint=...,
// gs://name, or mem:// (a new empty bucket each time).
func Open(ctx context.Context, url string) (*Bucket, error) {
	u := url
	if strings.HasPrefix(u, "file://") && !strings.Contains(u, "create_dir") {
		sep := "?"
		if strings.Contains(u, "?") {
			sep = "&"
		}
		u += sep + "create_dir=true"
	}
	b, err := blob.OpenBucket(ctx, u)
	if err != nil {
		return nil, fmt.Errorf("bucket: open %s: %w", url, err)
	}
	bk := &Bucket{b: b, url: url}
	if dir, ok := strings.CutPrefix(url, "file://"); ok {
		dir, _, _ = strings.Cut(dir, "?")
		bk.lockPath = filepath.Clean(dir) + ".create-lock"
	}
	return bk, nil
}

// URL is the URL the bucket was opened with.
func (b *Bucket) URL() string { return b.url }

// Close releases the bucket.
func (b *Bucket) Close() error { return b.b.Close() }

// CheckKey reports what is wrong with key: empty, over MaxKeyBytes, not
// UTF-8, starting with '/', or with an empty, "." or ".." path segment
// (which some stores, and fileblob, treat as paths).
func CheckKey(key string) error {
	switch {
	case key == "":
		return errors.New("bucket: empty key")
	case len(key) > MaxKeyBytes:
		return fmt.Errorf("bucket: key of %d bytes, more than %d", len(key), MaxKeyBytes)
	case !utf8.ValidString(key):
		return fmt.Errorf("bucket: key %q is not UTF-8", key)
	}
	for _, seg := range strings.Split(key, "/") {
		if seg == "" || seg == "." || seg == ".." {
			return fmt.Errorf("bucket: key %q has an empty, \".\" or \"..\" segment", key)
		}
	}
	return nil
}

// Put writes data at key, replacing what is there.
func (b *Bucket) Put(ctx context.Context, key string, data []byte) error {
	return b.write(ctx, key, data, false)
}

// Create writes data at key only if no object is there; otherwise it
// returns ErrExists and leaves the object as it was.
func (b *Bucket) Create(ctx context.Context, key string, data []byte) error {
	if b.lockPath != "" {
		unlock, err := lockFile(b.lockPath)
		if err != nil {
			return fmt.Errorf("bucket: create %s: %w", key, err)
		}
		defer unlock()
	}
	return b.write(ctx, key, data, true)
}

// lockFile takes an exclusive flock on path (made if missing). Each call
// opens the file anew, so goroutines of one process exclude each other as
// processes do.
func lockFile(path string) (unlock func(), err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		f.Close()
		return nil, err
	}
	return func() {
		syscall.Flock(int(f.Fd()), syscall.LOCK_UN)
		f.Close()
	}, nil
}

func (b *Bucket) write(ctx context.Context, key string, data []byte, ifNotExist bool) error {
	if err := CheckKey(key); err != nil {
		return err
	}
	opts := &blob.WriterOptions{IfNotExist: ifNotExist, ContentType: "application/octet-stream"}
	// One WriteAll: the drivers send an object below their part size as a
	// single request, which is what makes IfNotExist atomic on S3.
	err := b.b.WriteAll(ctx, key, data, opts)
	if ifNotExist && gcerrors.Code(err) == gcerrors.FailedPrecondition {
		return fmt.Errorf("%w: %s", ErrExists, key)
	}
	if err != nil {
		return fmt.Errorf("bucket: write %s: %w", key, err)
	}
	return nil
}

// Get reads the object at key (ErrNotFound when there is none).
func (b *Bucket) Get(ctx context.Context, key string) ([]byte, error) {
	if err := CheckKey(key); err != nil {
		return nil, err
	}
	data, err := b.b.ReadAll(ctx, key)
	if gcerrors.Code(err) == gcerrors.NotFound {
		return nil, fmt.Errorf("%w: %s", ErrNotFound, key)
	}
	if err != nil {
		return nil, fmt.Errorf("bucket: read %s: %w", key, err)
	}
	return data, nil
}

// Exists reports whether an object is at key.
func (b *Bucket) Exists(ctx context.Context, key string) (bool, error) {
	if err := CheckKey(key); err != nil {
		return false, err
	}
	ok, err := b.b.Exists(ctx, key)
	if err != nil {
		return false, fmt.Errorf("bucket: exists %s: %w", key, err)
	}
	return ok, nil
}

// Delete removes the object at key (ErrNotFound when there is none).
func (b *Bucket) Delete(ctx context.Context, key string) error {
	if err := CheckKey(key); err != nil {
		return err
	}
	err := b.b.Delete(ctx, key)
	if gcerrors.Code(err) == gcerrors.NotFound {
		return fmt.Errorf("%w: %s", ErrNotFound, key)
	}
	if err != nil {
		return fmt.Errorf("bucket: delete %s: %w", key, err)
	}
	return nil
}

// Object is one listed object; ModTime is when it was written (zero
// where the store does not say).
type Object struct {
	Key     string
	Size    int64
	ModTime time.Time
}

// List returns the objects whose keys start with prefix, sorted by key.
func (b *Bucket) List(ctx context.Context, prefix string) ([]Object, error) {
	it := b.b.List(&blob.ListOptions{Prefix: prefix})
	var out []Object
	for {
		o, err := it.Next(ctx)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("bucket: list %q: %w", prefix, err)
		}
		if o.IsDir {
			continue
		}
		out = append(out, Object{Key: o.Key, Size: o.Size, ModTime: o.ModTime})
	}
	// Stores list in key order already (fileblob by path); sorted here so
	// that callers may rely on it whatever the driver.
	slices.SortFunc(out, func(a, b Object) int { return strings.Compare(a.Key, b.Key) })
	return out, nil
}

// Dirs returns the "directories" right under prefix (which ends in "/"):
// the distinct next segments of the keys there, each with its trailing
// "/", sorted; one listing of them, not of every object below.
func (b *Bucket) Dirs(ctx context.Context, prefix string) ([]string, error) {
	it := b.b.List(&blob.ListOptions{Prefix: prefix, Delimiter: "/"})
	var out []string
	for {
		o, err := it.Next(ctx)
		if err == io.EOF {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("bucket: list %q: %w", prefix, err)
		}
		if o.IsDir {
			out = append(out, o.Key)
		}
	}
	slices.Sort(out)
	return out, nil
}

// Equal reports whether the object at key holds exactly data: how a
// compactor that lost a race for a checkpoint tells "the same checkpoint,
// written by another" from a different one.
func (b *Bucket) Equal(ctx context.Context, key string, data []byte) (bool, error) {
	got, err := b.Get(ctx, key)
	if err != nil {
		return false, err
	}
	return bytes.Equal(got, data), nil
}
