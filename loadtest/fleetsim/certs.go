package fleetsim

import (
	"bufio"
	"context"
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/millrace/millrace/agent"
	"github.com/millrace/millrace/internal/tlsfiles"
)

// issuer signs node certificates directly with the fleet CA's key, as the
// gateway's Join would (CommonName = node id, OrganizationalUnit = pool,
// client auth).
type issuer struct {
	cert *x509.Certificate
	key  crypto.Signer
}

func loadIssuer(certFile, keyFile string) (*issuer, error) {
	cert, err := tlsfiles.Certificate(certFile)
	if err != nil {
		return nil, err
	}
	key, err := tlsfiles.Key(keyFile)
	if err != nil {
		return nil, err
	}
	return &issuer{cert: cert, key: key}, nil
}

func (is *issuer) issue(nodeID, pool string) (*tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 127))
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial,
		Subject:      pkix.Name{CommonName: nodeID, OrganizationalUnit: []string{pool}},
		NotBefore:    now.Add(-5 * time.Minute),
		NotAfter:     now.Add(48 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, is.cert, &key.PublicKey, is.key)
	if err != nil {
		return nil, err
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}, nil
}

// issueAll issues every node's certificate, on all cores.
func (is *issuer) issueAll(ctx context.Context, ids []string, pool string) ([]*tls.Certificate, error) {
	certs := make([]*tls.Certificate, len(ids))
	var next atomic.Int64
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	for range runtime.GOMAXPROCS(0) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= len(ids) || ctx.Err() != nil {
					return
				}
				c, err := is.issue(ids[i], pool)
				if err != nil {
					once.Do(func() { firstErr = fmt.Errorf("issue a certificate for %s: %w", ids[i], err) })
					return
				}
				certs[i] = c
			}
		}()
	}
	wg.Wait()
	if firstErr == nil {
		firstErr = ctx.Err()
	}
	return certs, firstErr
}

// readTokens reads one join token per line (blank lines and # comments
// skipped).
func readTokens(file string) ([]string, error) {
	f, err := os.Open(file)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if t := strings.TrimSpace(sc.Text()); t != "" && !strings.HasPrefix(t, "#") {
			out = append(out, t)
		}
	}
	return out, sc.Err()
}

// joinAll gets every node's certificate from the gateways with Join,
// concurrency at a time, spreading the calls over the gateways and
// retrying refusals after their RetryInfo (or a short backoff), for up to
// five minutes per node.
func joinAll(ctx context.Context, cfg Config, ids []string, tokens []string, caPEM []byte, dialers []grpc.DialOption, progress func(done int)) ([]*tls.Certificate, error) {
	certs := make([]*tls.Certificate, len(ids))
	var next, done atomic.Int64
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	opts := []grpc.DialOption{}
	if cfg.ServerName != "" {
		opts = append(opts, grpc.WithAuthority(cfg.ServerName))
	}
	for w := range max(1, cfg.JoinConcurrency) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1) - 1)
				if i >= len(ids) || ctx.Err() != nil {
					return
				}
				tok := cfg.JoinToken
				if len(tokens) > 0 {
					tok = tokens[i]
				}
				o := opts
				if len(dialers) > 0 {
					o = append(append([]grpc.DialOption{}, opts...), dialers[i%len(dialers)])
				}
				deadline := time.Now().Add(5 * time.Minute)
				for attempt := 0; ; attempt++ {
					addr := cfg.Gateways[(i+attempt+w)%len(cfg.Gateways)]
					id, err := agent.Join(ctx, addr, tok, ids[i], caPEM, o...)
					if err == nil {
						certs[i] = &id.Certificate
						break
					}
					wait := agent.RetryAfter(err)
					switch status.Code(err) {
					case codes.Unavailable, codes.ResourceExhausted, codes.DeadlineExceeded, codes.Aborted:
						wait = max(wait, time.Duration(100<<min(attempt, 6))*time.Millisecond)
					default:
						if wait == 0 {
							once.Do(func() { firstErr = err })
							return
						}
					}
					if time.Now().Add(wait).After(deadline) || ctx.Err() != nil {
						once.Do(func() { firstErr = fmt.Errorf("gave up: %w", err) })
						return
					}
					t := time.NewTimer(wait)
					select {
					case <-t.C:
					case <-ctx.Done():
						t.Stop()
					}
				}
				if n := done.Add(1); progress != nil {
					progress(int(n))
				}
			}
		}()
	}
	wg.Wait()
	if firstErr == nil {
		firstErr = ctx.Err()
	}
	return certs, firstErr
}
