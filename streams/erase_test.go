package streams_test

import (
	"bytes"
	"context"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// EraseSubjects erases one project's messages, bytes and all (the store's
// files no longer hold them although their block holds other projects'),
// and leaves the others; Describe shows the streams and consumers.
func TestEraseSubjectsAndDescribe(t *testing.T) {
	ns := testenv.NATS(t)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	for _, subj := range []string{subjects.BES("alpha", "i1"), subjects.BES("alpha", "i1"), subjects.BES("alpha", "i2"),
		subjects.BES("alpha-2", "i3"), subjects.BES("beta", "i1")} {
		if _, err := js.Publish(ctx, subj, []byte("SECRET["+subj+"]")); err != nil {
			t.Fatal(err)
		}
	}
	s, err := js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	count := func(project string) (uint64, int) {
		n, subj, err := streams.CountSubjects(ctx, s, subjects.BESProjectFilter(project))
		if err != nil {
			t.Fatal(err)
		}
		return n, subj
	}
	if n, invocations := count("alpha"); n != 3 || invocations != 2 {
		t.Fatalf("alpha: %d messages on %d subjects, want 3 on 2", n, invocations)
	}
	erased, err := streams.EraseSubjects(ctx, s, subjects.BESProjectFilter("alpha"), nil)
	if err != nil || erased != 3 {
		t.Fatalf("erased %d, %v", erased, err)
	}
	if n, _ := count("alpha"); n != 0 {
		t.Fatalf("alpha keeps %d messages", n)
	}
	if a2, _ := count("alpha-2"); a2 != 1 {
		t.Fatalf("alpha-2 lost its message")
	}
	filepath.WalkDir(ns.JetStreamConfig().StoreDir, func(p string, d fs.DirEntry, err error) error {
		if err == nil && !d.IsDir() {
			if b, _ := os.ReadFile(p); bytes.Contains(b, []byte("SECRET[bes.alpha.")) {
				t.Errorf("%s still holds alpha's erased bytes", p)
			}
		}
		return nil
	})

	if _, err := js.CreateOrUpdateConsumer(ctx, subjects.StreamBES, jetstream.ConsumerConfig{Durable: "reader", AckPolicy: jetstream.AckExplicitPolicy}); err != nil {
		t.Fatal(err)
	}
	info, err := streams.Describe(ctx, js, streams.StreamSpecs(streams.Config{}))
	if err != nil {
		t.Fatal(err)
	}
	i := slices.IndexFunc(info, func(si streams.StreamInfo) bool { return si.Name == subjects.StreamBES })
	if i < 0 || info[i].Messages != 2 || info[i].LastSeq != 5 {
		t.Fatalf("BES: %+v", info)
	}
	j := slices.IndexFunc(info[i].Consumers, func(c streams.ConsumerInfo) bool { return c.Name == "reader" })
	if j < 0 || info[i].Consumers[j].Pending != 2 {
		t.Fatalf("BES consumers: %+v", info[i].Consumers)
	}
	var out strings.Builder
	if err := streams.WriteInfo(&out, info[i:i+1]); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "BES    [bes.>]  messages=2") || !strings.Contains(out.String(), "  consumer reader       pending=2 ack_pending=0") {
		t.Fatalf("written:\n%s", out.String())
	}
}
