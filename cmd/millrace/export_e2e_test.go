package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	"github.com/millrace/millrace/internal/testenv"
	commitspb "github.com/millrace/millrace/schemas/commits"
)

// TestKafkaExportInDev: with MILLRACE_KAFKA_BROKERS set, `millrace dev`
// exports the streams to Kafka (here a kfake cluster in the test process).
// Document versions written through the commits API arrive on
// millrace.commits keyed by subject, with their sequence, before and after
// the process is killed (SIGKILL) and started again; none is missing.
func TestKafkaExportInDev(t *testing.T) {
	k, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	dev := newDev(t, testenv.Database(t))
	dev.env = append(dev.env, "MILLRACE_KAFKA_BROKERS="+strings.Join(k.ListenAddrs(), ","), "MILLRACE_KAFKA_PARTITIONS=3")
	dev.start()
	keyFile := filepath.Join(dev.fleetDir, "commits-api-keys")
	waitUntil(t, "the development commits key", func() bool {
		b, err := os.ReadFile(keyFile)
		return err == nil && bytes.Contains(b, []byte("\n"))
	})
	b, _ := os.ReadFile(keyFile)
	_, key, _ := strings.Cut(strings.TrimSpace(string(b)), "=")
	conn, err := grpc.NewClient(dev.commitsAddr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	client := commitspb.NewCommitsClient(conn)
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+key)
	want := map[uint64]string{} // version -> body
	put := func(i int) {
		t.Helper()
		var r *commitspb.PutResponse
		waitUntil(t, "a put", func() bool {
			r, err = client.Put(ctx, &commitspb.PutRequest{World: "kafka", Id: fmt.Sprint("doc-", i%7), Body: []byte(fmt.Sprint("v", i))})
			return err == nil
		})
		want[r.Version] = fmt.Sprint("v", i)
	}
	for i := range 50 {
		put(i)
	}
	dev.kill()
	dev.start()
	for i := 50; i < 100; i++ {
		put(i)
	}

	cl, err := kgo.NewClient(kgo.SeedBrokers(k.ListenAddrs()...), kgo.ConsumeTopics("millrace.commits"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	got := map[uint64]string{}
	deadline := time.Now().Add(60 * time.Second)
	for len(got) < len(want) && time.Now().Before(deadline) {
		pctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		fs := cl.PollFetches(pctx)
		cancel()
		fs.EachRecord(func(r *kgo.Record) {
			var seq uint64
			for _, h := range r.Headers {
				if h.Key == "Millrace-Seq" {
					seq, _ = strconv.ParseUint(string(h.Value), 10, 64)
				}
			}
			if !strings.HasPrefix(string(r.Key), "commits.kafka.doc-") {
				t.Errorf("record key %q, want the document's subject", r.Key)
			}
			got[seq] = string(r.Value)
		})
	}
	for v, body := range want {
		if got[v] != body {
			t.Fatalf("version %d: %q in Kafka, want %q (%d of %d versions exported)\n%s", v, got[v], body, len(got), len(want), dev.output())
		}
	}
}
