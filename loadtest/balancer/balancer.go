// Package balancer is a TCP balancer for tests and load runs, as HAProxy in
// TCP mode with connect health checks would run in front of several BES
// edges: each client connection goes to the next backend, round robin,
// that accepts it within a short timeout (a backend being restarted is
// skipped, not waited for), and the bytes are copied both ways until
// either side closes. A gRPC client's connection stays on one edge for its
// life; when that edge goes away the client dials again and lands on one
// that is up.
package balancer

import (
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"time"
)

// DialTimeout bounds the connect to one backend before the next is tried.
const DialTimeout = 500 * time.Millisecond

// Balancer listens on one address for several backends.
type Balancer struct {
	l        net.Listener
	backends []string

	mu     sync.Mutex
	next   int
	conns  map[net.Conn]struct{}
	served map[string]int // connections given to each backend
	failed int            // connections no backend accepted
	closed bool
	wg     sync.WaitGroup
}

// Start listens on addr (host:0 picks a port) for backends.
func Start(addr string, backends ...string) (*Balancer, error) {
	if len(backends) == 0 {
		return nil, errors.New("balancer: no backends")
	}
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("balancer: %w", err)
	}
	b := &Balancer{l: l, backends: backends, conns: map[net.Conn]struct{}{}, served: map[string]int{}}
	b.wg.Go(b.accept)
	return b, nil
}

// Addr is where clients connect.
func (b *Balancer) Addr() string { return b.l.Addr().String() }

// Served is how many connections each backend was given, and how many
// found no backend up.
func (b *Balancer) Served() (map[string]int, int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	m := make(map[string]int, len(b.served))
	for k, v := range b.served {
		m[k] = v
	}
	return m, b.failed
}

// Close stops listening and closes every proxied connection.
func (b *Balancer) Close() error {
	err := b.l.Close()
	b.mu.Lock()
	b.closed = true
	for c := range b.conns {
		c.Close()
	}
	b.mu.Unlock()
	b.wg.Wait()
	return err
}

func (b *Balancer) accept() {
	for {
		c, err := b.l.Accept()
		if err != nil {
			return
		}
		b.wg.Go(func() { b.proxy(c) })
	}
}

// track adds c to the connections Close closes; false when closed already.
func (b *Balancer) track(cs ...net.Conn) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return false
	}
	for _, c := range cs {
		b.conns[c] = struct{}{}
	}
	return true
}

func (b *Balancer) untrack(cs ...net.Conn) {
	b.mu.Lock()
	defer b.mu.Unlock()
	for _, c := range cs {
		delete(b.conns, c)
	}
}

// dial connects to the next backend that accepts, starting after the one
// the previous connection went to.
func (b *Balancer) dial() (net.Conn, string) {
	b.mu.Lock()
	start := b.next
	b.next = (b.next + 1) % len(b.backends)
	b.mu.Unlock()
	for i := range b.backends {
		addr := b.backends[(start+i)%len(b.backends)]
		if c, err := net.DialTimeout("tcp", addr, DialTimeout); err == nil {
			return c, addr
		}
	}
	return nil, ""
}

func (b *Balancer) proxy(client net.Conn) {
	backend, addr := b.dial()
	b.mu.Lock()
	if backend == nil {
		b.failed++
	} else {
		b.served[addr]++
	}
	b.mu.Unlock()
	if backend == nil {
		client.Close()
		return
	}
	if !b.track(client, backend) {
		client.Close()
		backend.Close()
		return
	}
	defer b.untrack(client, backend)
	done := make(chan struct{}, 2)
	copyHalf := func(dst, src net.Conn) {
		io.Copy(dst, src)
		// Either side's end ends the connection: a half-open proxy would
		// hide a backend's death from the client.
		dst.Close()
		src.Close()
		done <- struct{}{}
	}
	go copyHalf(backend, client)
	go copyHalf(client, backend)
	<-done
	<-done
}
