package streams_test

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// TestCheckLayout: a backbone made with build events in four partitions
// takes processes of four partitions and refuses one of another count,
// or of the one stream, naming what it holds.
func TestCheckLayout(t *testing.T) {
	js := jsClient(t)
	ctx := context.Background()
	// An operator's stream named like one is none of millrace's.
	if _, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: "BES_MIRROR", Subjects: []string{"mirror.>"}}); err != nil {
		t.Fatal(err)
	}
	if err := streams.CheckLayout(ctx, js, subjects.BESLayout{Partitions: 7}); err != nil {
		t.Fatalf("a backbone without build events refused a layout: %v", err)
	}
	c := streams.Config{BESPartitions: 4}
	if err := streams.Apply(ctx, js, streams.StreamSpecs(c)); err != nil {
		t.Fatal(err)
	}
	if err := streams.CheckLayout(ctx, js, c.BESLayout()); err != nil {
		t.Fatalf("the layout the backbone was made with: %v", err)
	}
	for _, n := range []int{1, 2, 8} {
		err := streams.CheckLayout(ctx, js, subjects.BESLayout{Partitions: n})
		if err == nil || !strings.Contains(err.Error(), "4 partition streams (BES_0, BES_1, BES_2, BES_3)") {
			t.Errorf("%d partitions on a backbone of 4: %v", n, err)
		}
	}
	var names []string
	for _, s := range streams.StreamSpecs(c) {
		names = append(names, s.Name)
	}
	if !slices.Equal(names[:4], []string{"BES_0", "BES_1", "BES_2", "BES_3"}) || slices.Contains(names, subjects.StreamBES) {
		t.Errorf("the streams of 4 partitions: %v", names)
	}
}

// TestReaderKeptOffPartitionDurables: the embedded server's reader may
// not touch a partition's durable of a service consumer.
func TestReaderKeptOffPartitionDurables(t *testing.T) {
	p := streams.ReaderPermissions(streams.Config{BESPartitions: 3, ServiceConsumers: []string{"builds"}})
	for _, d := range []string{"builds", "builds_0", "builds_2"} {
		if !slices.Contains(p.Publish.Deny, "$JS.API.CONSUMER.MSG.NEXT.*."+d) {
			t.Errorf("the reader may fetch from %s", d)
		}
	}
	if !slices.Contains(p.Subscribe.Allow, "bes.2.>") {
		t.Errorf("the reader cannot read partition 2: %v", p.Subscribe.Allow)
	}
}
