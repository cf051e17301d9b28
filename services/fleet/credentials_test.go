package fleet

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"github.com/millrace/millrace/internal/tlsfiles"
)

// Without files the CA is made in its directory and issues the server
// certificate for the hosts; with files, those are used; half a pair is
// refused.
func TestCredentials(t *testing.T) {
	dir := t.TempDir()
	ca, tc, err := Credentials{CADir: filepath.Join(dir, "ca"), Hosts: []string{"gw.example", "10.0.0.7"}}.Load()
	if err != nil {
		t.Fatal(err)
	}
	leaf := tc.Certificates[0].Leaf
	if !slices.Contains(leaf.DNSNames, "gw.example") || !slices.Contains(leaf.DNSNames, "localhost") || len(leaf.IPAddresses) < 2 {
		t.Fatalf("issued for %v %v", leaf.DNSNames, leaf.IPAddresses)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{Roots: ca.pool, DNSName: "gw.example"}); err != nil {
		t.Fatalf("the issued certificate does not chain to the CA: %v", err)
	}

	caCert, caKey := filepath.Join(dir, "ca", CACertFile), filepath.Join(dir, "ca", CAKeyFile)
	srvCert, srvKey := filepath.Join(dir, "srv.pem"), filepath.Join(dir, "srv.key")
	write := func(p string, blocks ...*pem.Block) {
		var b []byte
		for _, bl := range blocks {
			b = append(b, pem.EncodeToMemory(bl)...)
		}
		if err := os.WriteFile(p, b, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	keyDER, _ := x509.MarshalPKCS8PrivateKey(tc.Certificates[0].PrivateKey)
	write(srvCert, &pem.Block{Type: "CERTIFICATE", Bytes: tc.Certificates[0].Certificate[0]})
	write(srvKey, &pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
	loaded, given, err := Credentials{CACert: caCert, CAKey: caKey, Cert: srvCert, Key: srvKey}.Load()
	if err != nil {
		t.Fatal(err)
	}
	if !loaded.Certificate().Equal(ca.Certificate()) || !slices.Equal(given.Certificates[0].Certificate[0], tc.Certificates[0].Certificate[0]) {
		t.Fatal("the given CA or certificate was not the one loaded")
	}
	if _, _, err := (Credentials{CACert: caCert}).Load(); !errors.Is(err, tlsfiles.ErrHalfPair) {
		t.Fatalf("a CA certificate without its key: %v", err)
	}
	if _, _, err := (Credentials{CADir: filepath.Join(dir, "ca"), Cert: srvCert}).Load(); !errors.Is(err, tlsfiles.ErrHalfPair) {
		t.Fatalf("a server certificate without its key: %v", err)
	}
}
