package agent

import (
	"crypto/tls"
	"testing"
)

// TestLastSessionKeepsTicketThroughSheds: the one ticket is offered under
// any server name, survives a few failed handshakes (connections a busy
// gateway closed before their handshake), and is forgotten after
// keepTicketFails of them in a row; a new ticket starts the count again.
func TestLastSessionKeepsTicketThroughSheds(t *testing.T) {
	var c lastSession
	if _, ok := c.Get("gw-a"); ok {
		t.Fatal("an empty cache offered a ticket")
	}
	first, second := new(tls.ClientSessionState), new(tls.ClientSessionState)
	c.Put("gw-a", first)
	if got, ok := c.Get("gw-b"); !ok || got != first {
		t.Fatal("gw-a's ticket is not offered to gw-b")
	}
	for i := 1; i < keepTicketFails; i++ {
		c.Put("gw-b", nil)
		if got, _ := c.Get("gw-b"); got != first {
			t.Fatalf("ticket forgotten after %d failed handshakes", i)
		}
	}
	c.Put("gw-b", second)
	for i := 1; i < keepTicketFails; i++ {
		c.Put("gw-a", nil)
	}
	if got, _ := c.Get("gw-a"); got != second {
		t.Fatal("a new ticket did not reset the failure count")
	}
	c.Put("gw-a", nil)
	if _, ok := c.Get("gw-a"); ok {
		t.Fatalf("ticket kept after %d failed handshakes in a row", keepTicketFails)
	}
}
