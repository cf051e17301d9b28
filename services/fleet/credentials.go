package fleet

import (
	"crypto/tls"
	"fmt"

	"github.com/millrace/millrace/internal/tlsfiles"
)

// Credentials say where a gateway's CA and server certificate come from.
type Credentials struct {
	// CACert and CAKey are PEM files of the CA and its key (both or
	// neither); without them the CA is the one in CADir, created there on
	// first use (LoadOrCreateCA, for development).
	CACert, CAKey, CADir string
	// Cert and Key are the gateway's PEM server certificate and key (both
	// or neither); without them the CA issues one for localhost, the
	// loopback addresses and Hosts.
	Cert, Key string
	Hosts     []string
}

// Load loads the CA and makes the gateway's TLS configuration.
func (c Credentials) Load() (*CA, *tls.Config, error) {
	var (
		ca  *CA
		err error
	)
	switch {
	case c.CACert != "" || c.CAKey != "":
		if c.CACert == "" || c.CAKey == "" {
			return nil, nil, fmt.Errorf("fleet CA: %w", tlsfiles.ErrHalfPair)
		}
		ca, err = LoadCA(c.CACert, c.CAKey)
	default:
		ca, err = LoadOrCreateCA(c.CADir)
	}
	if err != nil {
		return nil, nil, fmt.Errorf("fleet CA: %w", err)
	}
	if c.Cert != "" || c.Key != "" {
		cert, err := tlsfiles.KeyPair(c.Cert, c.Key)
		if err != nil {
			return nil, nil, fmt.Errorf("fleet TLS certificate: %w", err)
		}
		return ca, ServerTLSConfig(cert), nil
	}
	tc, err := ca.ServerTLS(append([]string{"localhost", "127.0.0.1", "::1"}, c.Hosts...))
	if err != nil {
		return nil, nil, fmt.Errorf("fleet server certificate: %w", err)
	}
	return ca, tc, nil
}
