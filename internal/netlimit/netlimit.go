// Package netlimit caps the connections a listener holds: in all, and per
// client address, so that one client (or one address behind which many
// sit) cannot take every file descriptor and goroutine of a server before
// it has authenticated anything.
//
// A connection over a cap is closed as soon as it is accepted: the client
// sees its connection reset and retries (gRPC clients report UNAVAILABLE,
// which Bazel retries with backoff), rather than waiting in the kernel's
// backlog with no answer.
package netlimit

import (
	"errors"
	"net"
	"sync"

	"github.com/millrace/millrace/internal/knob"
)

// Config of a Listener. A zero cap means no cap; a negative one is an
// error of Wrap.
type Config struct {
	// Max is the most connections open at once. Zero: no cap.
	Max int
	// PerAddr is the most connections open at once from one client IP.
	// Zero: no cap.
	PerAddr int
	// ExemptLoopback leaves clients on loopback out of PerAddr: a local
	// TLS proxy or load generator is one address for many clients. They
	// still count towards Max.
	ExemptLoopback bool
	// OnRefuse, when set, is called for every connection closed at once,
	// with the cap it met: "max" or "per_addr".
	OnRefuse func(reason string)
}

// Listener is a net.Listener with caps.
type Listener struct {
	net.Listener
	cfg Config

	mu     sync.Mutex
	total  int
	byAddr map[string]int
}

// Validate reports a negative cap.
func (c Config) Validate() error {
	return errors.Join(
		knob.NotNegative("netlimit", "Max", c.Max, "no cap"),
		knob.NotNegative("netlimit", "PerAddr", c.PerAddr, "no cap"),
	)
}

// Wrap caps l's connections, or says what is wrong with c (l is left
// open).
func Wrap(l net.Listener, c Config) (*Listener, error) {
	if err := c.Validate(); err != nil {
		return nil, err
	}
	return &Listener{Listener: l, cfg: c, byAddr: map[string]int{}}, nil
}

// Accept returns the next connection within the caps, closing those over.
func (l *Listener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		addr, counted := clientIP(c, l.cfg.ExemptLoopback)
		if reason := l.take(addr, counted); reason != "" {
			c.Close()
			if l.cfg.OnRefuse != nil {
				l.cfg.OnRefuse(reason)
			}
			continue
		}
		return &conn{Conn: c, l: l, addr: addr, counted: counted}, nil
	}
}

// clientIP is the IP a connection counts against, and whether it counts.
func clientIP(c net.Conn, exemptLoopback bool) (string, bool) {
	ta, ok := c.RemoteAddr().(*net.TCPAddr)
	if !ok {
		return c.RemoteAddr().String(), true
	}
	if exemptLoopback && ta.IP.IsLoopback() {
		return "", false
	}
	return ta.IP.String(), true
}

func (l *Listener) take(addr string, perAddr bool) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.cfg.Max > 0 && l.total >= l.cfg.Max {
		return "max"
	}
	if perAddr && l.cfg.PerAddr > 0 && l.byAddr[addr] >= l.cfg.PerAddr {
		return "per_addr"
	}
	l.total++
	if perAddr {
		l.byAddr[addr]++
	}
	return ""
}

func (l *Listener) release(addr string, perAddr bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.total--
	if perAddr {
		if l.byAddr[addr]--; l.byAddr[addr] <= 0 {
			delete(l.byAddr, addr)
		}
	}
}

// IsLoopback reports whether a listen address ("host:port") accepts only
// local connections. An empty host (":1985") listens on every interface.
func IsLoopback(listen string) bool {
	host, _, err := net.SplitHostPort(listen)
	if err != nil {
		host = listen
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

// Open is the number of connections held.
func (l *Listener) Open() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.total
}

type conn struct {
	net.Conn
	l       *Listener
	addr    string
	counted bool
	once    sync.Once
}

func (c *conn) Close() error {
	err := c.Conn.Close()
	c.once.Do(func() { c.l.release(c.addr, c.counted) })
	return err
}
