package streams

import (
	"context"
	"errors"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/subjects"
)

// deleteSeqs speaks the deletion API by hand: a deleted message is gone,
// and deleting one already gone, or never there, is not an error.
func TestDeleteSeqs(t *testing.T) {
	ns := testenv.NATS(t)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	if err := Apply(ctx, js, StreamSpecs(Config{})); err != nil {
		t.Fatal(err)
	}
	var seqs []uint64
	for i := range 5 {
		ack, err := js.Publish(ctx, subjects.Commits("w", string(rune('a'+i))), []byte("x"))
		if err != nil {
			t.Fatal(err)
		}
		seqs = append(seqs, ack.Sequence)
	}
	if err := deleteSeqs(ctx, js, seqs[:3]); err != nil {
		t.Fatal(err)
	}
	if err := deleteSeqs(ctx, js, []uint64{seqs[1], seqs[2], seqs[4] + 100}); err != nil {
		t.Fatalf("deleting messages already gone: %v", err)
	}
	st, _ := js.Stream(ctx, subjects.StreamCommits)
	for i, seq := range seqs {
		_, err := st.GetMsg(ctx, seq)
		if gone := errors.Is(err, jetstream.ErrMsgNotFound); gone != (i < 3) {
			t.Fatalf("message %d: gone %v (%v), want %v", seq, gone, err, i < 3)
		}
	}
	if err := deleteAnswer([]byte(`{"error":{"code":500,"err_code":10057,"description":"message delete not permitted"}}`)); err == nil {
		t.Fatal("a refused deletion was taken for done")
	}
}
