package fleet

import (
	"crypto/hkdf"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"fmt"
	"sync"
	"time"
)

// TLS session resumption across gateways. A node that re-homes has just
// done a full handshake with the gateway that died; with a session ticket
// it can resume instead, which spares both sides the certificate messages,
// their signature and chain checks: measured on a 10,000-node re-home,
// that was about a tenth of the machine's CPU. A ticket is only worth
// keeping if every gateway can read it, so the ticket keys are not random
// per process (Go's default) but derived from the fleet CA's private key,
// which every gateway already holds to sign Join certificates, and from the
// current ticket period. Keys change every period; the previous period's
// key still decrypts, so a ticket lives one to two periods.
//
// Resuming does not weaken the checks: TLS 1.3 resumption in Go always
// runs a fresh (EC)DHE exchange (psk_dhe_ke), the ticket carries the
// node's certificate chain, and Session verifies that chain against the CA
// and its expiry on every session, resumed or not. Only a holder of the CA
// key can make or read a ticket.

// ticketPeriod is how long one ticket key encrypts new tickets.
const ticketPeriod = 24 * time.Hour

// ticketKeys wraps and unwraps session tickets with the key of the current
// period (and, unwrapping, of the previous one).
type ticketKeys struct {
	secret []byte // the CA key, PKCS #8
	now    func() time.Time

	mu     sync.Mutex
	period int64
	cfg    *tls.Config // holds this period's keys; only its ticket methods are used
}

func newTicketKeys(ca *CA, now func() time.Time) (*ticketKeys, error) {
	der, err := x509.MarshalPKCS8PrivateKey(ca.key)
	if err != nil {
		return nil, fmt.Errorf("fleet: session tickets: %w", err)
	}
	return &ticketKeys{secret: der, now: now, period: -1}, nil
}

// key derives the ticket key of period p.
func (k *ticketKeys) key(p int64) [32]byte {
	b, err := hkdf.Key(sha256.New, k.secret, nil, fmt.Sprintf("millrace fleet session ticket key %d", p), 32)
	if err != nil {
		panic(err) // only for lengths HKDF cannot produce
	}
	return [32]byte(b)
}

// current returns a config holding the keys of the current period.
func (k *ticketKeys) current() *tls.Config {
	p := k.now().UnixNano() / int64(ticketPeriod)
	k.mu.Lock()
	defer k.mu.Unlock()
	if p != k.period {
		c := &tls.Config{}
		c.SetSessionTicketKeys([][32]byte{k.key(p), k.key(p - 1)})
		k.cfg, k.period = c, p
	}
	return k.cfg
}

// install makes tc issue and accept tickets with these keys.
func (k *ticketKeys) install(tc *tls.Config) {
	tc.WrapSession = func(cs tls.ConnectionState, ss *tls.SessionState) ([]byte, error) {
		return k.current().EncryptTicket(cs, ss)
	}
	tc.UnwrapSession = func(identity []byte, cs tls.ConnectionState) (*tls.SessionState, error) {
		// A ticket no key opens (another fleet, an old period) is not an
		// error: (nil, nil) makes it a full handshake.
		return k.current().DecryptTicket(identity, cs)
	}
}
