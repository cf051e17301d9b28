package agent

import (
	"crypto/tls"
	"sync"
)

// lastSession is an agent's TLS session cache: the one ticket it was given
// last, offered to whichever gateway it dials next. Go's caches file a
// ticket under the name of the server that issued it; but the gateways of
// a fleet share their ticket keys (services/fleet, tickets.go), and a node
// re-homes precisely to another gateway than the one that gave it the
// ticket. The TLS client still checks that the cached session's server
// certificate is valid for the name now dialed; when it is not, or the
// gateway cannot open the ticket, the handshake is simply a full one.
//
// One per agent: a ticket stands for the node's own certificate.
type lastSession struct {
	mu    sync.Mutex
	cs    *tls.ClientSessionState
	fails int // handshakes failed in a row since cs was given
}

// keepTicketFails is how many failed handshakes in a row keep the ticket.
// The TLS client drops a ticket after any failed handshake that offered it
// (RFC 5077's advice, for a ticket the server rejects); but a gateway
// under a reconnect storm closes connections before their handshake, and
// a node that lost its ticket to that would then cost the gateway a full
// handshake. A ticket a gateway cannot open costs nothing: the handshake
// is a full one, and gives a new ticket.
const keepTicketFails = 4

func (c *lastSession) Get(string) (*tls.ClientSessionState, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.cs, c.cs != nil
}

// Put keeps cs. A nil cs (the TLS client dropping the session after a
// failed handshake) forgets it only after keepTicketFails in a row.
func (c *lastSession) Put(_ string, cs *tls.ClientSessionState) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if cs != nil {
		c.cs, c.fails = cs, 0
		return
	}
	if c.fails++; c.fails >= keepTicketFails {
		c.cs, c.fails = nil, 0
	}
}
