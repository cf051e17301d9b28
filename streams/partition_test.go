package streams_test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/subjects"
)

// TestPartitionMatchesServer: subjects.BESPartition computes the partition
// the server's own subject mapping puts a build in, so that a process and
// the server agree where each build lives, for projects and invocations
// whose tokens are escaped too.
func TestPartitionMatchesServer(t *testing.T) {
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
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, n := range []int{2, 4, 16} {
		name := fmt.Sprintf("PARTS%d", n)
		st, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: name, Subjects: []string{"bes.*.*"},
			SubjectTransform: &jetstream.SubjectTransformConfig{Source: "bes.*.*", Destination: subjects.BESPartitionMapping(n)}})
		if err != nil {
			t.Fatal(err)
		}
		seen := map[int]int{}
		for i := range 400 {
			project, inv := fmt.Sprintf("team %d", i%5), fmt.Sprintf("%08x-inv.%d", i*7919, i)
			ack, err := js.Publish(ctx, subjects.BES(project, inv), nil)
			if err != nil {
				t.Fatal(err)
			}
			m, err := st.GetMsg(ctx, ack.Sequence)
			if err != nil {
				t.Fatal(err)
			}
			want := subjects.BESPartition(n, project, inv)
			parts := strings.SplitN(m.Subject, ".", 3)
			if got := parts[1]; got != fmt.Sprint(want) {
				t.Fatalf("n=%d: %s stored as %s, BESPartition says %d", n, subjects.BES(project, inv), m.Subject, want)
			}
			seen[want]++
		}
		if len(seen) != n {
			t.Errorf("n=%d: 400 builds fell in %d partitions", n, len(seen))
		}
		js.DeleteStream(ctx, name)
	}
}
