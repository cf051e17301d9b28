package streams

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

type seqRecorder struct{ seen []uint64 }

func (p *seqRecorder) Name() string { return "rec" }
func (p *seqRecorder) Apply(_ context.Context, _ pgx.Tx, batch []projection.Message) error {
	for _, m := range batch {
		p.seen = append(p.seen, m.Seq())
	}
	return nil
}

// Both guards of exactly-once effect, each on its own: the consumer starts
// right after the committed position, and a transaction skips messages at
// or below the position it reads under lock.
func TestRunnerGuards(t *testing.T) {
	ns := testenv.NATS(t)
	nc, err := Connect(ns.ClientURL(), t.Name())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx := context.Background()
	if err := Apply(ctx, js, StreamSpecs(Config{})); err != nil {
		t.Fatal(err)
	}
	pool, _ := testenv.Pool(t)
	if _, err := pool.Exec(ctx, "insert into consumer_positions (consumer, stream, stream_seq) values ('rec', 'BES', 3)"); err != nil {
		t.Fatal(err)
	}
	p := &seqRecorder{}
	r, err := NewRunner(js, pool, p, RunnerConfig{Stream: subjects.StreamBES, Filter: subjects.BESFilter, AckWait: time.Minute}, nil)
	if err != nil {
		t.Fatal(err)
	}
	h, err := r.lease.AcquirePG(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer r.loop.Release(h)
	if err := r.begin(ctx, h); err != nil {
		t.Fatal(err)
	}
	// The consumer's next delivery is sequence 4, right after the position.
	pub := NewPublisher(js, nil)
	for i := range 5 {
		msg := nats.NewMsg(subjects.BES("p", "inv"))
		msg.Header.Set(envelope.MsgID, fmt.Sprint(t.Name(), i))
		if err := pub.Publish(ctx, msg); err != nil {
			t.Fatal(err)
		}
	}
	b, err := r.cons.Fetch(1, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	got := 0
	for m := range b.Messages() {
		md, _ := m.Metadata()
		if md.Sequence.Stream != 4 {
			t.Fatalf("first delivery after position 3 is sequence %d, want 4", md.Sequence.Stream)
		}
		got++
	}
	if got != 1 {
		t.Fatalf("%d messages delivered, want sequence 4", got)
	}

	msgs := []*message{{seq: 2}, {seq: 3}, {seq: 4}, {seq: 5}}
	n, err := r.commit(ctx, msgs, 5)
	if err != nil {
		t.Fatal(err)
	}
	if n != 2 || len(p.seen) != 2 || p.seen[0] != 4 || p.seen[1] != 5 {
		t.Fatalf("applied %d: %v, want [4 5]", n, p.seen)
	}
	// Again, as after a redelivery: nothing is applied.
	p.seen = nil
	if n, err := r.commit(ctx, msgs, 5); err != nil || n != 0 || len(p.seen) != 0 {
		t.Fatalf("redelivered batch applied %d (%v), err %v", n, p.seen, err)
	}
	var pos int64
	pool.QueryRow(ctx, "select stream_seq from consumer_positions where consumer = 'rec'").Scan(&pos)
	if pos != 5 {
		t.Fatalf("position %d, want 5", pos)
	}
}
