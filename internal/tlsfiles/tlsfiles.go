// Package tlsfiles loads PEM certificates, private keys and CA bundles: the
// one loader of the repository. The gRPC edges' and the fleet gateway's
// server certificates, the fleet CA and its key, the CA bundles clients
// trust (Kafka brokers, the reservations API, fleet gateways, nodes'
// Join) and client certificates for mutual TLS all go through it, so that
// every one of them reads the same key formats (PKCS#8, SEC 1 EC, PKCS#1
// RSA), refuses a bundle without a certificate, and names the file that
// is wrong.
package tlsfiles

import (
	"crypto"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"

	"github.com/millrace/millrace/internal/envflag"
)

// ErrHalfPair is returned when a certificate is named without its key, or
// a key without its certificate.
var ErrHalfPair = errors.New("a certificate and its key go together")

// ErrNoCertificate is returned for a PEM bundle holding no certificate.
var ErrNoCertificate = errors.New("no PEM certificate")

// MinVersion is the oldest TLS version a server or client of Server and
// Client speaks (the fleet gateway, which is newer, asks for TLS 1.3).
const MinVersion = tls.VersionTLS12

// KeyPair loads a PEM certificate (its chain after it) and its PEM private
// key.
func KeyPair(certFile, keyFile string) (tls.Certificate, error) {
	if certFile == "" || keyFile == "" {
		return tls.Certificate{}, ErrHalfPair
	}
	c, err := tls.LoadX509KeyPair(certFile, keyFile)
	if err != nil {
		return tls.Certificate{}, fmt.Errorf("certificate %s with key %s: %w", certFile, keyFile, err)
	}
	return c, nil
}

// Server is the TLS configuration of a server presenting certFile with
// keyFile. Both empty is plaintext: nil and no error.
func Server(certFile, keyFile string) (*tls.Config, error) {
	if certFile == "" && keyFile == "" {
		return nil, nil
	}
	c, err := KeyPair(certFile, keyFile)
	if err != nil {
		return nil, err
	}
	return &tls.Config{Certificates: []tls.Certificate{c}, MinVersion: MinVersion}, nil
}

// ServerFlags is Server for the files a pair of flags names, certFlag and
// keyFlag, which errors name: one without the other is a usage error
// (envflag.UsageError).
func ServerFlags(certFile, keyFile, certFlag, keyFlag string) (*tls.Config, error) {
	tc, err := Server(certFile, keyFile)
	switch {
	case errors.Is(err, ErrHalfPair):
		return nil, envflag.Usage(certFlag + " and " + keyFlag + " go together")
	case err != nil:
		return nil, fmt.Errorf("%s: %w", certFlag, err)
	}
	return tc, nil
}

// Client names a client's TLS material.
type Client struct {
	// CA is a PEM bundle the server's certificate must chain to; empty
	// trusts the system's roots.
	CA string
	// Cert and Key are a client certificate for mutual TLS; both or
	// neither.
	Cert, Key string
	// ServerName is the name to verify the server's certificate against;
	// empty: the host dialled.
	ServerName string
}

// Config is the client's TLS configuration.
func (c Client) Config() (*tls.Config, error) {
	tc := &tls.Config{MinVersion: MinVersion, ServerName: c.ServerName}
	if c.CA != "" {
		pool, err := Pool(c.CA)
		if err != nil {
			return nil, err
		}
		tc.RootCAs = pool
	}
	if c.Cert != "" || c.Key != "" {
		cert, err := KeyPair(c.Cert, c.Key)
		if err != nil {
			return nil, err
		}
		tc.Certificates = []tls.Certificate{cert}
	}
	return tc, nil
}

// Pool reads a PEM bundle of CA certificates.
func Pool(file string) (*x509.CertPool, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	pool, err := PoolPEM(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return pool, nil
}

// PoolPEM is Pool of bytes already read (a bundle a server sent).
func PoolPEM(b []byte) (*x509.CertPool, error) {
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(b) {
		return nil, ErrNoCertificate
	}
	return pool, nil
}

// Certificate reads the first certificate of a PEM file.
func Certificate(file string) (*x509.Certificate, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	c, err := ParseCertificate(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return c, nil
}

// ParseCertificate is the first certificate of PEM bytes (blocks of other
// types before it are skipped).
func ParseCertificate(b []byte) (*x509.Certificate, error) {
	for {
		var block *pem.Block
		block, b = pem.Decode(b)
		if block == nil {
			return nil, ErrNoCertificate
		}
		if block.Type == "CERTIFICATE" {
			return x509.ParseCertificate(block.Bytes)
		}
	}
}

// Key reads a PEM private key file.
func Key(file string) (crypto.Signer, error) {
	b, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	k, err := ParseKey(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return k, nil
}

// ParseKey reads the first private key of PEM bytes: PKCS#8, SEC 1 (EC)
// or PKCS#1 (RSA). Blocks of other types (EC PARAMETERS before an EC key)
// are skipped.
func ParseKey(b []byte) (crypto.Signer, error) {
	for {
		var block *pem.Block
		block, b = pem.Decode(b)
		if block == nil {
			return nil, errors.New("no PEM private key block")
		}
		var (
			key any
			err error
		)
		switch block.Type {
		case "PRIVATE KEY":
			key, err = x509.ParsePKCS8PrivateKey(block.Bytes)
		case "EC PRIVATE KEY":
			key, err = x509.ParseECPrivateKey(block.Bytes)
		case "RSA PRIVATE KEY":
			key, err = x509.ParsePKCS1PrivateKey(block.Bytes)
		default:
			continue
		}
		if err != nil {
			return nil, err
		}
		signer, ok := key.(crypto.Signer)
		if !ok {
			return nil, fmt.Errorf("a %T cannot sign", key)
		}
		return signer, nil
	}
}
