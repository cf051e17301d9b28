package reservations

import (
	"context"
	"testing"
	"time"
)

// A storm of creates counts an owner's open reservations once per
// RecountEvery, and the creates made since are added to that count.
func TestQuotaCountsOncePerInterval(t *testing.T) {
	var q quotas
	counts := 0
	count := func(context.Context) (int, error) { counts++; return 10, nil }
	e := q.of("alice")
	for i := range 5 {
		n, err := e.open(context.Background(), time.Hour, count)
		if err != nil {
			t.Fatal(err)
		}
		if n != 10+i {
			t.Fatalf("create %d saw %d open, want %d", i, n, 10+i)
		}
		e.created()
	}
	if counts != 1 {
		t.Fatalf("counted %d times within the interval, want 1", counts)
	}
	if q.of("bob") == e {
		t.Fatal("two owners share a count")
	}
	if _, err := e.open(context.Background(), -1, count); err != nil || counts != 2 {
		t.Fatalf("a negative interval must count every time (counted %d, %v)", counts, err)
	}
}
