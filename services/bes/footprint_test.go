package bes

import (
	"fmt"
	"runtime"
	"testing"
)

// An open stream costs the edge its handler's goroutine and its
// receiver's, and nothing per stream beyond them: the edge holds thousands
// of mostly idle Bazel streams, and each goroutine is a stack. (The handler
// acks; a goroutine of its own for acking was a third.) The client's side,
// in this process too, holds one goroutine per stream.
func TestAnOpenStreamHoldsTwoGoroutines(t *testing.T) {
	_, e := newTest(t, Config{})
	ctx := testCtx(t)
	const n = 40
	// Warm the connection up first: its own goroutines (reader, writer,
	// keepalive) do not count.
	warm, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	id := ids{build: "warm", invocation: "warm-0", project: testProject}
	if err := warm.Send(toolReq(id, 1)); err != nil {
		t.Fatal(err)
	}
	if _, err := warm.Recv(); err != nil {
		t.Fatal(err)
	}
	before := runtime.NumGoroutine()
	for i := range n {
		st, err := e.client.PublishBuildToolEventStream(ctx)
		if err != nil {
			t.Fatal(err)
		}
		id := ids{build: "b", invocation: fmt.Sprintf("inv-%d", i), project: testProject}
		if err := st.Send(toolReq(id, 1)); err != nil {
			t.Fatal(err)
		}
		if ack, err := st.Recv(); err != nil || ack.GetSequenceNumber() != 1 {
			t.Fatalf("stream %d: ack %v, %v", i, ack, err)
		}
	}
	// Goroutines that end (a stream's first-request reader) may still be
	// on their way out: allow a little.
	per := float64(runtime.NumGoroutine()-before) / n
	if per > 3.1 {
		t.Fatalf("%d open streams hold %.2f goroutines each (edge and client in this process); want 3: the edge's handler and receiver, the client's stream", n, per)
	}
}
