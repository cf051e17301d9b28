package fleet

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func tamper(t testing.TB, csrPEM []byte) []byte {
	t.Helper()
	block, _ := pem.Decode(csrPEM)
	der := append([]byte(nil), block.Bytes...)
	der[len(der)-1] ^= 0x01
	return pem.EncodeToMemory(&pem.Block{Type: block.Type, Bytes: der})
}

func TestLoadOrCreateCA(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ca")
	ca, err := LoadOrCreateCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(dir, CAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o600 {
		t.Fatalf("key mode %v, want 0600", fi.Mode().Perm())
	}
	again, err := LoadOrCreateCA(dir)
	if err != nil {
		t.Fatal(err)
	}
	if !again.Certificate().Equal(ca.Certificate()) {
		t.Fatal("a second LoadOrCreateCA made a new CA")
	}
	loaded, err := LoadCA(filepath.Join(dir, CACertFile), filepath.Join(dir, CAKeyFile))
	if err != nil {
		t.Fatal(err)
	}
	// A certificate issued by the loaded CA verifies against the first.
	certPEM, _, err := loaded.NodeCredentials("n1", "p")
	if err != nil {
		t.Fatal(err)
	}
	block, _ := pem.Decode(certPEM)
	cert, err := x509.ParseCertificate(block.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	node, pool, err := ca.verifyNode([]*x509.Certificate{cert}, time.Now())
	if err != nil || node != "n1" || pool != "p" {
		t.Fatalf("verify: %q %q %v", node, pool, err)
	}
	if _, _, err := ca.verifyNode([]*x509.Certificate{cert}, time.Now().Add(DefaultNodeCertValidity+time.Hour)); err == nil {
		t.Fatal("an expired certificate verified")
	}
	// A key that is not the certificate's is refused.
	otherDir := filepath.Join(t.TempDir(), "other")
	if _, err := LoadOrCreateCA(otherDir); err != nil {
		t.Fatal(err)
	}
	if _, err := LoadCA(filepath.Join(dir, CACertFile), filepath.Join(otherDir, CAKeyFile)); err == nil || !strings.Contains(err.Error(), "does not belong") {
		t.Fatalf("LoadCA with another CA's key: %v", err)
	}
}

func TestServerTLSHosts(t *testing.T) {
	tc, err := testCA().ServerTLS([]string{"gw.example", "10.1.2.3"})
	if err != nil {
		t.Fatal(err)
	}
	leaf := tc.Certificates[0].Leaf
	if err := leaf.VerifyHostname("gw.example"); err != nil {
		t.Error(err)
	}
	if err := leaf.VerifyHostname("10.1.2.3"); err != nil {
		t.Error(err)
	}
	if tc.ClientAuth != tls.RequestClientCert || tc.MinVersion != tls.VersionTLS13 {
		t.Errorf("client auth %v, min version %x", tc.ClientAuth, tc.MinVersion)
	}
}

func TestCheckID(t *testing.T) {
	for _, ok := range []string{"n1", "gpu-node.rack-1.zone-a", "ノード", "a b", strings.Repeat("x", MaxIDBytes)} {
		if err := CheckID("id", ok); err != nil {
			t.Errorf("%q: %v", ok, err)
		}
	}
	for _, bad := range []string{"", "a\nb", "tab\t", "\x7f", "bad\xff", strings.Repeat("x", MaxIDBytes+1), "nul\x00"} {
		if err := CheckID("id", bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	tc, err := testCA().ServerTLS(nil)
	if err != nil {
		t.Fatal(err)
	}
	good := Config{CA: testCA(), TLS: tc, GatewayID: "gw"}
	if err := good.Validate(); err != nil {
		t.Fatal(err)
	}
	d := good.withDefaults()
	if d.MaxSessions != 20000 || d.HandshakeRate != 1000 || d.HandshakeBurst != 1000 || d.MaxHellosInFlight != 256 ||
		d.HelloTimeout != 10*time.Second || d.HeartbeatInterval != 10*time.Second || d.HeartbeatTimeout != 30*time.Second ||
		d.FlushInterval != 5*time.Second || d.ResyncEvery != 24*time.Hour || d.BindWindow != 2*time.Minute ||
		d.MaxMessageBytes != 64<<10 || d.NodeCertValidity != 30*24*time.Hour {
		t.Fatalf("defaults %+v", d)
	}
	for name, c := range map[string]Config{
		"no CA":                  {TLS: tc},
		"no TLS":                 {CA: testCA()},
		"negative":               {CA: testCA(), TLS: tc, MaxSessions: -1},
		"timeout below interval": {CA: testCA(), TLS: tc, HeartbeatInterval: time.Second, HeartbeatTimeout: time.Second},
		"flush too slow":         {CA: testCA(), TLS: tc, FlushInterval: time.Minute},
		"bad gateway id":         {CA: testCA(), TLS: tc, GatewayID: "a\nb"},
		"resync beyond 5 days":   {CA: testCA(), TLS: tc, ResyncEvery: 6 * 24 * time.Hour},
		"tiny messages":          {CA: testCA(), TLS: tc, MaxMessageBytes: 100},
	} {
		if err := c.Validate(); err == nil {
			t.Errorf("%s: accepted", name)
		}
	}
}

func TestJoinTokens(t *testing.T) {
	k, err := ParseJoinTokens("# comment\npool-a=aaaaaaaaaaaaaaaa\npool-b = bbbbbbbbbbbbbbbb, pool-a=cccccccccccccccc")
	if err != nil {
		t.Fatal(err)
	}
	if k.Len() != 3 {
		t.Fatalf("%d tokens", k.Len())
	}
	for token, want := range map[string]string{"aaaaaaaaaaaaaaaa": "pool-a", "bbbbbbbbbbbbbbbb": "pool-b", "cccccccccccccccc": "pool-a"} {
		if p, ok := k.Pool(token); !ok || p != want {
			t.Errorf("%s: %q %v", token, p, ok)
		}
	}
	if _, ok := k.Pool("dddddddddddddddd"); ok {
		t.Error("unknown token accepted")
	}
	// The same token for two pools would admit to whichever came last.
	for _, bad := range []string{"nopool", "p=short", "=aaaaaaaaaaaaaaaa", "p=aaaaaaaaaaaaaaaa,q=aaaaaaaaaaaaaaaa"} {
		if _, err := ParseJoinTokens(bad); err == nil {
			t.Errorf("%q parsed", bad)
		} else if !strings.HasPrefix(err.Error(), "fleet: ") {
			t.Errorf("%q: %v, want the package's name in front", bad, err)
		}
	}
	var none JoinTokens
	if _, ok := none.Pool("x"); ok || none.Len() != 0 {
		t.Error("zero tokens")
	}
}
