package fleet

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/ed25519"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"io/fs"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"github.com/millrace/millrace/internal/tlsfiles"
)

// DefaultNodeCertValidity is how long a node certificate is valid unless
// Config.NodeCertValidity says otherwise.
const DefaultNodeCertValidity = 30 * 24 * time.Hour

// Certificates are backdated a little so that a node whose clock is behind
// the gateway's can use a certificate it has just received.
const clockSkew = 5 * time.Minute

// CA is the fleet's certificate authority: it signs node certificates
// (CommonName = node id, OrganizationalUnit = pool) and, in development,
// the gateway's own server certificate. Node certificates must chain to it.
type CA struct {
	cert    *x509.Certificate
	key     crypto.Signer
	certPEM []byte
	pool    *x509.CertPool
}

// NewCA makes a fresh CA (ECDSA P-256, valid ten years) held in memory only,
// for tests and simulators.
func NewCA(commonName string) (*CA, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: commonName, Organization: []string{"millrace"}},
		NotBefore:             now.Add(-clockSkew),
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("fleet CA: %w", err)
	}
	return newCA(der, key)
}

func newCA(der []byte, key crypto.Signer) (*CA, error) {
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, fmt.Errorf("fleet CA certificate: %w", err)
	}
	if !cert.IsCA {
		return nil, errors.New("fleet CA: the certificate is not a CA certificate")
	}
	if !publicKeysEqual(cert.PublicKey, key.Public()) {
		return nil, errors.New("fleet CA: the key does not belong to the certificate")
	}
	pool := x509.NewCertPool()
	pool.AddCert(cert)
	return &CA{
		cert:    cert,
		key:     key,
		certPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pool:    pool,
	}, nil
}

func publicKeysEqual(a, b crypto.PublicKey) bool {
	ea, ok := a.(interface{ Equal(crypto.PublicKey) bool })
	return ok && ea.Equal(b)
}

// LoadCA reads a PEM CA certificate and its PEM private key (PKCS#8, SEC 1
// EC or PKCS#1 RSA).
func LoadCA(certPEMFile, keyPEMFile string) (*CA, error) {
	cert, err := tlsfiles.Certificate(certPEMFile)
	if err != nil {
		return nil, fmt.Errorf("fleet CA certificate: %w", err)
	}
	key, err := tlsfiles.Key(keyPEMFile)
	if err != nil {
		return nil, fmt.Errorf("fleet CA key: %w", err)
	}
	return newCA(cert.Raw, key)
}

// CA file names under LoadOrCreateCA's directory.
const (
	CACertFile = "ca.crt"
	CAKeyFile  = "ca.key"
)

// LoadOrCreateCA loads dir/ca.crt and dir/ca.key, creating them (the key
// with mode 0600) the first time. It is for development: in production the
// CA key belongs in a secret store and LoadCA reads what it was given.
func LoadOrCreateCA(dir string) (*CA, error) {
	certFile, keyFile := filepath.Join(dir, CACertFile), filepath.Join(dir, CAKeyFile)
	if _, err := os.Stat(keyFile); err == nil {
		return loadWhenComplete(certFile, keyFile)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("fleet CA directory: %w", err)
	}
	// O_EXCL on the key decides which process creates the CA; a loser waits
	// for the winner's certificate.
	f, err := os.OpenFile(keyFile, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if errors.Is(err, fs.ErrExist) {
		return loadWhenComplete(certFile, keyFile)
	}
	if err != nil {
		return nil, fmt.Errorf("fleet CA key: %w", err)
	}
	ca, err := NewCA("millrace fleet CA")
	if err != nil {
		f.Close()
		os.Remove(keyFile)
		return nil, err
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(ca.key)
	if err == nil {
		_, err = f.Write(pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}))
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = writeFileAtomic(certFile, ca.certPEM, 0o644)
	}
	if err != nil {
		os.Remove(keyFile)
		return nil, fmt.Errorf("fleet CA: %w", err)
	}
	return ca, nil
}

// loadWhenComplete loads a CA another process may be writing right now:
// the certificate is written last, so its presence means both are complete.
func loadWhenComplete(certFile, keyFile string) (*CA, error) {
	deadline := time.Now().Add(5 * time.Second)
	for {
		if _, err := os.Stat(certFile); err == nil || time.Now().After(deadline) {
			return LoadCA(certFile, keyFile)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func writeFileAtomic(name string, data []byte, mode os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(name), filepath.Base(name)+".tmp*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Chmod(mode); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), name)
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		panic(err) // crypto/rand does not fail on supported platforms
	}
	return n
}

// Certificate is the CA's certificate.
func (ca *CA) Certificate() *x509.Certificate { return ca.cert }

// CertPEM is the CA's certificate in PEM, the bundle nodes trust.
func (ca *CA) CertPEM() []byte { return ca.certPEM }

// Pool is a pool holding the CA's certificate.
func (ca *CA) Pool() *x509.CertPool { return ca.pool }

// IssueNode signs a node certificate for pub, valid for
// DefaultNodeCertValidity, and returns it in PEM.
func (ca *CA) IssueNode(nodeID, pool string, pub crypto.PublicKey) ([]byte, error) {
	certPEM, _, err := ca.issueNode(nodeID, pool, pub, DefaultNodeCertValidity)
	return certPEM, err
}

func (ca *CA) issueNode(nodeID, pool string, pub crypto.PublicKey, validity time.Duration) ([]byte, *x509.Certificate, error) {
	if err := CheckID("node id", nodeID); err != nil {
		return nil, nil, err
	}
	if err := CheckID("pool", pool); err != nil {
		return nil, nil, err
	}
	if err := checkPublicKey(pub); err != nil {
		return nil, nil, err
	}
	now := time.Now()
	usage := x509.KeyUsageDigitalSignature
	if _, ok := pub.(*rsa.PublicKey); ok {
		usage |= x509.KeyUsageKeyEncipherment
	}
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: nodeID, OrganizationalUnit: []string{pool}},
		NotBefore:    now.Add(-clockSkew),
		NotAfter:     now.Add(validity),
		KeyUsage:     usage,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, pub, ca.key)
	if err != nil {
		return nil, nil, fmt.Errorf("sign node certificate: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), cert, nil
}

// checkPublicKey accepts the keys a node may hold: ECDSA P-256 or P-384
// (what NewNodeCSR makes), Ed25519, RSA of 2048 bits or more.
func checkPublicKey(pub crypto.PublicKey) error {
	switch k := pub.(type) {
	case *ecdsa.PublicKey:
		if k.Curve != elliptic.P256() && k.Curve != elliptic.P384() {
			return fmt.Errorf("ECDSA curve %s is not accepted: use P-256", k.Curve.Params().Name)
		}
	case ed25519.PublicKey:
	case *rsa.PublicKey:
		if k.N.BitLen() < 2048 {
			return fmt.Errorf("an RSA key of %d bits is too short: use ECDSA P-256", k.N.BitLen())
		}
	default:
		return fmt.Errorf("a %T key is not accepted: use ECDSA P-256", pub)
	}
	return nil
}

// NodeCredentials makes a node key (ECDSA P-256) and its certificate in one
// step, for simulators and tests; a real node keeps its key and uses Join.
func (ca *CA) NodeCredentials(nodeID, pool string) (certPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	certPEM, err = ca.IssueNode(nodeID, pool, &key.PublicKey)
	if err != nil {
		return nil, nil, err
	}
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return certPEM, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// ServerTLS issues a server certificate for hosts (DNS names or IP
// addresses; default "localhost" and 127.0.0.1), valid one year, and
// returns the gateway's TLS configuration: TLS 1.3, client certificates
// requested but verified by the gateway per call (Join needs none).
// For development; production gateways get a certificate from their PKI
// and use ServerTLSConfig.
func (ca *CA) ServerTLS(hosts []string) (*tls.Config, error) {
	if len(hosts) == 0 {
		hosts = []string{"localhost", "127.0.0.1", "::1"}
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: "millrace fleet gateway"},
		NotBefore:    now.Add(-clockSkew),
		NotAfter:     now.Add(365 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		return nil, fmt.Errorf("sign gateway certificate: %w", err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return ServerTLSConfig(tls.Certificate{Certificate: [][]byte{der, ca.cert.Raw}, PrivateKey: key, Leaf: leaf}), nil
}

// ServerTLSConfig is the gateway's TLS configuration for a server
// certificate: TLS 1.3 only, client certificates requested (not required:
// Join is called without one) and verified by Session against the CA.
func ServerTLSConfig(cert tls.Certificate) *tls.Config {
	return &tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequestClientCert,
		MinVersion:   tls.VersionTLS13,
		NextProtos:   []string{"h2"},
	}
}

// NodeTLS is a node's client TLS configuration: it trusts caPEM (the bundle
// Join returns) and, when certPEM and keyPEM are given, presents that node
// certificate. Join needs no certificate: pass nil for both.
func NodeTLS(caPEM, certPEM, keyPEM []byte) (*tls.Config, error) {
	roots, err := tlsfiles.PoolPEM(caPEM)
	if err != nil {
		return nil, errors.New("fleet: no CA certificate in the PEM bundle")
	}
	c := &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS13}
	if certPEM != nil || keyPEM != nil {
		cert, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			return nil, fmt.Errorf("fleet: node certificate: %w", err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}

// NewNodeCSR makes a node key (ECDSA P-256) and a PEM certificate request
// for Join; the node keeps keyPEM (PKCS#8) and pairs it with the
// certificate Join returns.
func NewNodeCSR(nodeID string) (csrPEM, keyPEM []byte, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, err
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: nodeID}}, key)
	if err != nil {
		return nil, nil, err
	}
	kder, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), nil
}

// parseCSR reads a PEM certificate request and checks its signature.
func parseCSR(csrPEM []byte) (*x509.CertificateRequest, error) {
	block, _ := pem.Decode(csrPEM)
	if block == nil || block.Type != "CERTIFICATE REQUEST" {
		return nil, errors.New("csr is not a PEM CERTIFICATE REQUEST")
	}
	csr, err := x509.ParseCertificateRequest(block.Bytes)
	if err != nil {
		return nil, fmt.Errorf("csr: %w", err)
	}
	if err := csr.CheckSignature(); err != nil {
		return nil, fmt.Errorf("csr signature: %w", err)
	}
	return csr, nil
}

// verifyNode checks a client certificate chain against the CA and returns
// the node id and pool it names.
func (ca *CA) verifyNode(chain []*x509.Certificate, now time.Time) (nodeID, pool string, err error) {
	if len(chain) == 0 {
		return "", "", errors.New("no client certificate: a node needs one signed by the fleet CA (see Join)")
	}
	leaf := chain[0]
	inter := x509.NewCertPool()
	for _, c := range chain[1:] {
		inter.AddCert(c)
	}
	if _, err := leaf.Verify(x509.VerifyOptions{
		Roots:         ca.pool,
		Intermediates: inter,
		CurrentTime:   now,
		KeyUsages:     []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}); err != nil {
		return "", "", fmt.Errorf("client certificate not accepted: %v", err)
	}
	if len(leaf.Subject.OrganizationalUnit) != 1 {
		return "", "", fmt.Errorf("client certificate names %d organizational units; a node certificate names exactly one, its pool", len(leaf.Subject.OrganizationalUnit))
	}
	return leaf.Subject.CommonName, leaf.Subject.OrganizationalUnit[0], nil
}
