package kafka

import (
	"context"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/compactor"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The runner and the exporter together, on an embedded JetStream and an
// in-process Kafka (kfake). The tests import NATS; the package does not.

type backbone struct {
	js     jetstream.JetStream
	stream jetstream.Stream
}

func startBackbone(t *testing.T) backbone {
	t.Helper()
	ns := testenv.NATS(t)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	st, err := js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	return backbone{js: js, stream: st}
}

// publish stores n build events over keys invocations and returns the last
// sequence.
func (b backbone) publish(t *testing.T, from, n, keys int) uint64 {
	t.Helper()
	var last uint64
	for i := from; i < from+n; i++ {
		m := &nats.Msg{Subject: fmt.Sprintf("bes.p.inv%03d", i%keys), Data: []byte(fmt.Sprint("event ", i)),
			Header: nats.Header{"Nats-Msg-Id": {fmt.Sprint("e", i)}, "Millrace-Schema": {"bes.v1"}}}
		ack, err := b.js.PublishMsg(context.Background(), m)
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
	}
	return last
}

func (b backbone) ackFloor(t *testing.T, durable string) uint64 {
	t.Helper()
	c, err := b.stream.Consumer(context.Background(), durable)
	if err != nil {
		return 0
	}
	return c.CachedInfo().AckFloor.Stream
}

func freePort(t *testing.T) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// exportProcess is one exporter and its runner, as a process would run
// them.
type exportProcess struct {
	exp    *Exporter
	cancel context.CancelFunc
	done   chan struct{}
}

func startExport(t *testing.T, b backbone, brokers []string) *exportProcess {
	t.Helper()
	exp, err := New(Config{Brokers: brokers, Routes: []Route{{"bes.>", "millrace.bes"}}, CreateTopics: true, Partitions: 3}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := exp.EnsureTopics(context.Background()); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &exportProcess{exp: exp, cancel: cancel, done: make(chan struct{})}
	r, err := streams.NewExportRunner(b.js, exp, streams.ExportConfig{Stream: subjects.StreamBES, Filters: []string{"bes.>"},
		MaxInFlight: 500, RetryMin: 50 * time.Millisecond, RetryMax: 500 * time.Millisecond}, nil)
	if err != nil {
		t.Fatal(err)
	}
	go func() {
		defer close(p.done)
		r.Run(ctx)
	}()
	return p
}

func (p *exportProcess) stop() {
	p.cancel()
	<-p.done
	p.exp.Close()
}

// TestExportSurvivesBrokerRestartAndCrash: Kafka restarts mid-export (its
// data kept on disk) while the export goes on; then Kafka goes away again
// and the exporting process is stopped with records in flight, and a new
// one takes over once Kafka is back. Afterwards every stream message is in
// Kafka, as stored, and each key's records come in stream order: a record
// repeats only as a resend of one already there, with the same sequence.
func TestExportSurvivesBrokerRestartAndCrash(t *testing.T) {
	b := startBackbone(t)
	port := freePort(t)
	dir := t.TempDir()
	kopts := []kfake.Opt{kfake.NumBrokers(1), kfake.Ports(port), kfake.DataDir(dir)}
	k, err := kfake.NewCluster(kopts...)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { k.Close() }()
	brokers := k.ListenAddrs()
	restart := func() {
		t.Helper()
		if k, err = kfake.NewCluster(kopts...); err != nil {
			t.Fatal(err)
		}
	}
	const keys, perRound = 40, 3000

	p := startExport(t, b, brokers)
	last := b.publish(t, 0, perRound, keys)
	poll.Until(t, "a third of the first round exported", func() bool { return b.ackFloor(t, "export-bes") >= last/3 }, poll.Within(30*time.Second))

	// Kafka goes away while messages keep coming, and comes back.
	k.Close()
	last = b.publish(t, perRound, perRound, keys)
	time.Sleep(300 * time.Millisecond)
	restart()
	poll.Until(t, "two thirds exported", func() bool { return b.ackFloor(t, "export-bes") >= last*2/3 }, poll.Within(60*time.Second))

	// Kafka goes away again, and the process stops with records in
	// flight (it must not wait for Kafka); another takes over.
	k.Close()
	last = b.publish(t, 2*perRound, perRound, keys)
	time.Sleep(300 * time.Millisecond)
	stopped := make(chan struct{})
	go func() { p.stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(10 * time.Second):
		t.Fatal("the export process did not stop while Kafka was away")
	}
	floor := b.ackFloor(t, "export-bes")
	if floor >= last {
		t.Fatalf("everything was acknowledged (%d) while Kafka was away", floor)
	}
	restart()
	p = startExport(t, b, brokers)
	defer p.stop()
	poll.Until(t, "everything exported", func() bool { return b.ackFloor(t, "export-bes") == last }, poll.Within(60*time.Second))

	recs := readAll(t, brokers, "millrace.bes", int(last), 30*time.Second)
	checkExport(t, b, recs, last)
}

// checkExport is the oracle: it compares the records with the stream.
func checkExport(t *testing.T, b backbone, recs []*kgo.Record, last uint64) {
	t.Helper()
	ctx := context.Background()
	first := map[uint64]*kgo.Record{}
	dups := 0
	// Per partition, in offset order, each key's new sequences must be the
	// key's next message in the stream.
	type kp struct {
		key string
		p   int32
	}
	maxSeen := map[kp]uint64{}
	bySubject := map[string][]uint64{} // each subject's sequences, from the stream
	for seq := uint64(1); seq <= last; seq++ {
		m, err := b.stream.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		bySubject[m.Subject] = append(bySubject[m.Subject], seq)
	}
	next := map[string]int{}
	for _, r := range recs {
		seq, err := strconv.ParseUint(header(r, HeaderSeq), 10, 64)
		if err != nil {
			t.Fatalf("a record without its sequence: %v", r.Headers)
		}
		key := kp{string(r.Key), r.Partition}
		if seq <= maxSeen[key] {
			if first[seq] == nil {
				t.Fatalf("key %s: sequence %d after %d, and never exported before: out of order", key.key, seq, maxSeen[key])
			}
			dups++
			continue
		}
		want := bySubject[key.key]
		if next[key.key] >= len(want) || want[next[key.key]] != seq {
			t.Fatalf("key %s: sequence %d where the stream's next is %v: a gap or a reorder", key.key, seq, want[next[key.key]:min(next[key.key]+1, len(want))])
		}
		next[key.key]++
		maxSeen[key] = seq
		first[seq] = r
	}
	lost := 0
	for seq := uint64(1); seq <= last; seq++ {
		r := first[seq]
		if r == nil {
			lost++
			continue
		}
		m, err := b.stream.GetMsg(ctx, seq)
		if err != nil {
			t.Fatal(err)
		}
		if string(r.Key) != m.Subject || string(r.Value) != string(m.Data) || header(r, "Nats-Msg-Id") != m.Header.Get("Nats-Msg-Id") {
			t.Fatalf("record of %d differs from the stream: key %q value %q", seq, r.Key, r.Value)
		}
	}
	if lost > 0 {
		t.Fatalf("%d of %d messages not in Kafka", lost, last)
	}
	t.Logf("%d messages exported, %d records, %d resent after the restarts", last, len(recs), dups)
}

// TestExportAgainstRealBroker runs the export against a real Kafka when
// MILLRACE_TEST_KAFKA_BROKERS names one (host:port, comma-separated).
func TestExportAgainstRealBroker(t *testing.T) {
	env := os.Getenv("MILLRACE_TEST_KAFKA_BROKERS")
	if env == "" {
		t.Skip("MILLRACE_TEST_KAFKA_BROKERS is not set")
	}
	b := startBackbone(t)
	topic := fmt.Sprintf("millrace-test-%d", time.Now().UnixNano())
	exp, err := New(Config{Brokers: strings.Split(env, ","), Routes: []Route{{"bes.>", topic}}, CreateTopics: true, Partitions: 3}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer exp.Close()
	if err := exp.EnsureTopics(context.Background()); err != nil {
		t.Fatal(err)
	}
	r, err := streams.NewExportRunner(b.js, exp, streams.ExportConfig{Stream: subjects.StreamBES}, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		r.Run(ctx)
	}()
	defer func() { cancel(); wg.Wait() }()
	last := b.publish(t, 0, 2000, 20)
	poll.Until(t, "everything exported", func() bool { return b.ackFloor(t, "export-bes") == last }, poll.Within(60*time.Second))
	checkExport(t, b, readAll(t, strings.Split(env, ","), topic, int(last), 60*time.Second), last)
}

// TestCommitsExportWhileCompacting: Kafka goes away, the exporting
// process stops with versions in flight, and the compactor folds and
// deletes COMMITS versions meanwhile. The compactor, told that the export's
// consumer holds it back (HoldFor), holds its deletions at the export's ack
// floor, so every version still reaches Kafka when it and a new exporter
// are back; then the next pass drops what was withheld.
func TestCommitsExportWhileCompacting(t *testing.T) {
	b := startBackbone(t)
	ctx := context.Background()
	port := freePort(t)
	kopts := []kfake.Opt{kfake.NumBrokers(1), kfake.Ports(port), kfake.DataDir(t.TempDir())}
	k, err := kfake.NewCluster(kopts...)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { k.Close() }()
	brokers := k.ListenAddrs()
	start := func() *exportProcess {
		exp, err := New(Config{Brokers: brokers, Routes: []Route{{"commits.>", "millrace.commits"}}, CreateTopics: true, Partitions: 3}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if err := exp.EnsureTopics(ctx); err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		p := &exportProcess{exp: exp, cancel: cancel, done: make(chan struct{})}
		r, err := streams.NewExportRunner(b.js, exp, streams.ExportConfig{Stream: subjects.StreamCommits, Filters: []string{"commits.>"},
			Durable: "export-commits", RetryMin: 50 * time.Millisecond, RetryMax: 500 * time.Millisecond}, nil)
		if err != nil {
			t.Fatal(err)
		}
		go func() {
			defer close(p.done)
			r.Run(rctx)
		}()
		return p
	}
	floor := func() uint64 {
		c, err := b.js.Consumer(ctx, subjects.StreamCommits, "export-commits")
		if err != nil {
			return 0
		}
		return c.CachedInfo().AckFloor.Stream
	}
	bk, err := bucket.Open(ctx, "mem://")
	if err != nil {
		t.Fatal(err)
	}
	defer bk.Close()
	comp := compactor.MustNew(compactor.Config{}, bk)
	versions := map[uint64]string{}
	put := func(round int) {
		for d := range 20 {
			body := fmt.Sprintf("doc %d round %d", d, round)
			ack, err := b.js.Publish(ctx, subjects.Commits("w", fmt.Sprint("doc-", d)), []byte(body))
			if err != nil {
				t.Fatal(err)
			}
			versions[ack.Sequence] = body
		}
	}

	p := start()
	put(0)
	poll.Until(t, "the first round exported", func() bool { return floor() >= 20 }, poll.Within(30*time.Second))
	k.Close() // Kafka away: the export falls behind
	put(1)
	time.Sleep(200 * time.Millisecond) // delivered to the exporter, stuck there
	p.stop()
	for round := 2; round <= 3; round++ {
		put(round)
		fs, err := commitlog.FoldWorld(ctx, b.js, comp, "w", commitlog.HoldFor("export-commits"))
		if err != nil {
			t.Fatal(err)
		}
		if fs.Withheld == 0 {
			t.Fatalf("pass %d deleted every folded version although the export stopped at %d", round, floor())
		}
	}
	if k, err = kfake.NewCluster(kopts...); err != nil {
		t.Fatal(err)
	}
	p = start()
	defer p.stop()
	poll.Until(t, "everything exported", func() bool { return floor() >= 80 }, poll.Within(60*time.Second))
	got := map[uint64]string{}
	for _, r := range readAll(t, brokers, "millrace.commits", len(versions), 30*time.Second) {
		seq, _ := strconv.ParseUint(header(r, HeaderSeq), 10, 64)
		got[seq] = string(r.Value)
	}
	for seq, body := range versions {
		if got[seq] != body {
			t.Fatalf("version %d: %q in Kafka, want %q (%d of %d versions exported)", seq, got[seq], body, len(got), len(versions))
		}
	}
	if _, err := commitlog.FoldWorld(ctx, b.js, comp, "w", commitlog.HoldFor("export-commits")); err != nil { // now it may drop the rest
		t.Fatal(err)
	}
	st, err := b.js.Stream(ctx, subjects.StreamCommits)
	if err != nil {
		t.Fatal(err)
	}
	if info, _ := st.Info(ctx); info.State.Msgs != 20 {
		t.Fatalf("%d messages left in COMMITS after the export caught up and a pass ran, want 20 (each document's last)", info.State.Msgs)
	}
}
