package fleet

import (
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/credentials"

	"github.com/millrace/millrace/internal/poll"
)

// blockingCreds is a handshake that takes until release is closed, and
// counts how many run at once.
type blockingCreds struct {
	credentials.TransportCredentials
	release      chan struct{}
	now, highest atomic.Int64
}

func (b *blockingCreds) ServerHandshake(c net.Conn) (net.Conn, credentials.AuthInfo, error) {
	n := b.now.Add(1)
	for {
		h := b.highest.Load()
		if n <= h || b.highest.CompareAndSwap(h, n) {
			break
		}
	}
	<-b.release
	b.now.Add(-1)
	return c, nil, nil
}

// A storm of connections: at most `slots` handshakes run at once, `queue`
// more wait their turn, and the rest are closed at once instead of adding
// to the pile.
func TestHandshakesAreAdmitted(t *testing.T) {
	inner := &blockingCreds{release: make(chan struct{})}
	c := newLimitedCredsN(inner, NewMetrics(nil), 3, 5, time.Minute)
	var (
		wg       sync.WaitGroup
		shed, ok atomic.Int64
	)
	for range 20 {
		wg.Go(func() {
			if _, _, err := c.ServerHandshake(nil); err != nil {
				shed.Add(1)
			} else {
				ok.Add(1)
			}
		})
	}
	// The check below, not the wait, says whether too few or too many
	// were shed.
	poll.True(func() bool { return shed.Load() >= 12 }, poll.Within(10*time.Second))
	if got := shed.Load(); got != 12 {
		t.Fatalf("%d connections shed, want 12 (20 - 3 running - 5 waiting)", got)
	}
	close(inner.release)
	wg.Wait()
	if ok.Load() != 8 {
		t.Fatalf("%d handshakes done, want 8", ok.Load())
	}
	if h := inner.highest.Load(); h != 3 {
		t.Fatalf("%d handshakes ran at once, want at most (and here exactly) 3", h)
	}
}

// A connection that waits longer than the wait is closed.
func TestHandshakeWaitIsBounded(t *testing.T) {
	inner := &blockingCreds{release: make(chan struct{})}
	defer close(inner.release)
	c := newLimitedCredsN(inner, NewMetrics(nil), 1, 5, 50*time.Millisecond)
	go c.ServerHandshake(nil) // holds the one slot
	poll.Until(t, "the first handshake to take the slot", func() bool { return inner.now.Load() != 0 }, poll.Every(time.Millisecond))
	if _, _, err := c.ServerHandshake(nil); err != errHandshakeBusy {
		t.Fatalf("err %v, want errHandshakeBusy", err)
	}
}
