package agent

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"

	"github.com/millrace/millrace/internal/tlsfiles"
	fleetpb "github.com/millrace/millrace/schemas/fleet"
)

// Identity is what a node gets from Join: its certificate and key, and the
// CA that signs gateway and node certificates. A daemon keeps CertPEM and
// KeyPEM (the key never left the node) and dials with Certificate and CAs.
type Identity struct {
	Certificate tls.Certificate
	CAs         *x509.CertPool
	Pool        string
	NotAfter    time.Time
	CertPEM     []byte
	KeyPEM      []byte
	CAPEM       []byte
}

// TLSConfig returns a client TLS configuration trusting the fleet CA,
// without the node certificate (Config.Certificate carries that, so that
// many agents can share one Settings.TLS).
func (id *Identity) TLSConfig() *tls.Config {
	return &tls.Config{RootCAs: id.CAs, MinVersion: tls.VersionTLS12}
}

// Join exchanges a join token for a node certificate: it makes an ECDSA
// P-256 key and a CSR for nodeID, calls Gateway.Join on addr over TLS
// (trusting caPEM; nil trusts the system's roots), and returns the
// certificate with its key and the CA bundle the gateway sent. opts are
// added to the gRPC dial options (a dialer, grpc.WithAuthority for a
// gateway whose certificate names another host). The error is the gateway's
// gRPC status, wrapped: RetryAfter reads its RetryInfo.
func Join(ctx context.Context, addr, token, nodeID string, caPEM []byte, opts ...grpc.DialOption) (*Identity, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	csr, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{Subject: pkix.Name{CommonName: nodeID}}, key)
	if err != nil {
		return nil, err
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS12}
	if len(caPEM) > 0 {
		if tc.RootCAs, err = tlsfiles.PoolPEM(caPEM); err != nil {
			return nil, errors.New("join: no certificate in the CA PEM")
		}
	}
	conn, err := grpc.NewClient("passthrough:///"+addr, append([]grpc.DialOption{
		grpc.WithTransportCredentials(credentials.NewTLS(tc)),
		grpc.WithDisableRetry(),
		grpc.WithDisableServiceConfig(),
	}, opts...)...)
	if err != nil {
		return nil, fmt.Errorf("join via %s: %w", addr, err)
	}
	defer conn.Close()
	resp, err := fleetpb.NewGatewayClient(conn).Join(ctx, &fleetpb.JoinRequest{
		Token:  token,
		NodeId: nodeID,
		Csr:    pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: csr}),
	})
	if err != nil {
		return nil, fmt.Errorf("join %s via %s: %w", nodeID, addr, err)
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	keyPEM := pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der})
	cert, err := tls.X509KeyPair(resp.GetCertificate(), keyPEM)
	if err != nil {
		return nil, fmt.Errorf("join %s: the gateway's certificate: %w", nodeID, err)
	}
	cas, err := tlsfiles.PoolPEM(resp.GetCa())
	if err != nil {
		return nil, fmt.Errorf("join %s: the gateway sent no CA certificate", nodeID)
	}
	id := &Identity{
		Certificate: cert,
		CAs:         cas,
		Pool:        resp.GetPool(),
		NotAfter:    resp.GetNotAfter().AsTime(),
		CertPEM:     resp.GetCertificate(),
		KeyPEM:      keyPEM,
		CAPEM:       resp.GetCa(),
	}
	if resp.GetNotAfter() == nil && cert.Leaf != nil {
		id.NotAfter = cert.Leaf.NotAfter
	}
	return id, nil
}
