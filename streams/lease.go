package streams

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
)

// ErrLocked is returned when another process holds the lead: by Acquire,
// and by Replay and Flush, which do not wait for it.
var ErrLocked = errors.New("another process holds the lead")

// ErrLeaseLost is the cause of a held lease's context once it is lost, and
// what Fence wraps when the lease is no longer this holder's.
var ErrLeaseLost = errors.New("the lease is lost")

// errReleased is the cause of a held lease's context after Release.
var errReleased = errors.New("the lease was released")

// lostCause is why a held lease's context ended if the lease is gone (lost
// or released), nil otherwise: a context ended by its parent (shutdown)
// leaves the lease held until Release, and the holder may still finish
// what it was doing, an ack of what is durable included.
func lostCause(ctx context.Context) error {
	if c := context.Cause(ctx); errors.Is(c, ErrLeaseLost) || errors.Is(c, errReleased) {
		return c
	}
	return nil
}

// Lease is the right to lead one consumer: to move its position, ack its
// messages, publish its rows. Every consumer of the core leads through one
// (docs/design.md, "The consumer core"); two kinds exist, chosen by where
// the consumer's position lives.
type Lease interface {
	// Acquire takes the lease without waiting, or returns ErrLocked when
	// another holder has it. The held lease's context derives from ctx.
	Acquire(ctx context.Context) (Held, error)
}

// Held is a lease taken.
type Held interface {
	// Context ends when the lease is lost, released, or the context given
	// to Acquire ends; its cause says which.
	Context() context.Context
	// Fence returns nil if this holder still holds the lease, and an error
	// otherwise (wrapping ErrLeaseLost once it is known to be lost, which
	// also ends Context). A holder calls it before an effect only the
	// holder may have: the export before it acks, the fold before it
	// writes a checkpoint or deletes.
	Fence(ctx context.Context) error
	// Release gives the lease up within ctx's deadline, so that a standby
	// takes it at once rather than after it lapses.
	Release(ctx context.Context)
}

// ConsumerLease is the lease of the runner of projector name: an advisory
// lock, as the position lives in PostgreSQL. A process that must keep the
// projector from running (a replay) takes it too.
func ConsumerLease(pool *pgxpool.Pool, name string) *PGLease {
	return NewPGLease(pool, "millrace.consumer."+name)
}

// PGLease is a PostgreSQL advisory lock (pg_try_advisory_lock on a hash of
// its key) held by the session of one connection taken out of the pool.
// For consumers whose position lives in PostgreSQL (the runner, the
// outbox, replays): the holder runs its transactions on that connection
// (PGHeld.Conn), so fencing comes by construction. A holder that lost the
// lock lost the connection, and the transaction that would commit its
// effect fails with it.
type PGLease struct {
	pool *pgxpool.Pool
	key  string
}

// NewPGLease makes the advisory lock named key in pool's database.
func NewPGLease(pool *pgxpool.Pool, key string) *PGLease { return &PGLease{pool: pool, key: key} }

// Acquire implements Lease.
func (l *PGLease) Acquire(ctx context.Context) (Held, error) { return l.AcquirePG(ctx) }

// AcquirePG is Acquire with the connection the holder must use.
func (l *PGLease) AcquirePG(ctx context.Context) (*PGHeld, error) {
	pc, err := l.pool.Acquire(ctx)
	if err != nil {
		return nil, fmt.Errorf("acquire connection: %w", err)
	}
	// Out of the pool: the connection is the lock, and goes when it goes.
	conn := pc.Hijack()
	var ok bool
	if err := conn.QueryRow(ctx, "select pg_try_advisory_lock(hashtextextended($1, 0))", l.key).Scan(&ok); err != nil {
		closeConn(conn)
		return nil, fmt.Errorf("take lock %s: %w", l.key, err)
	}
	if !ok {
		closeConn(conn)
		return nil, ErrLocked
	}
	h := &PGHeld{conn: conn, key: l.key}
	h.ctx, h.cancel = context.WithCancelCause(ctx)
	return h, nil
}

// PGHeld is a held advisory lock.
type PGHeld struct {
	conn   *pgx.Conn
	key    string
	ctx    context.Context
	cancel context.CancelCauseFunc
}

// Conn is the connection that holds the lock; the holder's transactions
// run on it, from one goroutine.
func (h *PGHeld) Conn() *pgx.Conn { return h.conn }

// Context implements Held.
func (h *PGHeld) Context() context.Context { return h.ctx }

// Fence implements Held: the lock holds while its connection does. It
// pings, so the holder calls it after a failure, not before each commit
// (the commit on Conn is the fence).
func (h *PGHeld) Fence(ctx context.Context) error {
	if err := lostCause(h.ctx); err != nil {
		return fmt.Errorf("%w: %w", ErrLeaseLost, err)
	}
	pctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if h.conn.IsClosed() || h.conn.Ping(pctx) != nil {
		if ctx.Err() != nil {
			return ctx.Err()
		}
		err := fmt.Errorf("%w: the connection holding lock %s is gone", ErrLeaseLost, h.key)
		h.cancel(err)
		return err
	}
	return nil
}

// Release implements Held: unlock (so that a standby's next try succeeds
// at once) and close the connection.
func (h *PGHeld) Release(ctx context.Context) {
	h.cancel(errReleased)
	if !h.conn.IsClosed() {
		h.conn.Exec(ctx, "select pg_advisory_unlock(hashtextextended($1, 0))", h.key)
	}
	h.conn.Close(ctx)
}

func closeConn(conn *pgx.Conn) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	conn.Close(ctx)
}

// KVLease is an entry of the key-value bucket LeaseBucket taken with
// compare-and-set: for consumers whose position does not live in
// PostgreSQL (the export's is its consumer's ack floor; the fold's, the
// bucket). Acquire creates the entry (refused while it exists); the holder
// renews it every TTL/3 by an update at the revision it holds; the
// bucket's MaxAge (Config.LeaseTTL) removes an entry its holder stopped
// renewing, so a standby takes over at most TTL after a crash.
//
// The holder counts the lease lost when a renewal is refused (the entry
// was deleted or another holder took it), or once 9/10 of the TTL passed
// since it sent the last renewal that succeeded: the server keeps the
// entry for a whole TTL after it stored it, so until then no one else can
// have it. Loss ends the held context; Fence also reads the entry, to see
// a deletion or a taking before the next renewal would.
type KVLease struct {
	js    jetstream.JetStream
	key   string
	owner string
}

// NewKVLease makes the lease named key (letters, digits, '-', '_', '.')
// in js's LeaseBucket.
func NewKVLease(js jetstream.JetStream, key string) *KVLease {
	return &KVLease{js: js, key: key, owner: leaseOwner()}
}

// leaseOwner names this holder in the entry, for operators (`nats kv get
// millrace_leases <key>`) and so that a process that gave the lease up
// while it could not reach the server takes its own entry back.
func leaseOwner() string {
	host, _ := os.Hostname()
	b := make([]byte, 6)
	rand.Read(b)
	return fmt.Sprintf("%s/%d/%s", host, os.Getpid(), hex.EncodeToString(b))
}

// Owner is the value this lease writes into its entry.
func (l *KVLease) Owner() string { return l.owner }

// Acquire implements Lease.
func (l *KVLease) Acquire(ctx context.Context) (Held, error) {
	kv, ttl, err := leaseBucket(ctx, l.js)
	if err != nil {
		return nil, err
	}
	sent := time.Now()
	rev, err := kv.Create(ctx, l.key, []byte(l.owner))
	if errors.Is(err, jetstream.ErrKeyExists) {
		rev, err = l.reclaim(ctx, kv)
	}
	if err != nil {
		return nil, err
	}
	h := &KVHeld{kv: kv, nc: l.js.Conn(), api: apiPrefix(l.js), key: l.key, owner: l.owner, ttl: ttl, rev: rev, renewed: sent}
	h.ctx, h.cancel = context.WithCancelCause(ctx)
	h.done = make(chan struct{})
	go h.renew()
	return h, nil
}

// reclaim takes back an entry that holds this lease's own owner: left when
// a Release could not reach the server. Any other holder's is ErrLocked.
func (l *KVLease) reclaim(ctx context.Context, kv jetstream.KeyValue) (uint64, error) {
	e, err := kv.Get(ctx, l.key)
	if errors.Is(err, jetstream.ErrKeyNotFound) {
		return 0, ErrLocked // gone meanwhile: the next try creates it
	}
	if err != nil {
		return 0, fmt.Errorf("read lease %s: %w", l.key, err)
	}
	if string(e.Value()) != l.owner {
		return 0, ErrLocked
	}
	rev, err := kv.Update(ctx, l.key, []byte(l.owner), e.Revision())
	if errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
		return 0, ErrLocked
	}
	return rev, err
}

// KVHeld is a held key-value lease.
type KVHeld struct {
	kv     jetstream.KeyValue
	nc     *nats.Conn
	api    string // the JetStream API's subject prefix
	key    string
	owner  string
	ttl    time.Duration
	ctx    context.Context
	cancel context.CancelCauseFunc
	done   chan struct{}

	// turn is held by a renewal from its request to its recording and by
	// a fence from reading the held revision to reading the entry's: a
	// fence that read the entry between a renewal's store and its
	// recording would see the holder's own new revision and call the
	// lease taken.
	turn sync.Mutex

	mu      sync.Mutex
	rev     uint64
	renewed time.Time // when the last renewal that succeeded was sent
}

// Context implements Held.
func (h *KVHeld) Context() context.Context { return h.ctx }

// Revision is the entry's revision this holder holds.
func (h *KVHeld) Revision() uint64 {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.rev
}

func (h *KVHeld) state() (uint64, time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.rev, h.renewed
}

// valid is how long after a renewal was sent the holder may count on it.
func (h *KVHeld) valid() time.Duration { return h.ttl - h.ttl/10 }

func (h *KVHeld) lose(err error) error {
	err = fmt.Errorf("%w: %s: %w", ErrLeaseLost, h.key, err)
	h.cancel(err)
	return err
}

// Fence implements Held: not lapsed, and the entry's last revision is the
// one this holder wrote (read from the stream's leader, not a replica).
func (h *KVHeld) Fence(ctx context.Context) error {
	if err := lostCause(h.ctx); err != nil {
		return fmt.Errorf("%w: %w", ErrLeaseLost, err)
	}
	h.turn.Lock()
	defer h.turn.Unlock()
	rev, renewed := h.state()
	if time.Since(renewed) >= h.valid() {
		return h.lose(errors.New("not renewed within the TTL"))
	}
	seq, owner, err := h.lastEntry(ctx)
	switch {
	case errors.Is(err, jetstream.ErrMsgNotFound):
		return h.lose(errors.New("the entry is gone"))
	case err != nil:
		return fmt.Errorf("read lease %s: %w", h.key, err)
	case seq != rev:
		return h.lose(fmt.Errorf("the entry is at revision %d, not %d (deleted, or taken by %q)", seq, rev, owner))
	}
	return nil
}

// lastEntry reads the entry's last revision from the bucket stream's
// leader, with the API's own message get ({"last_by_subj":...} on
// <prefix>STREAM.MSG.GET.<stream>). Not kv.Get, nor jetstream.Stream's
// GetLastMsgForSubject: key-value buckets allow direct gets, which both
// use and any replica answers, and one that is behind would vouch for a
// revision another holder has replaced.
func (h *KVHeld) lastEntry(ctx context.Context) (uint64, string, error) {
	req, _ := json.Marshal(map[string]string{"last_by_subj": leaseSubject(h.key)})
	reply, err := h.nc.RequestWithContext(ctx, h.api+"STREAM.MSG.GET.KV_"+LeaseBucket, req)
	if err != nil {
		return 0, "", err
	}
	if reply.Header.Get("Status") == "503" {
		return 0, "", nats.ErrNoResponders
	}
	var resp struct {
		Error   *jetstream.APIError `json:"error"`
		Message *struct {
			Seq  uint64 `json:"seq"`
			Data []byte `json:"data"`
		} `json:"message"`
	}
	if err := json.Unmarshal(reply.Data, &resp); err != nil {
		return 0, "", err
	}
	switch {
	case resp.Error != nil && resp.Error.ErrorCode == jetstream.JSErrCodeMessageNotFound:
		return 0, "", jetstream.ErrMsgNotFound
	case resp.Error != nil:
		return 0, "", resp.Error
	case resp.Message == nil:
		return 0, "", errors.New("empty answer")
	}
	return resp.Message.Seq, string(resp.Message.Data), nil
}

// renew updates the entry at the held revision every TTL/3 (sooner after a
// failure) until the lease is released or lost. No wait and no request
// outlasts the moment the lease lapses: the holder stops leading then, on
// its own, whatever the server does.
func (h *KVHeld) renew() {
	defer close(h.done)
	t := time.NewTimer(h.ttl / 3)
	defer t.Stop()
	for {
		select {
		case <-h.ctx.Done():
			return
		case <-t.C:
		}
		rev, renewed := h.state()
		lapse := renewed.Add(h.valid())
		if !time.Now().Before(lapse) {
			h.lose(errors.New("not renewed within the TTL"))
			return
		}
		sent := time.Now()
		deadline := sent.Add(h.ttl / 3)
		if lapse.Before(deadline) {
			deadline = lapse
		}
		rctx, cancel := context.WithDeadline(h.ctx, deadline)
		h.turn.Lock()
		next, err := h.kv.Update(rctx, h.key, []byte(h.owner), rev)
		if err == nil {
			h.mu.Lock()
			h.rev, h.renewed = next, sent
			h.mu.Unlock()
		}
		h.turn.Unlock()
		cancel()
		switch {
		case err == nil:
			t.Reset(h.ttl / 3)
		case errors.Is(err, jetstream.ErrKeyRevisionMismatch):
			h.lose(errors.New("renewal refused: the entry was deleted or taken"))
			return
		default:
			t.Reset(max(0, min(h.ttl/10, time.Until(lapse))))
		}
	}
}

// Release implements Held: stop renewing and delete the entry at the held
// revision (a standby's next Create then succeeds at once). An entry that
// cannot be deleted lapses after the TTL, or this lease takes it back.
func (h *KVHeld) Release(ctx context.Context) {
	lost := lostCause(h.ctx)
	h.cancel(errReleased)
	<-h.done
	if lost != nil {
		return // lost: the entry is someone else's, or gone
	}
	h.kv.Delete(ctx, h.key, jetstream.LastRevision(h.Revision()))
}

// The lease bucket: one JetStream key-value bucket holds every lease.
const (
	LeaseBucket     = "millrace_leases"
	DefaultLeaseTTL = 15 * time.Second
)

func leaseSubject(key string) string { return "$KV." + LeaseBucket + "." + key }

// LeaseBucketSpec is the lease bucket: one entry per lease, one revision
// kept (History 1), removed TTL after its last write (the bucket's MaxAge:
// Config.LeaseTTL).
func LeaseBucketSpec(c Config) jetstream.KeyValueConfig {
	c = c.WithDefaults()
	return jetstream.KeyValueConfig{
		Bucket:      LeaseBucket,
		Description: "millrace consumer leases: who leads the export and the fold (streams/lease.go)",
		History:     1,
		TTL:         c.LeaseTTL,
		Storage:     jetstream.FileStorage,
		Replicas:    c.Replicas,
	}
}

// leaseBucket binds the lease bucket, making it with the default spec
// when it is missing (Open applies the configured one at start).
func leaseBucket(ctx context.Context, js jetstream.JetStream) (jetstream.KeyValue, time.Duration, error) {
	kv, err := js.KeyValue(ctx, LeaseBucket)
	if errors.Is(err, jetstream.ErrBucketNotFound) {
		kv, err = js.CreateKeyValue(ctx, LeaseBucketSpec(Config{}))
		if errors.Is(err, jetstream.ErrBucketExists) {
			kv, err = js.KeyValue(ctx, LeaseBucket)
		}
	}
	if err != nil {
		return nil, 0, fmt.Errorf("lease bucket %s: %w", LeaseBucket, err)
	}
	st, err := kv.Status(ctx)
	if err != nil {
		return nil, 0, fmt.Errorf("lease bucket %s: %w", LeaseBucket, err)
	}
	if st.TTL() <= 0 {
		return nil, 0, fmt.Errorf("lease bucket %s keeps entries for ever: a crashed holder's lease would never lapse", LeaseBucket)
	}
	return kv, st.TTL(), nil
}
