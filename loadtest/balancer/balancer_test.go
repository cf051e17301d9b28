package balancer

import (
	"bufio"
	"net"
	"testing"
)

// echo serves one line back per connection, prefixed with its name.
func echo(t *testing.T, name string) net.Listener {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				line, err := bufio.NewReader(c).ReadString('\n')
				if err == nil {
					c.Write([]byte(name + ":" + line))
				}
			}()
		}
	}()
	return l
}

func roundTrip(t *testing.T, addr string) string {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("hi\n")); err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(c).ReadString('\n')
	return line
}

// Connections alternate between the backends; one that is down is
// skipped; with none up the client's connection is closed.
func TestBalancer(t *testing.T) {
	a, b := echo(t, "a"), echo(t, "b")
	bal, err := Start("127.0.0.1:0", a.Addr().String(), b.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	defer bal.Close()
	got := map[string]int{}
	for range 4 {
		got[roundTrip(t, bal.Addr())]++
	}
	if got["a:hi\n"] != 2 || got["b:hi\n"] != 2 {
		t.Fatalf("answers %v, want two from each backend", got)
	}
	a.Close()
	for range 3 {
		if r := roundTrip(t, bal.Addr()); r != "b:hi\n" {
			t.Fatalf("with a down: %q, want b's answer", r)
		}
	}
	b.Close()
	if r := roundTrip(t, bal.Addr()); r != "" {
		t.Fatalf("with no backend up: %q, want the connection closed", r)
	}
	served, failed := bal.Served()
	if served[a.Addr().String()] != 2 || served[b.Addr().String()] != 5 || failed != 1 {
		t.Fatalf("served %v, %d failed; want a 2, b 5, 1 failed", served, failed)
	}
}
