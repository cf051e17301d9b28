package netlimit

import (
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/poll"
)

// serve accepts on l and answers each connection with one byte, then
// holds it until the client closes.
func serve(l net.Listener) {
	for {
		c, err := l.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			c.Write([]byte{1})
			io.Copy(io.Discard, c)
		}()
	}
}

// dial connects and reports whether the server answered (true) or closed
// the connection at once (false).
func dial(t *testing.T, addr string) (net.Conn, bool) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var b [1]byte
	_, err = io.ReadFull(c, b[:])
	if err != nil && !errors.Is(err, io.EOF) && !errors.Is(err, io.ErrUnexpectedEOF) && !isReset(err) {
		t.Fatalf("read: %v", err)
	}
	return c, err == nil
}

func isReset(err error) bool {
	var op *net.OpError
	return errors.As(err, &op)
}

func wrap(t *testing.T, l net.Listener, c Config) *Listener {
	t.Helper()
	w, err := Wrap(l, c)
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestWrapRefusesNegatives: a negative cap is a mistake, not "no cap".
func TestWrapRefusesNegatives(t *testing.T) {
	for field, c := range map[string]Config{"Max": {Max: -1}, "PerAddr": {PerAddr: -1}} {
		if _, err := Wrap(nil, c); err == nil || !strings.Contains(err.Error(), "netlimit: "+field+" -1 is negative; set 0 for the default (no cap)") {
			t.Errorf("%s negative: %v, want an error naming it", field, err)
		}
	}
}

// TestZeroIsNoCap: the zero Config holds a client to nothing.
func TestZeroIsNoCap(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := wrap(t, inner, Config{})
	defer l.Close()
	go serve(l)
	for i := range 20 {
		c, ok := dial(t, inner.Addr().String())
		if !ok {
			t.Fatalf("connection %d refused without a cap", i+1)
		}
		defer c.Close()
	}
}

func TestPerAddrAndMax(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	refused := map[string]int{}
	l := wrap(t, inner, Config{Max: 3, PerAddr: 2, OnRefuse: func(r string) { mu.Lock(); refused[r]++; mu.Unlock() }})
	defer l.Close()
	go serve(l)
	addr := inner.Addr().String()

	a, ok := dial(t, addr)
	if !ok {
		t.Fatal("first connection refused")
	}
	b, ok := dial(t, addr)
	if !ok {
		t.Fatal("second connection refused")
	}
	c, ok := dial(t, addr)
	if ok {
		t.Fatal("third connection from one address accepted over PerAddr 2")
	}
	c.Close()
	a.Close()
	// The freed slot is given back once the server side has closed too.
	if !poll.True(func() bool { return l.Open() == 1 }, poll.Within(10*time.Second)) {
		t.Fatalf("%d connections held after one closed", l.Open())
	}
	d, ok := dial(t, addr)
	if !ok {
		t.Fatal("connection refused after one closed")
	}
	b.Close()
	d.Close()
	mu.Lock()
	defer mu.Unlock()
	if refused["per_addr"] != 1 {
		t.Fatalf("refusals %v, want one per_addr", refused)
	}
}

func TestMaxAndLoopbackExempt(t *testing.T) {
	inner, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	l := wrap(t, inner, Config{Max: 2, PerAddr: 1, ExemptLoopback: true})
	defer l.Close()
	go serve(l)
	addr := inner.Addr().String()
	a, ok := dial(t, addr)
	b, ok2 := dial(t, addr)
	if !ok || !ok2 {
		t.Fatal("loopback clients were held to PerAddr")
	}
	c, ok := dial(t, addr)
	if ok {
		t.Fatal("a third connection was accepted over Max 2")
	}
	a.Close()
	b.Close()
	c.Close()
}

func TestIsLoopback(t *testing.T) {
	for addr, want := range map[string]bool{
		"127.0.0.1:1": true, "localhost:1": true, "[::1]:1": true, "127.1.2.3:1": true,
		":1": false, "0.0.0.0:1": false, "[::]:1": false, "10.0.0.1:1": false, "example.com:1": false,
	} {
		if got := IsLoopback(addr); got != want {
			t.Errorf("IsLoopback(%q) = %v", addr, got)
		}
	}
}
