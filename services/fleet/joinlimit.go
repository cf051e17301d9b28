package fleet

import (
	"context"
	"net"
	"sync"
	"time"

	"golang.org/x/time/rate"
	"google.golang.org/grpc/peer"
)

// Join admission. Join needs no certificate, so anyone who can reach the
// gateway may call it, and each call that passes costs a signature. Joins
// therefore have token buckets of their own, apart from the session
// handshakes': one per client address (one host flooding Join is refused
// at its own rate) and one for all Joins together (many hosts at once).
// Before this, Join drew on the sessions' bucket, and a Join flood from
// one address refused the reconnecting nodes of the whole fleet
// "handshake_rate".

// maxJoinClients bounds the per-address buckets kept. Beyond it, addresses
// without a bucket share one: a flood from very many addresses is then
// bounded by that bucket and the global one, and the memory by this.
const maxJoinClients = 65536

// joinClientIdle is how long an address's bucket is kept after its last
// Join; a bucket left alone this long is full again anyway.
const joinClientIdle = time.Minute

type joinLimiter struct {
	rate  rate.Limit
	burst int
	all   *rate.Limiter

	mu       sync.Mutex
	clients  map[string]*joinClient
	overflow *rate.Limiter
}

type joinClient struct {
	lim  *rate.Limiter
	last time.Time
}

func newJoinLimiter(perClient float64, perClientBurst int, total float64, totalBurst int) *joinLimiter {
	return &joinLimiter{
		rate:     rate.Limit(perClient),
		burst:    perClientBurst,
		all:      rate.NewLimiter(rate.Limit(total), totalBurst),
		clients:  map[string]*joinClient{},
		overflow: rate.NewLimiter(rate.Limit(perClient), perClientBurst),
	}
}

// allow takes a token for one Join from addr, first from the address's
// bucket (so that a flooding address does not drain the global one).
func (l *joinLimiter) allow(addr string, now time.Time) bool {
	l.mu.Lock()
	c := l.clients[addr]
	var lim *rate.Limiter
	switch {
	case c != nil:
		c.last = now
		lim = c.lim
	case len(l.clients) < maxJoinClients:
		c = &joinClient{lim: rate.NewLimiter(l.rate, l.burst), last: now}
		l.clients[addr] = c
		lim = c.lim
	default:
		lim = l.overflow
	}
	l.mu.Unlock()
	if !lim.AllowN(now, 1) {
		return false
	}
	return l.all.AllowN(now, 1)
}

// sweep forgets addresses idle for joinClientIdle.
func (l *joinLimiter) sweep(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for a, c := range l.clients {
		if now.Sub(c.last) > joinClientIdle {
			delete(l.clients, a)
		}
	}
}

// clientAddr is the host of a call's peer (the port differs per
// connection, so it is not part of a client's identity). An IPv6 address
// counts by its /64: one host commonly holds a whole /64.
func clientAddr(ctx context.Context) string {
	p, ok := peer.FromContext(ctx)
	if !ok || p.Addr == nil {
		return ""
	}
	host, _, err := net.SplitHostPort(p.Addr.String())
	if err != nil {
		return p.Addr.String()
	}
	if ip := net.ParseIP(host); ip != nil && ip.To4() == nil {
		return ip.Mask(net.CIDRMask(64, 128)).String() + "/64"
	}
	return host
}
