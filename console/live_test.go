package console

import (
	"bufio"
	"context"
	"encoding/json"
	"encoding/xml"
	"fmt"
	"io"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/schemas/bep"
	"github.com/millrace/millrace/subjects"
)

// fakeStream is a subject of the BES stream for the live pages: messages
// appended with their sequences, followed as streams.SubjectReader does.
type fakeStream struct {
	mu      sync.Mutex
	msgs    map[string][]fakeMsg
	grew    chan struct{} // closed and replaced on each append
	follows []string      // "subject after", one for each Follow
	open    int           // follows running
}

type fakeMsg struct {
	seq  uint64
	data []byte
}

func newFakeStream() *fakeStream {
	return &fakeStream{msgs: map[string][]fakeMsg{}, grew: make(chan struct{})}
}

func (f *fakeStream) add(subject string, seq uint64, data []byte) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.msgs[subject] = append(f.msgs[subject], fakeMsg{seq, data})
	close(f.grew)
	f.grew = make(chan struct{})
}

func (f *fakeStream) Follow(ctx context.Context, project, invocation string, after uint64, fn func(uint64, []byte) error) error {
	subject := subjects.BES(project, invocation)
	f.mu.Lock()
	f.follows = append(f.follows, fmt.Sprint(subject, " ", after))
	f.open++
	f.mu.Unlock()
	defer func() {
		f.mu.Lock()
		f.open--
		f.mu.Unlock()
	}()
	for {
		f.mu.Lock()
		var next []fakeMsg
		for _, m := range f.msgs[subject] {
			if m.seq > after {
				next = append(next, m)
			}
		}
		grew := f.grew
		f.mu.Unlock()
		for _, m := range next {
			if err := fn(m.seq, m.data); err != nil {
				return err
			}
			after = m.seq
		}
		select {
		case <-grew:
		case <-ctx.Done():
			return nil
		}
	}
}

func (f *fakeStream) openFollows() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.open
}

// bazelEvent is a BES message as the edge stores it.
func bazelEvent(t *testing.T, be *bep.BuildEvent) []byte {
	value, err := proto.Marshal(be)
	if err != nil {
		t.Fatal(err)
	}
	return obeOf(t, value)
}

func obeOf(t *testing.T, value []byte) []byte {
	b, err := proto.Marshal(&buildpb.OrderedBuildEvent{Event: &buildpb.BuildEvent{
		Event: &buildpb.BuildEvent_BazelEvent{BazelEvent: &anypb.Any{TypeUrl: bep.TypeURL, Value: value}}}})
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// sse reads server-sent events from one connection.
type sse struct {
	resp *http.Response
	r    *bufio.Reader
}

type sseEvent struct {
	ID, Name string
	Data     map[string]string
}

func openEvents(t *testing.T, url, lastID string) (*sse, int) {
	t.Helper()
	req, _ := http.NewRequest("GET", url, nil)
	req.Header.Set("Accept", "text/event-stream")
	if lastID != "" {
		req.Header.Set("Last-Event-ID", lastID)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return &sse{resp: resp, r: bufio.NewReader(resp.Body)}, resp.StatusCode
}

// next is the next event, comments skipped.
func (s *sse) next(t *testing.T) sseEvent {
	t.Helper()
	var ev sseEvent
	for {
		line, err := s.r.ReadString('\n')
		if err != nil {
			t.Fatalf("the events ended (%v) after %+v", err, ev)
		}
		line = strings.TrimSuffix(line, "\n")
		switch {
		case line == "" && ev.Name != "":
			return ev
		case strings.HasPrefix(line, "id: "):
			ev.ID = line[4:]
		case strings.HasPrefix(line, "event: "):
			ev.Name = line[7:]
		case strings.HasPrefix(line, "data: "):
			if err := json.Unmarshal([]byte(line[6:]), &ev.Data); err != nil {
				t.Fatalf("data %q: %v", line, err)
			}
		}
	}
}

// A running build's page names where its events start, the projector's
// position read with it; the events turn Bazel's messages into rows and
// output from there, resume after the last id a browser saw, end when the
// projection says the build ended, and hold a follow only while open.
func TestConsoleLiveBuild(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	for _, sql := range []string{
		`insert into invocations (id, project, status, command, patterns, started_at, first_event_at, last_event_at)
		 values ('run-1', 'acme', 'running', 'test', '{//...}', now(), now(), now()),
		        ('done-1', 'acme', 'succeeded', 'build', '{//...}', now(), now(), now())`,
		`select build_partitions_for(((build_key >> 47) / 7)::int4) from invocations`,
		`insert into consumer_positions (consumer, stream, stream_seq) values ('` + builds.ConsumerName + `', 'BES', 41)`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	fs := newFakeStream()
	subj := subjects.BES("acme", "run-1")
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }, Live: fs, MaxLive: 2})
	base := serveURL(t, mux)
	get := pageGetter(t, mux)

	code, _, page := get("/builds/acme/run-1")
	if code != http.StatusOK || !strings.Contains(page, `data-events="/builds/acme/run-1/events" data-after="41"`) ||
		!strings.Contains(page, `src="/static/live.js"`) || !strings.Contains(page, "Running") {
		t.Fatalf("the running build's page: %d\n%s", code, page)
	}
	if _, _, page := get("/builds/acme/done-1"); strings.Contains(page, "live.js") || strings.Contains(page, `id="live"`) {
		t.Error("a finished build's page is live")
	}

	// Messages before the page's position are not sent again.
	fs.add(subj, 40, bazelEvent(t, &bep.BuildEvent{Payload: &bep.BuildEvent_Progress{Progress: &bep.Progress{Stderr: "already shown\n"}}}))
	events := []*bep.BuildEvent{
		{Payload: &bep.BuildEvent_Progress{Progress: &bep.Progress{Stderr: "\x1b[32mINFO:\x1b[0m <analysed>\n"}}},
		{Id: &bep.BuildEventId{Id: &bep.BuildEventId_TargetConfigured{TargetConfigured: &bep.BuildEventId_TargetConfiguredId{Label: "//a:lib"}}},
			Payload: &bep.BuildEvent_Configured{Configured: &bep.TargetConfigured{TargetKind: "cc_library rule"}}},
		{Id: &bep.BuildEventId{Id: &bep.BuildEventId_TargetCompleted{TargetCompleted: &bep.BuildEventId_TargetCompletedId{Label: "//a:lib"}}},
			Payload: &bep.BuildEvent_Completed{Completed: &bep.TargetComplete{Success: false}}},
		{Id: &bep.BuildEventId{Id: &bep.BuildEventId_TestResult{TestResult: &bep.BuildEventId_TestResultId{Label: "//a:t", Attempt: 1, Run: 1, Shard: 1}}},
			Payload: &bep.BuildEvent_TestResult{TestResult: &bep.TestResult{Status: bep.TestStatus_FAILED, TestAttemptDurationMillis: 300}}},
		{Id: &bep.BuildEventId{Id: &bep.BuildEventId_TestResult{TestResult: &bep.BuildEventId_TestResultId{Label: "//a:t", Attempt: 2, Run: 1, Shard: 1}}},
			Payload: &bep.BuildEvent_TestResult{TestResult: &bep.TestResult{Status: bep.TestStatus_PASSED, TestAttemptDurationMillis: 200}}},
		{Id: &bep.BuildEventId{Id: &bep.BuildEventId_TestSummary{TestSummary: &bep.BuildEventId_TestSummaryId{Label: "//a:t"}}},
			Payload: &bep.BuildEvent_TestSummary{TestSummary: &bep.TestSummary{OverallStatus: bep.TestStatus_FLAKY, TotalRunCount: 2, ShardCount: 1, TotalRunDurationMillis: 500}}},
		{Payload: &bep.BuildEvent_Finished{Finished: &bep.BuildFinished{ExitCode: &bep.BuildFinished_ExitCode{Name: "BUILD_FAILURE", Code: 1}}}},
	}
	for i, be := range events {
		fs.add(subj, uint64(42+i), bazelEvent(t, be))
	}
	// Another build's subject is not this page's.
	fs.add(subjects.BES("acme", "other"), 43, bazelEvent(t, events[0]))

	es, code := openEvents(t, base+"/builds/acme/run-1/events?after=41", "")
	if code != http.StatusOK || es.resp.Header.Get("Content-Type") != "text/event-stream" {
		t.Fatalf("the events: %d %s", code, es.resp.Header.Get("Content-Type"))
	}
	ev := es.next(t)
	if ev.ID != "42" || ev.Name != "output" || ev.Data["stream"] != "stderr" ||
		ev.Data["html"] != `<span class="a-f2">INFO:</span> &lt;analysed&gt;`+"\n" {
		t.Fatalf("first event: %+v", ev)
	}
	ev = es.next(t) // the configured event shows nothing; the target's completion does
	if ev.ID != "44" || ev.Name != "target" || ev.Data["label"] != "//a:lib" || ev.Data["success"] != "false" ||
		!strings.Contains(ev.Data["html"], `<tr data-label="//a:lib">`) || !strings.Contains(ev.Data["html"], "cc_library rule") ||
		!strings.Contains(ev.Data["html"], `class="failed"`) {
		t.Fatalf("the target: %+v", ev)
	}
	for _, want := range []struct{ id, status, attempts string }{{"45", "FAILED", "<td>1</td>"}, {"46", "PASSED", "<td>2</td>"}, {"47", "FLAKY", "<td>2</td>"}} {
		ev = es.next(t)
		if ev.ID != want.id || ev.Name != "test" || ev.Data["status"] != want.status ||
			!strings.Contains(ev.Data["html"], `href="/test?label=%2F%2Fa%3At&amp;project=acme"`) || !strings.Contains(ev.Data["html"], want.attempts) {
			t.Fatalf("the test, want %+v: %+v", want, ev)
		}
	}
	if !strings.Contains(ev.Data["html"], "500 ms") {
		t.Errorf("the summary's duration: %s", ev.Data["html"])
	}
	ev = es.next(t)
	if ev.ID != "48" || ev.Name != "status" || ev.Data["status"] != "failed" || !strings.Contains(ev.Data["state"], "BUILD_FAILURE (exit code 1)") {
		t.Fatalf("the finish: %+v", ev)
	}

	// The summary's counts follow the projection after target and test
	// events: the projector stores what the page was told of.
	for _, sql := range []string{
		`insert into build_labels (project, id, label) values ('acme', build_label_id('//a:lib'), '//a:lib'), ('acme', build_label_id('//a:t'), '//a:t')`,
		`insert into targets (build_key, label_id, success, failed) select build_key, build_label_id('//a:lib'), false, true from invocations where id = 'run-1'`,
		`insert into tests (build_key, label_id, status, attempts, shard_count, duration_ms, has_summary)
		 select build_key, build_label_id('//a:t'), 'FLAKY', 2, 1, 500, true from invocations where id = 'run-1'`,
	} {
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	for ev = es.next(t); ev.Name == "counts" && !strings.Contains(ev.Data["targets"], "1 failed"); ev = es.next(t) {
	}
	if ev.Name != "counts" || ev.Data["targets"] != `<span class="failed">1 failed</span>` || ev.Data["tests"] != `0 passed, <span class="flaky">1 flaky</span>` {
		t.Fatalf("the counts once projected: %+v", ev)
	}

	// A browser that lost the connection reconnects from its last id,
	// whatever its address says; one more than MaxLive is refused.
	es2, code := openEvents(t, base+"/builds/acme/run-1/events?after=41", "46")
	if code != http.StatusOK {
		t.Fatalf("reconnecting: %d", code)
	}
	if ev := es2.next(t); ev.ID != "47" || ev.Name != "test" {
		t.Fatalf("after Last-Event-ID 46: %+v", ev)
	}
	if _, code := openEvents(t, base+"/builds/acme/run-1/events", ""); code != http.StatusServiceUnavailable {
		t.Errorf("a third live page with MaxLive 2: %d", code)
	}
	if _, code := openEvents(t, base+"/builds/acme/run-1/events?after=x", ""); code != http.StatusBadRequest {
		t.Errorf("after=x: %d", code)
	}
	if _, code := openEvents(t, base+"/builds/other/run-1/events", ""); code != http.StatusNotFound {
		t.Errorf("another project's address: %d", code)
	}

	// Output arriving while the page is open comes as it arrives.
	fs.add(subj, 60, bazelEvent(t, &bep.BuildEvent{Payload: &bep.BuildEvent_Progress{Progress: &bep.Progress{Stdout: "late\n"}}}))
	if ev := es.next(t); ev.ID != "60" || ev.Data["stream"] != "stdout" || ev.Data["html"] != "late\n" {
		t.Fatalf("a later message: %+v", ev)
	}

	// Once the projection has the build as ended, the events end.
	if _, err := pool.Exec(ctx, `update invocations set status = 'failed' where id = 'run-1'`); err != nil {
		t.Fatal(err)
	}
	if ev := es.next(t); ev.Name != "end" || ev.Data["status"] != "failed" || ev.ID != "60" {
		t.Fatalf("the end: %+v", ev)
	}
	es.resp.Body.Close()
	es2.resp.Body.Close()
	if ev := func() sseEvent { es, _ := openEvents(t, base+"/builds/acme/done-1/events", ""); return es.next(t) }(); ev.Name != "end" || ev.Data["status"] != "succeeded" {
		t.Errorf("a finished build's events: %+v", ev)
	}
	poll.Until(t, "no follow left once the pages closed", func() bool { return fs.openFollows() == 0 })
	fs.mu.Lock()
	defer fs.mu.Unlock()
	if got := strings.Join(fs.follows, ","); got != subj+" 41,"+subj+" 46" {
		t.Errorf("follows %s", got)
	}
}

// Output that is not UTF-8, as tools print it, is shown rather than
// dropped (the protobuf runtime refuses such a string).
func TestLiveOutputNotUTF8(t *testing.T) {
	// BuildEvent{progress (3): Progress{stderr (2): "a\xffb"}}
	value := []byte{3<<3 | 2, 5, 2<<3 | 2, 3, 'a', 0xff, 'b'}
	lb := liveBuild{kinds: map[string]string{}, tests: map[string]*builds.Test{}}
	evs := lb.apply(obeOf(t, value))
	if len(evs) != 1 || evs[0].name != "output" || !strings.HasPrefix(evs[0].data["html"], "a") || !strings.HasSuffix(evs[0].data["html"], "b") {
		t.Fatalf("got %+v", evs)
	}
}

// FuzzLiveApply: whatever a stream message holds, turning it into a
// page's events does not panic, and what it renders is well-formed.
func FuzzLiveApply(f *testing.F) {
	for _, be := range []*bep.BuildEvent{
		{Payload: &bep.BuildEvent_Progress{Progress: &bep.Progress{Stderr: "\x1b[31mred\n"}}},
		{Id: &bep.BuildEventId{Id: &bep.BuildEventId_TestSummary{TestSummary: &bep.BuildEventId_TestSummaryId{Label: "//a:t"}}},
			Payload: &bep.BuildEvent_TestSummary{TestSummary: &bep.TestSummary{OverallStatus: bep.TestStatus_FLAKY}}},
	} {
		value, _ := proto.Marshal(be)
		f.Add(value)
	}
	f.Fuzz(func(t *testing.T, value []byte) {
		lb := liveBuild{project: "p", kinds: map[string]string{}, tests: map[string]*builds.Test{}}
		for _, ev := range lb.apply(obeOf(t, value)) {
			if err := wellFormed(ev.data["html"]); err != nil {
				t.Fatalf("%s event: %v: %q", ev.name, err, ev.data["html"])
			}
		}
	})
}

// wellFormed checks that s is balanced markup with no stray text markup.
func wellFormed(s string) error {
	d := xml.NewDecoder(strings.NewReader("<x>" + s + "</x>"))
	d.Strict = true
	d.Entity = xml.HTMLEntity
	for {
		if _, err := d.Token(); err == io.EOF {
			return nil
		} else if err != nil {
			return err
		}
	}
}

// The list's first page, live: every row at first, then what changes
// once the projector's position moves (a new build first, a build that
// ended), and a row that no longer matches the filters leaves.
func TestConsoleLiveList(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	exec := func(sql string) {
		t.Helper()
		if _, err := pool.Exec(ctx, sql); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(`insert into invocations (id, project, status, command, started_at, first_event_at, last_event_at)
	      values ('b1', 'acme', 'running', 'build', now() - interval '2 minutes', now(), now()),
	             ('b2', 'acme', 'running', 'test', now() - interval '1 minute', now(), now()),
	             ('x1', 'other', 'running', 'test', now(), now(), now())`)
	exec(`insert into consumer_positions (consumer, stream, stream_seq) values ('` + builds.ConsumerName + `', 'BES', 1)`)
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }})
	base := serveURL(t, mux)
	get := pageGetter(t, mux)
	if _, _, page := get("/?project=acme&status=running"); !strings.Contains(page, `data-events="/events/builds?project=acme&amp;status=running" data-limit="50"`) {
		t.Fatalf("the list's first page is not live:\n%s", page)
	}
	if _, _, page := get("/?project=acme&before=x"); strings.Contains(page, `id="live-list"`) {
		t.Error("a later page of the list is live")
	}
	if _, code := openEvents(t, base+"/events/builds?before=x", ""); code != http.StatusBadRequest {
		t.Errorf("a later page's events: %d", code)
	}

	es, code := openEvents(t, base+"/events/builds?project=acme&status=running", "")
	if code != http.StatusOK {
		t.Fatalf("the list's events: %d", code)
	}
	for _, want := range []struct{ key, index string }{{"acme/b2", "0"}, {"acme/b1", "1"}} {
		if ev := es.next(t); ev.Name != "build" || ev.Data["key"] != want.key || ev.Data["index"] != want.index ||
			!strings.Contains(ev.Data["html"], `<tr data-key="`+want.key+`" data-status="running">`) {
			t.Fatalf("want %v: %+v", want, ev)
		}
	}
	exec(`insert into invocations (id, project, status, command, started_at, first_event_at, last_event_at)
	      values ('b3', 'acme', 'running', 'build', now(), now(), now())`)
	exec(`update consumer_positions set stream_seq = 2`)
	if ev := es.next(t); ev.Name != "build" || ev.Data["key"] != "acme/b3" || ev.Data["index"] != "0" {
		t.Fatalf("a new build: %+v", ev)
	}
	exec(`update invocations set status = 'succeeded' where id = 'b2'`)
	exec(`update consumer_positions set stream_seq = 3`)
	if ev := es.next(t); ev.Name != "gone" || ev.Data["key"] != "acme/b2" {
		t.Fatalf("a build that ended, on a list of running builds: %+v", ev)
	}
	// Without the filter it stays, changed.
	es, _ = openEvents(t, base+"/events/builds?project=acme", "")
	for range 3 {
		es.next(t)
	}
	exec(`update invocations set status = 'failed', exit_code_name = 'BUILD_FAILURE' where id = 'b1'`)
	exec(`update consumer_positions set stream_seq = 4`)
	if ev := es.next(t); ev.Name != "build" || ev.Data["key"] != "acme/b1" || ev.Data["index"] != "2" ||
		!strings.Contains(ev.Data["html"], "BUILD_FAILURE") {
		t.Fatalf("a build that failed: %+v", ev)
	}
}

// runningBuild is acme's build run-1, running, and a stream holding one
// line of its output at sequence 7.
func runningBuild(t *testing.T) (*pgxpool.Pool, *fakeStream) {
	t.Helper()
	pool, _ := testenv.Pool(t)
	if _, err := pool.Exec(context.Background(), `insert into invocations (id, project, status, command, started_at, first_event_at, last_event_at)
		values ('run-1', 'acme', 'running', 'test', now(), now(), now())`); err != nil {
		t.Fatal(err)
	}
	fs := newFakeStream()
	fs.add(subjects.BES("acme", "run-1"), 7, bazelEvent(t, &bep.BuildEvent{Payload: &bep.BuildEvent_Progress{Progress: &bep.Progress{Stderr: "x\n"}}}))
	return pool, fs
}

// A connection that has lasted LiveFor ends with renew, after the events
// it carried; the browser then reconnects from the last one.
func TestConsoleLiveRenew(t *testing.T) {
	pool, fs := runningBuild(t)
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }, Live: fs, LiveFor: 300 * time.Millisecond})
	es, _ := openEvents(t, serveURL(t, mux)+"/builds/acme/run-1/events", "")
	if ev := es.next(t); ev.Name != "output" || ev.ID != "7" {
		t.Fatalf("first: %+v", ev)
	}
	if ev := es.next(t); ev.Name != "renew" || ev.ID != "7" {
		t.Fatalf("after LiveFor: %+v", ev)
	}
}

// When the process begins to stop, a build's live connection ends with
// renew and the list's ends, however long LiveFor is: the browsers
// reconnect elsewhere rather than hold the shutdown to its deadline.
func TestConsoleLiveStopping(t *testing.T) {
	pool, fs := runningBuild(t)
	stopping := make(chan struct{})
	mux := http.NewServeMux()
	Register(mux, Sources{DB: func() *pgxpool.Pool { return pool }, Live: fs, LiveFor: time.Hour, Stopping: stopping})
	base := serveURL(t, mux)
	build, _ := openEvents(t, base+"/builds/acme/run-1/events", "")
	if ev := build.next(t); ev.Name != "output" {
		t.Fatalf("first: %+v", ev)
	}
	list, _ := openEvents(t, base+"/events/builds?project=acme", "")
	if ev := list.next(t); ev.Name != "build" {
		t.Fatalf("the list's first: %+v", ev)
	}
	close(stopping)
	if ev := build.next(t); ev.Name != "renew" || ev.ID != "7" {
		t.Fatalf("once stopping: %+v", ev)
	}
	ended := make(chan error, 1)
	go func() {
		_, err := io.Copy(io.Discard, list.r)
		ended <- err
	}()
	select {
	case err := <-ended:
		if err != nil {
			t.Fatalf("the list's connection: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the list's connection is still open after the process began to stop")
	}
	poll.Until(t, "the follow to end", func() bool { return fs.openFollows() == 0 })
}
