package bes

import (
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"

	"github.com/millrace/millrace/internal/grpclimit"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/subjects"
)

func (e *edge) unauthenticatedStreams() int {
	e.srv.mu.Lock()
	defer e.srv.mu.Unlock()
	return e.srv.unauthenticated
}

// A stream that never sends its first request ends with DEADLINE_EXCEEDED
// after FirstMessageTimeout, and it holds no stream slot meanwhile.
func TestFirstMessageDeadline(t *testing.T) {
	_, e := newTest(t, Config{MaxStreams: 2, MaxStreamsPerProject: 2, FirstMessageTimeout: 300 * time.Millisecond})
	ctx := testCtx(t)
	silent, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the silent stream to be waiting", func() bool { return e.unauthenticatedStreams() == 1 })
	// Both slots are free for streams that say who they are.
	held, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	other := defaultIDs()
	other.invocation = "held"
	if err := held.Send(toolReq(other, 1)); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the held stream to be open", func() bool { return e.openStreams() == 1 })
	if r := publish(ctx, t, e.client, invocation(defaultIDs(), 1, 2, true)); r.err != nil {
		t.Fatalf("a complete invocation beside a silent stream: %v", r.err)
	}
	held.CloseSend()
	if r := readAcks(held); r.err != nil {
		t.Fatal(r.err)
	}
	_, err = silent.Recv()
	wantCode(t, err, codes.DeadlineExceeded, "no build event within")
	poll.Until(t, "the silent stream to be gone", func() bool { return e.unauthenticatedStreams() == 0 })
}

// Streams that have not said who they are count against MaxStreams on
// their own: they cannot pile up behind the deadline.
func TestUnauthenticatedStreamsCapped(t *testing.T) {
	_, e := newTest(t, Config{MaxStreams: 1, FirstMessageTimeout: time.Hour})
	ctx := testCtx(t)
	if _, err := e.client.PublishBuildToolEventStream(ctx); err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the silent stream to be waiting", func() bool { return e.unauthenticatedStreams() == 1 })
	second, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = second.Recv()
	wantCode(t, err, codes.ResourceExhausted, "waiting to send their first event")
}

// A wrong key in the headers is refused before the first request is read:
// the client hears UNAUTHENTICATED without sending anything.
func TestBadHeaderKeyRefusedBeforeFirstMessage(t *testing.T) {
	keys, err := ParseKeys("alpha=" + alphaKey)
	if err != nil {
		t.Fatal(err)
	}
	_, e := newTest(t, Config{Keys: keys, FirstMessageTimeout: time.Hour})
	ctx := metadata.AppendToOutgoingContext(testCtx(t), APIKeyHeader, "not-the-key-at-all-0000")
	st, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = st.Recv()
	wantCode(t, err, codes.Unauthenticated)
	if n := e.unauthenticatedStreams(); n != 0 {
		t.Fatalf("%d unauthenticated streams held", n)
	}
}

// A stream whose client stops sending is closed after IdleTimeout with
// DEADLINE_EXCEEDED, after every event it sent was acknowledged.
func TestIdleTimeout(t *testing.T) {
	b, e := newTest(t, Config{IdleTimeout: 300 * time.Millisecond})
	ctx := testCtx(t)
	id := defaultIDs()
	st, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, req := range invocation(id, 1, 3, false) {
		if err := st.Send(req); err != nil {
			t.Fatal(err)
		}
	}
	r := readAcks(st)
	wantCode(t, r.err, codes.DeadlineExceeded, "sent nothing for")
	checkAcks(t, id, r.acks, 1, 3)
	checkExactlyOnce(t, b, subjects.BES(testProject, testInvocation), 3)
	poll.Until(t, "the stream's slot to be released", func() bool { return e.openStreams() == 0 })
}

// The edge tells each client connection how many streams it may open at
// once (HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS): a client waits for a
// stream to end before opening more, and one that does not wait has its
// extra streams refused by the transport.
func TestMaxStreamsPerConnAdvertised(t *testing.T) {
	_, e := newTest(t, Config{MaxStreamsPerConn: 3})
	if got, err := grpclimit.ReadMaxStreams(e.addr); err != nil || got != 3 {
		t.Fatalf("SETTINGS_MAX_CONCURRENT_STREAMS = %d, %v; want 3", got, err)
	}
}

func TestCheckExposure(t *testing.T) {
	for _, c := range []struct {
		listen   string
		keys     int
		insecure bool
		ok       bool
	}{
		{"127.0.0.1:1985", 0, false, true},
		{"localhost:1985", 0, false, true},
		{"[::1]:1985", 0, false, true},
		{":1985", 0, false, false},
		{"0.0.0.0:1985", 0, false, false},
		{"10.1.2.3:1985", 0, false, false},
		{"[::]:1985", 0, false, false},
		{"ci.example.com:1985", 0, false, false},
		{":1985", 1, false, true},
		{":1985", 0, true, true},
	} {
		err := CheckExposure(c.listen, c.keys, c.insecure)
		if (err == nil) != c.ok {
			t.Errorf("CheckExposure(%q, %d keys, insecure %v) = %v, want ok %v", c.listen, c.keys, c.insecure, err, c.ok)
		}
		if err != nil && !errors.Is(err, ErrOpenWithoutKeys) {
			t.Errorf("error %v is not ErrOpenWithoutKeys", err)
		}
	}
}

// One client address cannot fill the edge's cap of streams waiting for
// their first request: past MaxPendingPerAddr its new streams are refused,
// and a stream with a valid key in its headers is not counted at all, so
// it gets through while the cap is full.
func TestPendingStreamsCappedPerAddress(t *testing.T) {
	keys, err := ParseKeys("alpha=" + alphaKey)
	if err != nil {
		t.Fatal(err)
	}
	_, e := newTest(t, Config{Keys: keys, MaxStreams: 10, MaxPendingPerAddr: 2, FirstMessageTimeout: time.Hour})
	ctx := testCtx(t)
	for i := 0; i < 2; i++ {
		if _, err := e.client.PublishBuildToolEventStream(ctx); err != nil {
			t.Fatal(err)
		}
	}
	poll.Until(t, "two silent streams waiting", func() bool { return e.unauthenticatedStreams() == 2 })
	third, err := e.client.PublishBuildToolEventStream(ctx)
	if err != nil {
		t.Fatal(err)
	}
	_, err = third.Recv()
	wantCode(t, err, codes.ResourceExhausted, "your address")

	// The same address with its key in the headers: authenticated before
	// its first request, so its build goes through.
	id := ids{build: "b-key", invocation: "inv-key", project: "alpha"}
	r := publish(metadata.AppendToOutgoingContext(ctx, APIKeyHeader, alphaKey), t, e.client, invocation(id, 1, 3, true))
	if r.err != nil {
		t.Fatalf("a stream with a valid header key: %v", r.err)
	}
	checkAcks(t, id, r.acks, 1, 4)
	if n := e.unauthenticatedStreams(); n != 2 {
		t.Fatalf("%d streams counted as waiting, want the 2 silent ones", n)
	}
}

func TestParseKeys(t *testing.T) {
	k, err := ParseKeys("# projects\nalpha=" + alphaKey + ", beta = beta-key-0123456789==\nalpha=alpha-second-key-0123")
	if err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{alphaKey: "alpha", "beta-key-0123456789==": "beta", "alpha-second-key-0123": "alpha"} {
		if p, ok := k.Project(key); !ok || p != want {
			t.Errorf("Project(%q) = %q, %v; want %q", key, p, ok, want)
		}
	}
	if _, ok := k.Project("nope-nope-nope-nope"); ok || k.Len() != 3 {
		t.Errorf("%d keys, or an unknown key accepted", k.Len())
	}
	// One key for two projects would belong to whichever came last.
	for _, bad := range []string{"alpha", "=" + alphaKey, "alpha=short", "alpha=" + alphaKey + "\nbeta=" + alphaKey} {
		if _, err := ParseKeys(bad); err == nil {
			t.Errorf("ParseKeys(%q) accepted", bad)
		} else if !strings.HasPrefix(err.Error(), "bes: ") {
			t.Errorf("ParseKeys(%q): %v, want the package's name in front", bad, err)
		}
	}
	var none Keys
	if _, ok := none.Project(alphaKey); ok || none.Len() != 0 {
		t.Error("zero keys")
	}
}
