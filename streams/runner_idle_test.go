package streams_test

import (
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// countPulls counts the pull requests made of durable's consumer as the
// server receives them: a plain subscription on the subject of the
// JetStream API call, beside the server's own.
func countPulls(t *testing.T, nc *nats.Conn, stream, durable string) *atomic.Int64 {
	t.Helper()
	var n atomic.Int64
	sub, err := nc.Subscribe("$JS.API.CONSUMER.MSG.NEXT."+stream+"."+durable, func(*nats.Msg) { n.Add(1) })
	if err != nil {
		t.Fatal(err)
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sub.Unsubscribe() })
	return &n
}

// waitingPulls is how many pull requests wait at the server on the
// consumer.
func (e *env) waitingPulls(t *testing.T, durable string) int {
	t.Helper()
	cons, err := e.js.Consumer(context.Background(), subjects.StreamBES, durable)
	if err != nil {
		return -1 // not made yet
	}
	ci, err := cons.Info(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return ci.NumWaiting
}

// A runner with nothing to do leaves one pull waiting at the server rather
// than polling every MaxWait, and a message that comes is applied at once,
// not when that pull expires (a sweep is an hour away here).
func TestRunnerWaitsAtTheServerWhenIdle(t *testing.T) {
	e := setup(t)
	p := &rowsProjector{name: "idle"}
	cfg := runnerConfig()
	cfg.MaxWait = 10 * time.Millisecond // polling would pull 100 times a second
	pulls := countPulls(t, e.nc, cfg.Stream, p.name)
	start(t, e, p, cfg)
	waiting := func() bool { return e.waitingPulls(t, p.name) == 1 }
	for i, body := range []string{"a", "b"} {
		poll.Until(t, "a pull waiting at the server", waiting, waitWithin)
		before := pulls.Load()
		// A window, not a wait for something to happen: polling would
		// pull about 50 times in it.
		time.Sleep(500 * time.Millisecond)
		if n := pulls.Load() - before; n > 1 {
			t.Fatalf("an idle runner pulled %d times in 500ms, want at most 1", n)
		}
		e.publish(t, body)
		poll.Until(t, "the message applied", func() bool { return len(e.rows(t, p.name)) == i+1 }, waitWithin)
	}
}

// An idle runner still sweeps every SweepEvery: its pull waits only until
// the next sweep is due.
func TestRunnerSweepsWhileIdle(t *testing.T) {
	e := setup(t)
	p := &sweepCounter{rowsProjector: rowsProjector{name: "idlesweep"}}
	cfg := runnerConfig()
	cfg.MaxWait = 10 * time.Millisecond
	cfg.SweepEvery = 200 * time.Millisecond
	pulls := countPulls(t, e.nc, cfg.Stream, p.name)
	start(t, e, p, cfg)
	poll.Until(t, "5 sweeps of an idle stream", func() bool { return p.sweeps.Load() >= 5 }, waitWithin)
	// Polling would have pulled at least 80 times over the 4 intervals.
	if n, s := pulls.Load(), p.sweeps.Load(); n > 2*int64(s)+4 {
		t.Fatalf("%d pulls for %d sweeps, want about one a sweep", n, s)
	}
}

// A pull waiting at the server is lost when the server goes down without
// answering it (a crash): the runner must not sit on it after it
// reconnects until the missing heartbeats (10s) say so. The client
// reaches the server through a proxy, cut before the server is restarted,
// so that the server's goodbye to the pull never reaches it.
func TestRunnerIdleSurvivesABackboneCrash(t *testing.T) {
	dir := t.TempDir()
	ns := testenv.NATSAt(t, dir, -1)
	port := ns.Addr().(*net.TCPAddr).Port
	px := newProxy(t, ns.Addr().String())
	nc, err := streams.Connect("nats://"+px.addr, t.Name())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	ctx := context.Background()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	pool, _ := testenv.Pool(t)
	if _, err := pool.Exec(ctx, `create table runner_rows (consumer text, seq bigint, body text, primary key (consumer, seq))`); err != nil {
		t.Fatal(err)
	}
	e := &env{js: js, nc: nc, pool: pool, pub: streams.NewPublisher(js, nil)}
	p := &rowsProjector{name: "crash"}
	cfg := runnerConfig()
	cfg.Logger = quietLog()
	start(t, e, p, cfg)
	poll.Until(t, "a pull waiting at the server", func() bool { return e.waitingPulls(t, p.name) == 1 }, waitWithin)

	px.cut()
	ns.Shutdown()
	ns.WaitForShutdown()
	testenv.NATSAt(t, dir, port)
	px.resume()
	poll.Until(t, "reconnected", nc.IsConnected, waitWithin)
	poll.Until(t, "a publish", func() bool {
		msg := nats.NewMsg(subjects.BES("p", "inv"))
		msg.Header.Set(envelope.MsgID, t.Name())
		msg.Data = []byte("after")
		return e.pub.Publish(ctx, msg) == nil
	}, waitWithin)
	poll.Until(t, "the message published after the crash applied", func() bool { return len(e.rows(t, p.name)) == 1 },
		poll.Within(5*time.Second))
}

// proxy forwards TCP connections to a server until cut, which closes them
// and refuses new ones until resume.
type proxy struct {
	t      *testing.T
	addr   string
	target string
	mu     sync.Mutex
	ln     net.Listener
	conns  []net.Conn
}

func newProxy(t *testing.T, target string) *proxy {
	px := &proxy{t: t, addr: "127.0.0.1:0", target: target}
	px.resume()
	px.addr = px.ln.Addr().String()
	t.Cleanup(px.cut)
	return px
}

func (px *proxy) resume() {
	ln, err := net.Listen("tcp", px.addr)
	if err != nil {
		px.t.Fatal(err)
	}
	px.mu.Lock()
	px.ln = ln
	px.mu.Unlock()
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", px.target)
			if err != nil {
				c.Close()
				continue
			}
			px.mu.Lock()
			px.conns = append(px.conns, c, s)
			px.mu.Unlock()
			go func() { io.Copy(s, c); s.Close() }()
			go func() { io.Copy(c, s); c.Close() }()
		}
	}()
}

func (px *proxy) cut() {
	px.mu.Lock()
	defer px.mu.Unlock()
	px.ln.Close()
	for _, c := range px.conns {
		c.Close()
	}
	px.conns = nil
}

// idleSweeper is a sweepCounter that says its sweeps have nothing to do
// until a batch is applied, and again after its next sweep, as the placer
// does when it holds nothing.
type idleSweeper struct {
	sweepCounter
	idle atomic.Bool
}

func (p *idleSweeper) Apply(ctx context.Context, tx pgx.Tx, batch []projection.Message) error {
	p.idle.Store(false)
	return p.sweepCounter.Apply(ctx, tx, batch)
}

func (p *idleSweeper) Sweep(ctx context.Context, tx pgx.Tx, now time.Time) error {
	p.idle.Store(true)
	return p.sweepCounter.Sweep(ctx, tx, now)
}

func (p *idleSweeper) Idle() bool { return p.idle.Load() }

// A projector whose sweeps have nothing to do is swept every
// IdleSweepEvery, not every SweepEvery, until a batch is applied.
func TestRunnerSweepsAnIdlerSeldom(t *testing.T) {
	e := setup(t)
	p := &idleSweeper{sweepCounter: sweepCounter{rowsProjector: rowsProjector{name: "idler"}}}
	cfg := runnerConfig()
	cfg.SweepEvery = 20 * time.Millisecond
	cfg.IdleSweepEvery = time.Hour
	pulls := countPulls(t, e.nc, cfg.Stream, p.name)
	start(t, e, p, cfg)
	poll.Until(t, "a first sweep", func() bool { return p.sweeps.Load() >= 1 }, waitWithin)
	swept, pulled := p.sweeps.Load(), pulls.Load()
	// A window: swept every SweepEvery, it would be swept about 25 times.
	time.Sleep(500 * time.Millisecond)
	if n := p.sweeps.Load() - swept; n > 0 {
		t.Fatalf("an idle projector was swept %d times in 500ms", n)
	}
	if n := pulls.Load() - pulled; n > 1 {
		t.Fatalf("an idle runner pulled %d times in 500ms", n)
	}
	// A batch ends it: the next sweep comes SweepEvery after the last.
	e.publish(t, "a")
	poll.Until(t, "a sweep after the batch", func() bool { return p.sweeps.Load() > swept }, waitWithin)
	if got := e.rows(t, p.name); len(got) != 1 {
		t.Fatalf("rows %v", got)
	}
}
