package fleet

import (
	"errors"
	"net"
	"runtime"
	"sync/atomic"
	"time"

	"google.golang.org/grpc/credentials"
)

// Handshake admission. A TLS handshake costs the gateway a signature and a
// certificate chain verification, about a millisecond of CPU. When a
// gateway dies, every node it held dials the others within a second; left
// alone, ten thousand handshakes then progress at once on a few cores,
// each taking so long that nodes give up (their Hello times out) and dial
// again, and the work done is wasted: measured here, 10,000 nodes took over
// 90 s to re-home. So the gateway runs at most a few handshakes at a time
// (the rest wait their turn on an accepted connection, in arrival order)
// and closes new connections at once while too many wait: such a node sees
// a failed dial and backs off, at the cost of a syscall here.
const (
	// handshakesPerCore is how many handshakes may run at once per core. A
	// handshake spends most of its time waiting for the node's messages
	// (several round trips), not on this CPU: with two per core a loaded
	// machine's slow clients held the slots and admitted only about 100
	// sessions a second; 32 per core still keeps thousands from running
	// at once.
	handshakesPerCore = 32
	// handshakeWait is how long a connection waits for a slot. A node's
	// dial and Hello together time out after 15 s; this leaves it 3 s for
	// its handshake and Hello. (At 8 s, a quarter of the nodes of a 10,000
	// node re-home were closed after their wait and queued again at the
	// back, which made the slowest take twice as long.)
	handshakeWait = 12 * time.Second
)

var errHandshakeBusy = errors.New("fleet: too many TLS handshakes waiting; dial again later")

// limitedCreds wraps the gateway's TLS credentials with the admission above.
type limitedCreds struct {
	credentials.TransportCredentials
	slots   chan struct{}
	waiting *atomic.Int64
	queue   int64
	wait    time.Duration
	m       *Metrics
	// deadline bounds the TLS handshake once it has a slot, and setup is
	// the connection's whole set-up (gRPC's ConnectionTimeout, which the
	// handshake's deadline overrides and which is put back after it, for
	// the HTTP/2 preface that follows). Zero: no deadline of ours.
	deadline, setup time.Duration
}

// newLimitedCreds allows handshakesPerCore handshakes per core at once,
// and as many connections to wait as the gateway may hold sessions: a
// waiting connection costs little (a socket and a parked goroutine), one
// closed comes back later and waits again, at the back. (With a queue of
// 8,192, the 1,800 nodes of a 10,000-node re-home that found it full were
// the slowest to re-home, by seconds.)
func newLimitedCreds(inner credentials.TransportCredentials, m *Metrics, queue int) *limitedCreds {
	return newLimitedCredsN(inner, m, handshakesPerCore*runtime.GOMAXPROCS(0), queue, handshakeWait)
}

func newLimitedCredsN(inner credentials.TransportCredentials, m *Metrics, slots, queue int, wait time.Duration) *limitedCreds {
	return &limitedCreds{
		TransportCredentials: inner,
		slots:                make(chan struct{}, slots),
		waiting:              new(atomic.Int64),
		queue:                int64(queue),
		wait:                 wait,
		m:                    m,
	}
}

func (c *limitedCreds) ServerHandshake(conn net.Conn) (net.Conn, credentials.AuthInfo, error) {
	start := time.Now()
	if c.waiting.Add(1) > c.queue {
		c.waiting.Add(-1)
		c.m.handshakeShed.Inc()
		return nil, nil, errHandshakeBusy
	}
	t := time.NewTimer(c.wait)
	select {
	case c.slots <- struct{}{}:
		t.Stop()
		c.waiting.Add(-1)
	case <-t.C:
		c.waiting.Add(-1)
		c.m.handshakeShed.Inc()
		return nil, nil, errHandshakeBusy
	}
	defer func() { <-c.slots }()
	if c.deadline > 0 {
		// A handshake that has a slot must progress: a client that opened
		// TCP and sends nothing would otherwise hold the slot until
		// gRPC's connection timeout, and a few hundred such clients would
		// stop every node from connecting.
		conn.SetDeadline(time.Now().Add(c.deadline))
	}
	out, ai, err := c.TransportCredentials.ServerHandshake(conn)
	if c.deadline > 0 {
		if err != nil {
			if ne, ok := errors.AsType[net.Error](err); ok && ne.Timeout() {
				c.m.tlsHandshakes.WithLabelValues("timeout").Inc()
			}
		} else if c.setup > 0 {
			conn.SetDeadline(start.Add(c.setup))
		} else {
			conn.SetDeadline(time.Time{})
		}
	}
	if info, ok := ai.(credentials.TLSInfo); ok && err == nil {
		mode := "full"
		if info.State.DidResume {
			mode = "resumed"
		}
		c.m.tlsHandshakes.WithLabelValues(mode).Inc()
	}
	return out, ai, err
}

func (c *limitedCreds) Clone() credentials.TransportCredentials {
	cp := *c
	cp.TransportCredentials = c.TransportCredentials.Clone()
	return &cp
}
