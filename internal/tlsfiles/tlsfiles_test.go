package tlsfiles

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func write(t *testing.T, dir, name string, blocks ...*pem.Block) string {
	t.Helper()
	var b []byte
	for _, bl := range blocks {
		b = append(b, pem.EncodeToMemory(bl)...)
	}
	p := filepath.Join(dir, name)
	if err := os.WriteFile(p, b, 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

// pki writes a CA and a server certificate for 127.0.0.1 signed by it; it
// returns the CA's file, the server's certificate file and its key, and
// the server's key.
func pki(t *testing.T, dir string) (caFile, certFile, keyFile string, key *ecdsa.PrivateKey) {
	t.Helper()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	now := time.Now()
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), IsCA: true, BasicConstraintsValid: true,
		KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	key, _ = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	tmpl := &x509.Certificate{SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "server"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(time.Hour), IPAddresses: []net.IP{net.ParseIP("127.0.0.1")},
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, _ := x509.MarshalPKCS8PrivateKey(key)
	return write(t, dir, "ca.pem", &pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		write(t, dir, "server.pem", &pem.Block{Type: "CERTIFICATE", Bytes: der}),
		write(t, dir, "server.key", &pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}), key
}

// A server loaded from files is reached by a client trusting the CA file,
// with its client certificate; a client trusting only the system's roots
// is refused.
func TestServerAndClient(t *testing.T) {
	dir := t.TempDir()
	ca, cert, key, _ := pki(t, dir)
	sc, err := Server(cert, key)
	if err != nil {
		t.Fatal(err)
	}
	sc.ClientAuth = tls.RequireAnyClientCert
	lis, err := tls.Listen("tcp", "127.0.0.1:0", sc)
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			c.(*tls.Conn).Handshake()
			c.Close()
		}
	}()
	dial := func(c Client) error {
		tc, err := c.Config()
		if err != nil {
			return err
		}
		conn, err := tls.Dial("tcp", lis.Addr().String(), tc)
		if err == nil {
			conn.Close()
		}
		return err
	}
	if err := dial(Client{CA: ca, Cert: cert, Key: key}); err != nil {
		t.Fatalf("client trusting the CA: %v", err)
	}
	var unknown x509.UnknownAuthorityError
	if err := dial(Client{Cert: cert, Key: key}); !errors.As(err, &unknown) {
		t.Fatalf("client trusting the system's roots: %v, want an unknown authority", err)
	}
	if _, err := (Client{CA: ca, Cert: cert}).Config(); !errors.Is(err, ErrHalfPair) {
		t.Fatalf("a client certificate without its key: %v", err)
	}
}

func TestServerPlaintextAndHalfPair(t *testing.T) {
	if c, err := Server("", ""); c != nil || err != nil {
		t.Fatalf("no files: %v, %v; want plaintext", c, err)
	}
	for _, pair := range [][2]string{{"cert.pem", ""}, {"", "key.pem"}} {
		if _, err := Server(pair[0], pair[1]); !errors.Is(err, ErrHalfPair) {
			t.Fatalf("%q: %v, want ErrHalfPair", pair, err)
		}
	}
	if _, err := Server("missing.pem", "missing.key"); err == nil {
		t.Fatal("missing files accepted")
	}
}

// Every key format the fleet CA or an operator may give parses to the same
// key, also after blocks of other types.
func TestKeyFormats(t *testing.T) {
	dir := t.TempDir()
	_, certFile, _, ec := pki(t, dir)
	sec1, _ := x509.MarshalECPrivateKey(ec)
	pkcs8, _ := x509.MarshalPKCS8PrivateKey(ec)
	rsaKey, err := rsa.GenerateKey(rand.Reader, 2048)
	if err != nil {
		t.Fatal(err)
	}
	for name, c := range map[string]struct {
		blocks []*pem.Block
		want   crypto.PublicKey
	}{
		"pkcs8":         {[]*pem.Block{{Type: "PRIVATE KEY", Bytes: pkcs8}}, &ec.PublicKey},
		"sec1":          {[]*pem.Block{{Type: "EC PRIVATE KEY", Bytes: sec1}}, &ec.PublicKey},
		"ec parameters": {[]*pem.Block{{Type: "EC PARAMETERS", Bytes: []byte{6, 8, 42, 134, 72, 206, 61, 3, 1, 7}}, {Type: "EC PRIVATE KEY", Bytes: sec1}}, &ec.PublicKey},
		"pkcs1":         {[]*pem.Block{{Type: "RSA PRIVATE KEY", Bytes: x509.MarshalPKCS1PrivateKey(rsaKey)}}, &rsaKey.PublicKey},
	} {
		k, err := Key(write(t, dir, name, c.blocks...))
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		if !k.Public().(interface{ Equal(crypto.PublicKey) bool }).Equal(c.want) {
			t.Fatalf("%s: another key", name)
		}
	}
	if _, err := Key(certFile); err == nil {
		t.Fatal("a certificate was read as a key")
	}
	cert, err := Certificate(certFile)
	if err != nil || cert.Subject.CommonName != "server" {
		t.Fatalf("certificate: %v, %v", cert, err)
	}
}

func TestPoolWithoutCertificate(t *testing.T) {
	dir := t.TempDir()
	_, _, keyFile, _ := pki(t, dir)
	if _, err := Pool(keyFile); !errors.Is(err, ErrNoCertificate) {
		t.Fatalf("a key file as a CA bundle: %v, want ErrNoCertificate", err)
	}
	if _, err := Certificate(keyFile); !errors.Is(err, ErrNoCertificate) {
		t.Fatalf("a key file as a certificate: %v, want ErrNoCertificate", err)
	}
	if _, err := PoolPEM(nil); !errors.Is(err, ErrNoCertificate) {
		t.Fatalf("no bytes: %v", err)
	}
}
