package streams_test

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/devdb"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/migrations"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// deadLetters returns the bodies parked for consumer in the DEAD stream.
func deadLetters(t *testing.T, js jetstream.JetStream, consumer string) []string {
	t.Helper()
	ctx := context.Background()
	s, err := js.Stream(ctx, subjects.StreamDead)
	if err != nil {
		return nil
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for seq := info.State.FirstSeq; seq > 0 && seq <= info.State.LastSeq; seq++ {
		m, err := s.GetMsg(ctx, seq)
		if errors.Is(err, jetstream.ErrMsgNotFound) {
			continue
		}
		if err != nil {
			t.Fatal(err)
		}
		if m.Subject == subjects.Dead(consumer) {
			out = append(out, string(m.Data))
		}
	}
	return out
}

// The runner keeps the lead while it cannot park a poison message. The
// messages that arrive after the failed batch must not move the position
// past it (and their AckAll must not acknowledge it): once the DEAD stream
// is back, the poison message is parked and every other message applied.
func TestRunnerNeverMovesPastAFailedDeadLetter(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name string
		fail func(t *testing.T, js jetstream.JetStream)
	}{
		{"deleted", func(t *testing.T, js jetstream.JetStream) {
			if err := js.DeleteStream(ctx, subjects.StreamDead); err != nil {
				t.Fatal(err)
			}
		}},
		{"full", func(t *testing.T, js jetstream.JetStream) {
			var spec jetstream.StreamConfig
			for _, s := range streams.StreamSpecs(streams.Config{}) {
				if s.Name == subjects.StreamDead {
					spec = s
				}
			}
			spec.MaxMsgs = 1
			spec.Discard = jetstream.DiscardNew
			if _, err := js.UpdateStream(ctx, spec); err != nil {
				t.Fatal(err)
			}
			if _, err := js.Publish(ctx, subjects.Dead("filler"), []byte("filler")); err != nil {
				t.Fatal(err)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := setup(t)
			tc.fail(t, e.js)
			p := &rowsProjector{name: "rows"}
			e.publish(t, "ok1", "poison", "ok2")
			start(t, e, p, runnerConfig())
			poll.Until(t, "a failed attempt", func() bool { return p.applies.Load() >= 1 }, waitWithin)
			// Later messages arrive while the poison message cannot be
			// parked; the runner must keep failing at the poison message
			// rather than apply them.
			e.publish(t, "ok3", "ok4")
			n := p.applies.Load()
			poll.Until(t, "two more failed attempts", func() bool { return p.applies.Load() >= n+2 }, waitWithin)
			if pos := e.position(t, "rows"); pos != 0 {
				t.Fatalf("position %d while the poison message at 2 is not parked, want 0", pos)
			}
			if rows := e.rows(t, "rows"); len(rows) != 0 {
				t.Fatalf("rows %v applied past the unparked poison message", rows)
			}
			// Repair: the specs applied again, as at the next start.
			if err := streams.Apply(ctx, e.js, streams.StreamSpecs(streams.Config{})); err != nil {
				t.Fatal(err)
			}
			poll.Until(t, "every message applied", func() bool { return len(e.rows(t, "rows")) == 4 }, waitWithin)
			poll.Until(t, "position 5", func() bool { return e.position(t, "rows") == 5 }, waitWithin)
			if got := fmt.Sprint(e.rows(t, "rows")); got != "[ok1 ok2 ok3 ok4]" {
				t.Fatalf("rows %s", got)
			}
			if got := fmt.Sprint(deadLetters(t, e.js, "rows")); got != "[poison]" {
				t.Fatalf("dead letters %s, want [poison]", got)
			}
		})
	}
}

type fakeMessage struct{ seq uint64 }

func (m fakeMessage) Subject() string      { return "bes.p.elsewhere" }
func (m fakeMessage) Data() []byte         { return nil }
func (m fakeMessage) Header(string) string { return "" }
func (m fakeMessage) Seq() uint64          { return m.seq }
func (m fakeMessage) Time() time.Time      { return time.Time{} }

// foreignNamer names, as poison, a message that is not in its batch, the
// first `left` times it is given a batch holding "a2"; otherwise it applies
// like rowsProjector.
type foreignNamer struct {
	rowsProjector
	left atomic.Int32
}

func (p *foreignNamer) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	holds := false
	for _, m := range batch {
		holds = holds || string(m.Data()) == "a2"
	}
	if holds && p.left.Add(-1) >= 0 {
		p.applies.Add(1)
		return projection.Poison(fakeMessage{seq: 1 << 40}, errors.New("not in this batch"))
	}
	return p.rowsProjector.Apply(ctx, tx, batch)
}

// A projector that names a sequence its batch does not hold fails the
// batch; what arrives meanwhile must not move the position past it.
func TestRunnerForeignPoisonLosesNothing(t *testing.T) {
	e := setup(t)
	p := &foreignNamer{rowsProjector: rowsProjector{name: "rows"}}
	p.left.Store(3)
	e.publish(t, "a1", "a2", "a3")
	start(t, e, p, runnerConfig())
	poll.Until(t, "a failed attempt", func() bool { return p.applies.Load() >= 1 }, waitWithin)
	// These come in a batch of their own unless the runner re-points its
	// consumer at the failed batch.
	e.publish(t, "b1", "b2")
	poll.Until(t, "every message applied", func() bool { return e.position(t, "rows") == 5 }, waitWithin)
	if got := fmt.Sprint(e.rows(t, "rows")); got != "[a1 a2 a3 b1 b2]" {
		t.Fatalf("rows %s, want [a1 a2 a3 b1 b2]", got)
	}
	if d := deadLetters(t, e.js, "rows"); len(d) != 0 {
		t.Fatalf("dead letters %v, want none", d)
	}
}

// gate blocks Apply of one message applied on its own (as isolation does)
// until released, and reports when it is blocked.
type gatedProjector struct {
	rowsProjector
	body    string
	blocked chan struct{}
	release chan struct{}
	once    atomic.Bool
}

func (p *gatedProjector) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	if len(batch) == 1 && string(batch[0].Data()) == p.body && p.once.CompareAndSwap(false, true) {
		close(p.blocked)
		<-p.release
	}
	return p.rowsProjector.Apply(ctx, tx, batch)
}

// PostgreSQL restarts while the runner applies a batch one message at a
// time (after a data error): the runner must notice the connection is gone
// (and its lock with it), lead again, and finish, instead of retrying on a
// closed connection for ever while it counts itself the leader.
func TestRunnerIsolationSurvivesPostgresRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a private PostgreSQL cluster")
	}
	ctx := context.Background()
	pg, err := devdb.StartPrivate(ctx, filepath.Join(t.TempDir(), "pg"))
	if err != nil {
		t.Fatalf("private postgres: %v", err)
	}
	t.Cleanup(func() { pg.Stop(context.Background()) })
	if _, _, err := migrations.ApplyURL(ctx, pg.URL); err != nil {
		t.Fatal(err)
	}
	pool, err := pgxpool.New(ctx, pg.URL)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	if _, err := pool.Exec(ctx, `create table runner_rows (consumer text, seq bigint, body text check (body <> 'bad'), primary key (consumer, seq))`); err != nil {
		t.Fatal(err)
	}
	ns := testenv.NATS(t)
	nc, err := streams.Connect(ns.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	e := &env{js: js, nc: nc, pool: pool, pub: streams.NewPublisher(js, nil)}
	p := &gatedProjector{rowsProjector: rowsProjector{name: "rows"}, body: "ok2",
		blocked: make(chan struct{}), release: make(chan struct{})}
	e.publish(t, "ok1", "bad", "ok2", "ok3")
	cfg := runnerConfig()
	cfg.RetryMax = 200 * time.Millisecond
	start(t, e, p, cfg)
	select {
	case <-p.blocked:
	case <-time.After(30 * time.Second):
		t.Fatal("the runner never isolated the batch")
	}
	if err := pg.Stop(ctx); err != nil {
		t.Fatal(err)
	}
	close(p.release) // the transaction it was in fails on the dead connection
	if err := pg.Start(ctx); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "every good message applied after the restart", func() bool {
		var n int
		err := pool.QueryRow(ctx, "select count(*) from runner_rows").Scan(&n)
		return err == nil && n == 3
	}, waitWithin)

	poll.Until(t, "position 4", func() bool {
		var pos int64
		err := pool.QueryRow(ctx, "select stream_seq from consumer_positions where consumer = 'rows'").Scan(&pos)
		return err == nil && pos == 4
	}, waitWithin)

	if got := fmt.Sprint(deadLetters(t, js, "rows")); got != "[bad]" {
		t.Fatalf("dead letters %s, want [bad]", got)
	}
}
