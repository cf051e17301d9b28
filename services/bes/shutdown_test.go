package bes

import (
	"testing"
	"time"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/subjects"
)

// Graceful shutdown stops accepting new streams but lets an open one finish:
// every event it sent is stored and acknowledged before the server returns.
func TestGracefulStopDrainsOpenStream(t *testing.T) {
	b, e := newTest(t, Config{})
	id := defaultIDs()
	ctx := testCtx(t)
	st, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	reqs := invocation(id, 1, 300, true)
	for _, r := range reqs[:150] {
		if err := st.Send(r); err != nil {
			t.Fatal(err)
		}
	}
	poll.Until(t, "the stream is open", func() bool { return e.openStreams() == 1 })

	stopped := make(chan struct{})
	go func() { e.g.GracefulStop(); close(stopped) }()
	// GracefulStop waits for the open stream.
	time.Sleep(50 * time.Millisecond)
	select {
	case <-stopped:
		t.Fatal("GracefulStop returned while a stream was open")
	default:
	}
	for _, r := range reqs[150:] {
		if err := st.Send(r); err != nil {
			t.Fatal(err)
		}
	}
	st.CloseSend()
	res := readAcks(st)
	if res.err != nil {
		t.Fatalf("stream ended with %v during graceful stop", res.err)
	}
	checkAcks(t, id, res.acks, 1, 301)
	<-stopped
	checkExactlyOnce(t, b, subjects.BES(id.project, id.invocation), 301)
}
