package fleet

import (
	"context"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/internal/poll"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// A Join flood from one client address is refused at that address's rate
// and leaves the session handshakes' bucket alone: nodes reconnecting with
// their certificates are welcomed, and a Join from another address works.
func TestJoinFloodDoesNotRefuseReconnects(t *testing.T) {
	b := newBackbone(t)
	tokens, err := ParseJoinTokens("gpu=tok-0123456789abcdef")
	if err != nil {
		t.Fatal(err)
	}
	// A session bucket of 3 that barely refills: a flood that drew on it
	// would refuse the reconnects below.
	gw := startGateway(t, b, Config{JoinTokens: tokens, HandshakeRate: 0.001, HandshakeBurst: 3,
		JoinRatePerClient: 0.001, JoinBurstPerClient: 5})
	noCert, err := NodeTLS(testCA().CertPEM(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	flooder := fleetpb.NewGatewayClient(gw.dial(t, noCert))
	ctx := t.Context()
	limited := 0
	for range 200 {
		_, err := flooder.Join(ctx, &fleetpb.JoinRequest{Token: "not-a-token-of-this-fleet", NodeId: "x", Csr: []byte("x")})
		switch status.Code(err) {
		case codes.ResourceExhausted:
			limited++
			if !strings.Contains(status.Convert(err).Message(), CodeJoinRate) {
				t.Fatalf("rate-limited Join: %v does not name %q", err, CodeJoinRate)
			}
			if _, ok := RetryAfter(err); !ok {
				t.Fatalf("rate-limited Join: %v carries no RetryInfo", err)
			}
		case codes.Unauthenticated:
		default:
			t.Fatalf("flood Join: %v", err)
		}
	}
	if limited < 190 {
		t.Fatalf("%d of 200 flood Joins rate-limited, want all but the burst of 5", limited)
	}
	// Three nodes reconnect with their certificates: the session bucket is
	// untouched by the flood.
	for _, id := range []string{"n1", "n2", "n3"} {
		gw.connect(t, id, "gpu")
	}
	// Another address (127.0.0.2 is loopback too) joins at once.
	other, err := grpc.NewClient(gw.addr, grpc.WithTransportCredentials(credentials.NewTLS(noCert)),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
			return d.DialContext(ctx, "tcp", addr)
		}))
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	csr, _, err := NewNodeCSR("node-j")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := fleetpb.NewGatewayClient(other).Join(ctx, &fleetpb.JoinRequest{Token: "tok-0123456789abcdef", NodeId: "node-j", Csr: csr}); err != nil {
		t.Fatalf("Join from another address during the flood: %v", err)
	}
}

// A client that opens TCP and sends nothing is dropped at the TLS
// handshake deadline, well before the connection's set-up timeout.
func TestSilentClientDroppedAtHandshakeDeadline(t *testing.T) {
	b := newBackbone(t)
	gw := startGateway(t, b, Config{TLSHandshakeTimeout: 200 * time.Millisecond, HelloTimeout: 30 * time.Second})
	conn, err := net.Dial("tcp", gw.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	// The client's own limit, far above the deadline and far below the
	// 30 s set-up timeout: the read ends when the gateway closes.
	conn.SetReadDeadline(time.Now().Add(10 * time.Second))
	start := time.Now()
	_, err = conn.Read(make([]byte, 1))
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		t.Fatalf("the gateway still held a silent connection after %s", time.Since(start).Round(time.Millisecond))
	}
	if err == nil {
		t.Fatal("the gateway sent bytes to a client that said nothing")
	}
	if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "reset") {
		t.Fatalf("read: %v", err)
	}
	poll.Until(t, "the timeout counted", func() bool {
		return counter(t, gw.reg, "millrace_fleet_tls_handshakes_total", "timeout") == 1
	})
	// A real node still connects.
	gw.connect(t, "n1", "p")
}

// Revoking a certificate (by serial) in the deny list file closes its
// live session and refuses its reconnect, and revoking a node identity
// refuses its Join, without a restart; a deny list that does not parse
// keeps the one in force.
func TestRevokedCertificateClosedAndRefused(t *testing.T) {
	b := newBackbone(t)
	tokens, err := ParseJoinTokens("p=tok-0123456789abcdef")
	if err != nil {
		t.Fatal(err)
	}
	deny := filepath.Join(t.TempDir(), "deny")
	if err := os.WriteFile(deny, []byte("# revoked node certificates\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	gw := startGateway(t, b, Config{JoinTokens: tokens, DenyListFile: deny, DenyListCheck: 10 * time.Millisecond})

	certPEM, keyPEM, err := testCA().NodeCredentials("n1", "p")
	if err != nil {
		t.Fatal(err)
	}
	tc, err := NodeTLS(testCA().CertPEM(), certPEM, keyPEM)
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(certPEM)
	cert, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	c := openSession(t, gw.dial(t, tc), helloMsg(testHello("n1", "p")))
	c.welcome()
	other, _ := gw.connect(t, "n2", "p")

	// As openssl prints it: upper case, "serial=" prefix.
	line := "serial=" + strings.ToUpper(cert.SerialNumber.Text(16)) + "  # n1, key leaked\n"
	if err := os.WriteFile(deny, []byte(line), 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := c.refused()
	checkRefusal(t, r, err, CodeRevoked, codes.PermissionDenied)
	b.waitEvents(t, "n1's revoked disconnect", 1, func(ev *fleetpb.NodeEvent) bool {
		return ev.GetDisconnected() != nil && ev.GetNodeId() == "n1" && ev.GetDisconnected().GetReason() == reasonRevoked
	})
	// Its reconnect, over a fresh connection, is refused.
	r, err = openSession(t, gw.dial(t, tc), helloMsg(testHello("n1", "p"))).refused()
	checkRefusal(t, r, err, CodeRevoked, codes.PermissionDenied)
	// n2 was not revoked.
	other.sync()

	// A deny list that does not parse keeps n1 revoked.
	if err := os.WriteFile(deny, []byte("not a serial\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the bad list noticed", func() bool {
		return counter(t, gw.reg, "millrace_fleet_deny_list_reloads_total", "error") >= 1
	})
	r, err = openSession(t, gw.dial(t, tc), helloMsg(testHello("n1", "p"))).refused()
	checkRefusal(t, r, err, CodeRevoked, codes.PermissionDenied)

	// Revoking the node identity closes n2 and refuses its Join.
	if err := os.WriteFile(deny, []byte(line+"p/n2\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	r, err = other.refused()
	checkRefusal(t, r, err, CodeRevoked, codes.PermissionDenied)
	noCert, err := NodeTLS(testCA().CertPEM(), nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	csr, _, err := NewNodeCSR("n2")
	if err != nil {
		t.Fatal(err)
	}
	_, err = fleetpb.NewGatewayClient(gw.dial(t, noCert)).Join(t.Context(), &fleetpb.JoinRequest{Token: "tok-0123456789abcdef", NodeId: "n2", Csr: csr})
	if status.Code(err) != codes.PermissionDenied {
		t.Fatalf("Join of a revoked node: %v, want PERMISSION_DENIED", err)
	}

	// Taking n1 off the list lets it back in.
	if err := os.WriteFile(deny, []byte("p/n2\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "n1 let back in", func() bool {
		_, ok := gw.srv.denied.Load().denies(serialKey(cert.SerialNumber), nodeKey{"p", "n1"})
		return !ok
	})
	openSession(t, gw.dial(t, tc), helloMsg(testHello("n1", "p"))).welcome()
}

func TestParseDenyList(t *testing.T) {
	d, err := ParseDenyList("# comment\n\n3A:F2:00:01\nserial=0x3af20002 # trailing\n gpu / node-7 \n")
	if err != nil {
		t.Fatal(err)
	}
	if d.Len() != 3 {
		t.Fatalf("%d entries, want 3", d.Len())
	}
	for _, s := range []string{"3af20001", "3af20002"} {
		if _, ok := d.denies(s, nodeKey{}); !ok {
			t.Errorf("serial %s not denied", s)
		}
	}
	if _, ok := d.denies("", nodeKey{"gpu", "node-7"}); !ok {
		t.Error("gpu/node-7 not denied")
	}
	for _, bad := range []string{"zz-top", "gpu/", "/node", "gpu/a\x01b"} {
		if _, err := ParseDenyList("3af2\n" + bad + "\n"); err == nil || !strings.Contains(err.Error(), "line 2") {
			t.Errorf("%q: %v, want an error naming line 2", bad, err)
		}
	}
}

// The deny list file is read from disk, not from the network, but an
// operator's tool may write anything into it.
func FuzzParseDenyList(f *testing.F) {
	f.Add("3A:F2\ngpu/node-1 # c\n")
	f.Add("serial=0x01\n\n#\n")
	f.Fuzz(func(t *testing.T, s string) {
		d, err := ParseDenyList(s)
		if err == nil && d == nil {
			t.Fatal("nil list without an error")
		}
	})
}
