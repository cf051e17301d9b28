package bucket

import (
	"context"
	"errors"

	"github.com/prometheus/client_golang/prometheus"
)

// Counted is a Bucket whose operations are counted, by operation (put,
// create, get, exists, delete, list, equal) and result (ok; exists, for a
// Create that found the key taken; error): what a user of the bucket
// costs in requests, and so in money on S3 or GCS, shows in its metrics.
type Counted struct {
	b   *Bucket
	ops *prometheus.CounterVec
}

// NewOperations makes and registers on reg (nil: none) the counter a
// Counted counts in, labelled op and result; name and help are the
// metric's (one per user: millrace_compactor_bucket_operations_total).
func NewOperations(reg prometheus.Registerer, name, help string) *prometheus.CounterVec {
	ops := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, []string{"op", "result"})
	if reg != nil {
		reg.MustRegister(ops)
	}
	return ops
}

// Count wraps b, counting in ops (made by NewOperations).
func Count(b *Bucket, ops *prometheus.CounterVec) Counted { return Counted{b: b, ops: ops} }

func (c Counted) count(op string, err error) {
	result := "ok"
	switch {
	case errors.Is(err, ErrExists):
		result = "exists" // a race or a retried pass: expected
	case err != nil:
		result = "error"
	}
	c.ops.WithLabelValues(op, result).Inc()
}

// Put is Bucket.Put, counted.
func (c Counted) Put(ctx context.Context, key string, data []byte) error {
	err := c.b.Put(ctx, key, data)
	c.count("put", err)
	return err
}

// Create is Bucket.Create, counted.
func (c Counted) Create(ctx context.Context, key string, data []byte) error {
	err := c.b.Create(ctx, key, data)
	c.count("create", err)
	return err
}

// Get is Bucket.Get, counted.
func (c Counted) Get(ctx context.Context, key string) ([]byte, error) {
	data, err := c.b.Get(ctx, key)
	c.count("get", err)
	return data, err
}

// Exists is Bucket.Exists, counted.
func (c Counted) Exists(ctx context.Context, key string) (bool, error) {
	ok, err := c.b.Exists(ctx, key)
	c.count("exists", err)
	return ok, err
}

// Delete is Bucket.Delete, counted.
func (c Counted) Delete(ctx context.Context, key string) error {
	err := c.b.Delete(ctx, key)
	c.count("delete", err)
	return err
}

// List is Bucket.List, counted.
func (c Counted) List(ctx context.Context, prefix string) ([]Object, error) {
	objs, err := c.b.List(ctx, prefix)
	c.count("list", err)
	return objs, err
}

// Equal is Bucket.Equal, counted.
func (c Counted) Equal(ctx context.Context, key string, data []byte) (bool, error) {
	same, err := c.b.Equal(ctx, key, data)
	c.count("equal", err)
	return same, err
}
