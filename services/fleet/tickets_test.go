package fleet

import (
	"crypto/tls"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
)

// nodeTLS is a node's client configuration with a session cache of its
// own, kept across dials as an agent keeps it.
func nodeTLS(t *testing.T, ca *CA, id, pool string) *tls.Config {
	t.Helper()
	certPEM, keyPEM, err := ca.NodeCredentials(id, pool)
	if err != nil {
		t.Fatal(err)
	}
	tc, err := NodeTLS(testCA().CertPEM(), certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	tc.ClientSessionCache = tls.NewLRUClientSessionCache(1)
	return tc
}

func (gw *gateway) handshakes(t *testing.T, mode string) float64 {
	return counter(t, gw.reg, "millrace_fleet_tls_handshakes_total", mode)
}

// TestResumeAtAnotherGateway: a node's second session, at another gateway
// of the fleet, resumes the TLS session the first gateway gave it a ticket
// for; a gateway of another CA, or with resumption off, does a full
// handshake; and the resumed session is checked like any other.
func TestResumeAtAnotherGateway(t *testing.T) {
	b := newBackbone(t)
	a := startGateway(t, b, Config{GatewayID: "gw-a"})
	bgw := startGateway(t, b, Config{GatewayID: "gw-b"})
	off := startGateway(t, b, Config{GatewayID: "gw-off", DisableResumption: true})

	tc := nodeTLS(t, testCA(), "n-1", "p")
	c := openSession(t, a.dial(t, tc), helloMsg(testHello("n-1", "p")))
	c.welcome()
	if full, res := a.handshakes(t, "full"), a.handshakes(t, "resumed"); full != 1 || res != 0 {
		t.Fatalf("gw-a: %v full, %v resumed handshakes; want 1, 0", full, res)
	}

	c = openSession(t, bgw.dial(t, tc), helloMsg(testHello("n-1", "p")))
	c.welcome()
	if full, res := bgw.handshakes(t, "full"), bgw.handshakes(t, "resumed"); full != 0 || res != 1 {
		t.Fatalf("gw-b: %v full, %v resumed handshakes; want 0, 1", full, res)
	}

	// The ticket stands for n-1's certificate: a Hello of another node on
	// the resumed session is refused as it would be on a full one.
	c = openSession(t, bgw.dial(t, tc), helloMsg(testHello("n-2", "p")))
	r, err := c.refused()
	checkRefusal(t, r, err, "unauthenticated", codes.PermissionDenied)
	if res := bgw.handshakes(t, "resumed"); res != 2 {
		t.Fatalf("gw-b: %v resumed handshakes, want 2", res)
	}

	c = openSession(t, off.dial(t, tc), helloMsg(testHello("n-1", "p")))
	c.welcome()
	if full, res := off.handshakes(t, "full"), off.handshakes(t, "resumed"); full != 1 || res != 0 {
		t.Fatalf("gw-off: %v full, %v resumed handshakes; want 1, 0", full, res)
	}
}

// TestTicketKeys: a ticket opens with the keys of its period and of the
// next, not later, and never with another CA's.
func TestTicketKeys(t *testing.T) {
	other, err := NewCA("other fleet")
	if err != nil {
		t.Fatal(err)
	}
	at := time.Date(2026, 11, 30, 12, 0, 0, 0, time.UTC)
	clock := func(d time.Duration) func() time.Time { return func() time.Time { return at.Add(d) } }
	keys := func(ca *CA, d time.Duration) *ticketKeys {
		k, err := newTicketKeys(ca, clock(d))
		if err != nil {
			t.Fatal(err)
		}
		return k
	}
	ss := ticketSession(t)
	ticket, err := keys(testCA(), 0).current().EncryptTicket(tls.ConnectionState{}, ss)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		k    *ticketKeys
		want bool
	}{
		{"same period, another gateway", keys(testCA(), 0), true},
		{"next period", keys(testCA(), ticketPeriod), true},
		{"two periods on", keys(testCA(), 2*ticketPeriod), false},
		{"another CA", keys(other, 0), false},
	} {
		got, err := c.k.current().DecryptTicket(ticket, tls.ConnectionState{})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		if (got != nil) != c.want {
			t.Errorf("%s: ticket opened %v, want %v", c.name, got != nil, c.want)
		}
	}
}

// ticketSession is a session state to put in a ticket: the server side of
// a real handshake, as WrapSession sees it.
func ticketSession(t *testing.T) *tls.SessionState {
	t.Helper()
	ch := make(chan *tls.SessionState, 1)
	srv, err := testCA().ServerTLS([]string{"127.0.0.1"})
	if err != nil {
		t.Fatal(err)
	}
	srv = srv.Clone()
	srv.WrapSession = func(cs tls.ConnectionState, ss *tls.SessionState) ([]byte, error) {
		select {
		case ch <- ss:
		default:
		}
		return srv.EncryptTicket(cs, ss)
	}
	lis, err := tls.Listen("tcp", "127.0.0.1:0", srv)
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	go func() {
		c, err := lis.Accept()
		if err == nil {
			c.(*tls.Conn).Handshake()
			c.Write([]byte("x"))
			c.Close()
		}
	}()
	tc := nodeTLS(t, testCA(), "n-1", "p")
	conn, err := tls.Dial("tcp", lis.Addr().String(), tc)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	conn.Read(make([]byte, 1)) // the ticket comes after the handshake
	select {
	case ss := <-ch:
		return ss
	case <-time.After(5 * time.Second):
		t.Fatal("no session ticket issued")
		return nil
	}
}
