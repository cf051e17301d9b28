package bucket

import (
	"context"
	"errors"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// Each operation is counted once under its name and result; a Create
// that finds its key taken is "exists", not an error.
func TestCounted(t *testing.T) {
	ctx := context.Background()
	reg := prometheus.NewRegistry()
	ops := NewOperations(reg, "test_bucket_operations_total", "test")
	c := Count(open(t, "mem://"), ops)
	if err := c.Create(ctx, "k", []byte("v")); err != nil {
		t.Fatal(err)
	}
	if err := c.Create(ctx, "k", []byte("v")); !errors.Is(err, ErrExists) {
		t.Fatalf("second Create: %v", err)
	}
	if _, err := c.Get(ctx, "missing"); !errors.Is(err, ErrNotFound) {
		t.Fatalf("Get of a missing key: %v", err)
	}
	c.Put(ctx, "p", []byte("x"))
	c.Get(ctx, "k")
	c.List(ctx, "")
	c.Equal(ctx, "k", []byte("v"))
	c.Exists(ctx, "k")
	c.Delete(ctx, "p")
	for _, w := range []struct {
		op, result string
		want       float64
	}{
		{"create", "ok", 1}, {"create", "exists", 1}, {"get", "error", 1}, {"get", "ok", 1},
		{"put", "ok", 1}, {"list", "ok", 1}, {"equal", "ok", 1}, {"exists", "ok", 1}, {"delete", "ok", 1},
	} {
		if got := testutil.ToFloat64(ops.WithLabelValues(w.op, w.result)); got != w.want {
			t.Errorf("%s/%s: %v, want %v", w.op, w.result, got, w.want)
		}
	}
	if n := testutil.CollectAndCount(ops); n != 9 {
		t.Errorf("%d series, want 9", n)
	}
}
