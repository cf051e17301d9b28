package streams_test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// The commit log's fold (commitlog.FoldRunner) as a user of the fault
// suite. It lives in package commitlog, which imports streams; this
// external test package may import it back without a cycle, so the fold
// runs the same faults and checks as the core's own users.

// foldUser: the fold of one world of COMMITS into a folder that keeps its
// checkpoint in memory, shared by every instance as the bucket is.
type foldUser struct {
	g   gate
	f   memFolder
	fed []string
	mu  sync.Mutex
	doc map[string]uint64 // each document's last version written
}

const (
	foldWorld   = "w"
	foldDocs    = 5
	foldDurable = "compactor"
)

func newFoldUser() *foldUser {
	u := &foldUser{doc: map[string]uint64{}}
	u.f.g, u.f.last = &u.g, map[string]uint64{}
	return u
}

// memFolder folds into memory. Its effect is its checkpoint: the versions
// folded, in order, and the position; a fold stores it only while the
// fold's lease holds (projection.Fence), as the compactor does before its
// manifest.
type memFolder struct {
	g       *gate
	mu      sync.Mutex
	covered uint64
	folded  []string          // the bodies folded, in order
	last    map[string]uint64 // doc -> its version in the checkpoint
}

func (f *memFolder) Covered(context.Context, string) (uint64, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.covered, nil
}

// Fold drops what the compactor would: every version folded that is not
// its document's last.
func (f *memFolder) Fold(ctx context.Context, _ string, versions []projection.Version) ([]uint64, error) {
	f.g.pass()
	if err := projection.Fence(ctx); err != nil {
		return nil, err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var drop []uint64
	for _, v := range versions {
		if v.Seq <= f.covered {
			continue
		}
		if prev, ok := f.last[v.Doc]; ok {
			drop = append(drop, prev)
		}
		f.last[v.Doc], f.covered = v.Seq, v.Seq
		f.folded = append(f.folded, string(v.Body))
	}
	slices.Sort(drop)
	return drop, nil
}

// newFoldRunner makes a fold runner of a config the test means to be valid.
func newFoldRunner(t testing.TB, js jetstream.JetStream, f projection.Folder, cfg commitlog.FoldRunnerConfig) *commitlog.FoldRunner {
	t.Helper()
	r, err := commitlog.NewFoldRunner(js, f, cfg)
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func (u *foldUser) start(t *testing.T, e *faultEnv) instance {
	reg := prometheus.NewRegistry()
	r := newFoldRunner(t, e.js, &u.f, commitlog.FoldRunnerConfig{
		Durable: foldDurable, MinVersions: 10, Interval: 20 * time.Millisecond, Fetch: 16, MaxAckPending: 1000,
		RetryMin: 10 * time.Millisecond, RetryMax: 100 * time.Millisecond, StandbyEvery: 50 * time.Millisecond,
		ConsumerMetrics: streams.NewMetrics(reg), Logger: quietLog()})
	return run(t, reg, r.Run)
}

func (u *foldUser) feed(t *testing.T, e *faultEnv, n int) {
	t.Helper()
	for range n {
		i := len(u.fed)
		doc := "d" + strconv.Itoa(i%foldDocs)
		body := "f" + strconv.Itoa(i)
		msg := nats.NewMsg(subjects.Commits(foldWorld, doc))
		msg.Header.Set("Nats-Msg-Id", t.Name()+"/"+body)
		msg.Data = []byte(body)
		var ack *jetstream.PubAck
		poll.Until(t, "a publish", func() bool {
			var err error
			ack, err = e.js.PublishMsg(context.Background(), msg)
			return err == nil
		}, waitWithin)

		u.fed = append(u.fed, body)
		u.mu.Lock()
		u.doc[doc] = ack.Sequence
		u.mu.Unlock()
	}
}

func (u *foldUser) want() []string { return u.fed }

func (u *foldUser) effects(*testing.T, *faultEnv) []string {
	u.f.mu.Lock()
	defer u.f.mu.Unlock()
	return slices.Clone(u.f.folded)
}

// position is the checkpoint's, where the fold's position lives.
func (u *foldUser) position(*faultEnv) (uint64, bool) {
	u.f.mu.Lock()
	defer u.f.mu.Unlock()
	return u.f.covered, true
}

func (u *foldUser) durable() (string, string) { return subjects.StreamCommits, foldDurable }
func (u *foldUser) kill(t *testing.T, e *faultEnv) {
	kvKill(t, e, commitlog.FoldLeaseKey(foldDurable))
}
func (u *foldUser) take(t *testing.T, e *faultEnv) func() {
	return kvTake(t, e, commitlog.FoldLeaseKey(foldDurable))
}
func (u *foldUser) gate() *gate           { return &u.g }
func (u *foldUser) beforeFault(*faultEnv) {}
func (u *foldUser) mayRepeat(string) bool { return false }

// check: whatever the fault, every version is acknowledged once folded,
// and no document lost its last version in the stream (compare-and-set
// rests on it).
func (u *foldUser) check(t *testing.T, e *faultEnv) {
	poll.Until(t, "every version acknowledged", func() bool { return u.acked(e) == nil }, waitWithin)
	ctx := context.Background()
	s, err := e.js.Stream(ctx, subjects.StreamCommits)
	if err != nil {
		t.Fatal(err)
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	for doc, v := range u.doc {
		m, err := s.GetLastMsgForSubject(ctx, subjects.Commits(foldWorld, doc))
		if err != nil || m.Sequence != v {
			t.Errorf("the stream's last version of %s: %v (%v), want %d", doc, m, err, v)
		}
	}
}

// acked: the fold's consumer acks each version once it is folded, so its
// ack floor reaches the last version fed once everything is.
func (u *foldUser) acked(e *faultEnv) error {
	c, err := e.js.Consumer(context.Background(), subjects.StreamCommits, foldDurable)
	if err != nil {
		return err
	}
	u.mu.Lock()
	defer u.mu.Unlock()
	var top uint64
	for _, v := range u.doc {
		top = max(top, v)
	}
	if f := c.CachedInfo().AckFloor.Stream; f != top {
		return fmt.Errorf("ack floor %d, last version %d", f, top)
	}
	return nil
}
