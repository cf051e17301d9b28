package kafka

import (
	"context"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"

	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The default routes take every stream, each to a topic of its own; a
// route no single stream holds is refused, naming the streams.
func TestByStream(t *testing.T) {
	routes, err := ParseRoutes(DefaultRoutes)
	if err != nil {
		t.Fatal(err)
	}
	filters, err := ByStream(routes, streams.StreamOf, streams.Names())
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for stream := range filters {
		got = append(got, stream)
	}
	slices.Sort(got)
	for _, s := range streams.StreamSpecs(streams.Config{}) {
		if _, ok := filters[s.Name]; !ok && s.Name != "DEAD" {
			t.Errorf("the default routes export nothing of %s (they export %v)", s.Name, got)
		}
	}
	two, _ := ParseRoutes("bes.a.> -> t1, bes.b.> -> t2")
	if f, err := ByStream(two, streams.StreamOf, streams.Names()); err != nil || len(f) != 1 || len(f[subjects.StreamBES]) != 2 {
		t.Fatalf("two routes of one stream: %v, %v", f, err)
	}
	wide, _ := ParseRoutes("> -> everything")
	if _, err := ByStream(wide, streams.StreamOf, streams.Names()); err == nil || !strings.Contains(err.Error(), "no millrace stream holds") || !strings.Contains(err.Error(), subjects.StreamBES) {
		t.Fatalf("a route spanning streams: %v", err)
	}
	if !Reads(routes, subjects.StreamCommits, streams.StreamOf) || Reads(two, subjects.StreamCommits, streams.StreamOf) {
		t.Fatal("Reads: the default routes read COMMITS, two BES routes do not")
	}
	if Durable("FLEET_NODES") != "export-kafka-fleet_nodes" {
		t.Fatalf("durable %q", Durable("FLEET_NODES"))
	}
}

// WaitTopics waits while a topic is missing (creation off) and returns
// once it is there; it gives up when its context ends.
func TestWaitTopics(t *testing.T) {
	c := cluster(t)
	e, err := New(Config{Brokers: c.ListenAddrs(), Routes: []Route{{"a.>", "late"}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	if err := e.WaitTopics(ctx); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WaitTopics with the topic missing: %v, want the context's end", err)
	}
	done := make(chan error, 1)
	go func() { done <- e.WaitTopics(context.Background()) }()
	if _, err := kadm.NewClient(e.Client()).CreateTopic(context.Background(), 1, 1, nil, "late"); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("WaitTopics did not return once the topic was created")
	}
}
