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

// oneStream is streams.StreamsOf of the one-stream layout.
func oneStream(f string) (map[string]string, bool) { return streams.StreamsOf(subjects.BESLayout{}, f) }

// The default routes take every stream, each to a topic of its own; a
// route no single stream holds is refused, naming the streams.
func TestByStream(t *testing.T) {
	routes, err := ParseRoutes(DefaultRoutes)
	if err != nil {
		t.Fatal(err)
	}
	filters, err := ByStream(routes, oneStream, streams.Names())
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
	if f, err := ByStream(two, oneStream, streams.Names()); err != nil || len(f) != 1 || len(f[subjects.StreamBES]) != 2 {
		t.Fatalf("two routes of one stream: %v, %v", f, err)
	}
	wide, _ := ParseRoutes("> -> everything")
	if _, err := ByStream(wide, oneStream, streams.Names()); err == nil || !strings.Contains(err.Error(), "no millrace stream holds") || !strings.Contains(err.Error(), subjects.StreamBES) {
		t.Fatalf("a route spanning streams: %v", err)
	}
	if !Reads(routes, subjects.StreamCommits, streams.StreamOf) || Reads(two, subjects.StreamCommits, streams.StreamOf) {
		t.Fatal("Reads: the default routes read COMMITS, two BES routes do not")
	}
	// Partitioned build events: a route of them reads each partition's
	// stream, its filter narrowed to it, and a project's route too.
	l := subjects.BESLayout{Partitions: 3}
	inParts := func(f string) (map[string]string, bool) { return streams.StreamsOf(l, f) }
	f, err := ByStream(routes, inParts, streams.NamesIn(l))
	if err != nil {
		t.Fatal(err)
	}
	for p := range 3 {
		if got := f[l.Stream(p)]; !slices.Equal(got, []string{l.Filter(p)}) {
			t.Errorf("partition %d's stream exports %v, want [%s]", p, got, l.Filter(p))
		}
	}
	if _, ok := f[subjects.StreamBES]; ok {
		t.Errorf("a partitioned layout exports the one stream BES")
	}
	proj, _ := ParseRoutes("bes.*.acme.> -> acme")
	if f, err := ByStream(proj, inParts, streams.NamesIn(l)); err != nil || len(f) != 3 || !slices.Equal(f["BES_1"], []string{"bes.1.acme.>"}) {
		t.Errorf("a project's route over partitions: %v, %v", f, err)
	}
	// The export's durable of a partition is its one-stream durable's
	// partition durable, which the embedded server keeps its reader off.
	if Durable(l.Stream(2)) != l.Durable(Durable(subjects.StreamBES), 2) {
		t.Errorf("partition durable %q, want %q", Durable(l.Stream(2)), l.Durable(Durable(subjects.StreamBES), 2))
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
