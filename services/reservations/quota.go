package reservations

import (
	"context"
	"sync"
	"time"
)

// quotas caches, per owner, the count of open reservations.
type quotas struct {
	mu sync.Mutex
	m  map[string]*quota
}

type quota struct {
	mu sync.Mutex // held while the count is refreshed: one query per owner at a time
	n  int
	at time.Time
}

func (q *quotas) of(owner string) *quota {
	q.mu.Lock()
	defer q.mu.Unlock()
	if q.m == nil {
		q.m = map[string]*quota{}
	}
	e := q.m[owner]
	if e == nil {
		e = &quota{}
		q.m[owner] = e
	}
	return e
}

// open returns owner's open reservations as last counted (at most ttl
// ago; Config.RecountEvery) plus those created since. The limit is soft
// anyway (it counts what the projection shows); the cache lets it
// overshoot by at most the creates of one ttl more.
func (q *quota) open(ctx context.Context, ttl time.Duration, count func(context.Context) (int, error)) (int, error) {
	q.mu.Lock()
	defer q.mu.Unlock()
	if !q.at.IsZero() && time.Since(q.at) < ttl {
		return q.n, nil
	}
	n, err := count(ctx)
	if err != nil {
		return 0, err
	}
	q.n, q.at = n, time.Now()
	return n, nil
}

// created counts one more open reservation until the next count.
func (q *quota) created() {
	q.mu.Lock()
	q.n++
	q.mu.Unlock()
}
