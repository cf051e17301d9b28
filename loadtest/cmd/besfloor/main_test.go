package main

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/loadtest/besrecord"
	"github.com/millrace/millrace/loadtest/replay"
)

// The floor must acknowledge every event of a real build, or the bench's
// figures for it would be those of a server that drops work.
func TestFloorAcksEveryEventOfARecordedBuild(t *testing.T) {
	recs, err := besrecord.Read(filepath.Join("..", "..", "fixtures", "bazel-test-60.besrec"))
	if err != nil {
		t.Fatal(err)
	}
	scripts, _ := replay.Scripts(recs)
	if len(scripts) == 0 {
		t.Fatal("no complete build in the fixture")
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serve(ctx, lis, hl) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	}()

	rctx, rcancel := context.WithTimeout(ctx, 2*time.Minute)
	defer rcancel()
	res, err := replay.Run(rctx, replay.Config{Target: lis.Addr().String(), Scripts: scripts[:1], Streams: 4, Events: int64(4 * scripts[0].Events())})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Errors) > 0 {
		t.Fatalf("errors %v: %v", res.Errors, res.ErrorSamples)
	}
	if want := int64(4 * scripts[0].Events()); res.ToolEvents+res.LifecycleEvents < want {
		t.Fatalf("%d tool and %d lifecycle events acknowledged, want at least %d", res.ToolEvents, res.LifecycleEvents, want)
	}

	// The bench reads the open streams and the runtime's memory from
	// /metrics, by the edge's names.
	resp, err := http.Get("http://" + hl.Addr().String() + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	for _, name := range []string{"millrace_bes_streams_open 0", fmt.Sprintf("millrace_bes_events_total %d", res.ToolEvents), "go_goroutines", "go_memstats_heap_inuse_bytes", "go_memstats_stack_inuse_bytes"} {
		if !strings.Contains(string(b), name) {
			t.Errorf("/metrics lacks %q", name)
		}
	}
}
