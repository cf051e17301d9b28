package console

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/schemas/bep"
)

// A running build's page follows the build while Bazel sends it: live.js
// opens /builds/{project}/{id}/events, a stream of server-sent events fed
// from the build's subject of the BES stream (Follower), and adds what
// each event changes to the page: output, targets, tests, the status.
//
// Where the stream starts: the page is read in one snapshot of PostgreSQL
// together with the projector's position (builds.Position), so that it
// shows every event up to that stream sequence and none after it; the
// events start at the next one. Each carries its stream sequence as its
// id, and a browser that loses the connection sends the last one it saw
// as Last-Event-ID when it reconnects: the events go on from there, none
// missing and none twice.
//
// What it costs: a consumer on the backbone for each open stream, none for
// a build nobody looks at, and one status read (by primary key) every
// liveCheck while it is open. The events end when the projection says the
// build is no longer running (finished or abandoned, which only the
// projector's sweep decides); the page then reloads once, and shows the
// build as stored.

// Follower follows one build's events (streams.BuildEvents' Follow of the
// build's subject, in whichever stream the backbone keeps it): fn gets
// each message stored after the stream sequence after, as it arrives,
// until ctx ends.
type Follower interface {
	Follow(ctx context.Context, project, invocation string, after uint64, fn func(seq uint64, data []byte) error) error
}

const (
	// liveCheck is how often an open event stream reads the build's status
	// (and sends a comment, so that proxies keep the connection).
	liveCheck = 2 * time.Second
	// defaultMaxLive and defaultLiveFor are Sources' defaults.
	defaultMaxLive = 256
	defaultLiveFor = 10 * time.Minute
)

// liveEvents serves a build's event stream (text/event-stream):
//
//	event: output  data: {"stream":"stderr","html":"..."}  output, rendered (ANSI)
//	event: target  data: {"label":"//a:b","html":"<tr>..."}  a target completed
//	event: test    data: {"label":"//a:t","html":"<tr>..."}  a test ran, or its summary
//	event: status  data: {"status":"failed","html":"..."}  Bazel said how the build ended
//	event: counts  data: {"targets":"...","tests":"..."}  the summary's counts, as projected
//	event: end     data: {"status":"failed"}  the projection has the build as it ended
//	event: renew   data: {}  the connection ends (LiveFor): reconnect from the last id
//
// The start is the Last-Event-ID header (a reconnecting browser), else
// ?after= (the page's position), else the beginning.
func liveEvents(src Sources, slots chan struct{}) handler {
	return func(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
		project, id := r.PathValue("project"), r.PathValue("id")
		after, err := liveStart(r)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		status, err := builds.StatusOf(r.Context(), p, project, id)
		if errors.Is(err, builds.ErrNotFound) {
			http.Error(w, "no such build", http.StatusNotFound)
			return
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		if status == "running" && src.Live == nil {
			http.Error(w, "this process does not follow the backbone: reload the page to see the build's progress", http.StatusNotImplemented)
			return
		}
		out, release := startEvents(w, slots)
		if out == nil {
			return
		}
		defer release()
		if status != "running" {
			out.send(after, "end", map[string]string{"status": status})
			return
		}

		ctx, cancel := src.liveContext(r.Context())
		defer cancel()
		type msg struct {
			seq  uint64
			data []byte
		}
		msgs := make(chan msg, 64)
		followed := make(chan error, 1)
		go func() {
			followed <- src.Live.Follow(ctx, project, id, after, func(seq uint64, data []byte) error {
				select {
				case msgs <- msg{seq, data}:
					return nil
				case <-ctx.Done():
					return ctx.Err()
				}
			})
		}()
		lb := liveBuild{project: project, kinds: map[string]string{}, tests: map[string]*builds.Test{}}
		tick := time.NewTicker(liveCheck)
		defer tick.Stop()
		// The summary's counts are the projection's: they are read again
		// on the checks that follow a target or test event (the
		// projection lags the stream by a batch or so), and sent when they
		// changed; a build with nothing new costs its status alone.
		countsDue, counts := 0, ""
		for {
			select {
			case m := <-msgs:
				for _, ev := range lb.apply(m.data) {
					out.send(m.seq, ev.name, ev.data)
					if ev.name == "target" || ev.name == "test" {
						countsDue = countChecks
					}
				}
				after = m.seq
				out.flush()
			case <-tick.C:
				st, c, err := liveStatus(ctx, p, project, id, countsDue > 0)
				countsDue = max(countsDue-1, 0)
				if err == nil && st != "running" {
					out.send(after, "end", map[string]string{"status": st})
					return
				}
				if c != nil && c["targets"]+c["tests"] != counts {
					counts = c["targets"] + c["tests"]
					out.send(after, "counts", c)
				}
				out.comment()
			case err := <-followed:
				if err != nil && ctx.Err() == nil {
					slog.Warn("console: following a build", "op", "live", "project", project, "invocation", id, "err", err)
				}
				// The browser reconnects from the last id it saw.
				return
			case <-ctx.Done():
				if r.Context().Err() == nil { // LiveFor is up, or the process stops: the browser reconnects
					out.send(after, "renew", map[string]string{})
				}
				return
			}
			if out.err != nil { // the browser went away
				return
			}
		}
	}
}

// countChecks is how many status checks after a target or test event
// read the summary's counts too.
const countChecks = 3

// liveStatus reads a build's status, and with counts the summary's counts
// drawn as the page draws them (nil when not asked or not drawn).
func liveStatus(ctx context.Context, p *pgxpool.Pool, project, id string, counts bool) (string, map[string]string, error) {
	if !counts {
		st, err := builds.StatusOf(ctx, p, project, id)
		return st, nil, err
	}
	s, err := builds.SummaryOf(ctx, p, project, id)
	if err != nil {
		return "", nil, err
	}
	c := map[string]string{}
	for key, tmpl := range map[string]string{"targets": "countTargets", "tests": "countTests"} {
		html, ok := fragment("build", tmpl, s)
		if !ok {
			return s.Status, nil, nil
		}
		c[key] = html
	}
	return s.Status, c, nil
}

// fragment renders the template tmpl of view (a row, a count) for a live
// event; a template that fails is logged, and the event not sent.
func fragment(view, tmpl string, data any) (string, bool) {
	var buf bytes.Buffer
	if err := views[view].ExecuteTemplate(&buf, tmpl, data); err != nil {
		slog.Error("console: rendering a live event", "op", "render "+tmpl, "err", err)
		return "", false
	}
	return buf.String(), true
}

// startEvents takes one of the live slots and starts an event stream on
// w; nil when it answered otherwise (no slot free: the browser retries by
// itself, a few seconds on; a connection that cannot stream). release
// gives the slot back.
func startEvents(w http.ResponseWriter, slots chan struct{}) (out *eventWriter, release func()) {
	select {
	case slots <- struct{}{}:
	default:
		w.Header().Set("Retry-After", "5")
		http.Error(w, "too many live pages are open on this server; the page will try again", http.StatusServiceUnavailable)
		return nil, nil
	}
	release = func() { <-slots }
	flusher, ok := w.(http.Flusher)
	if !ok {
		release()
		http.Error(w, "this connection cannot stream", http.StatusInternalServerError)
		return nil, nil
	}
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-store")
	h.Set("X-Accel-Buffering", "no") // a proxy in front must not hold the events back
	w.WriteHeader(http.StatusOK)
	return &eventWriter{w: w, f: flusher}, release
}

// liveStart is where a request's events start: the stream sequence after
// which they go on.
func liveStart(r *http.Request) (uint64, error) {
	s, what := r.Header.Get("Last-Event-ID"), "Last-Event-ID"
	if s == "" {
		s, what = r.URL.Query().Get("after"), "after"
	}
	if s == "" {
		return 0, nil
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		return 0, fmt.Errorf("%s %q is not a stream sequence", what, s)
	}
	return n, nil
}

// eventWriter writes server-sent events; its first write error stays in
// err and ends the stream.
type eventWriter struct {
	w   http.ResponseWriter
	f   http.Flusher
	err error
	buf bytes.Buffer
}

func (e *eventWriter) send(id uint64, name string, data any) {
	b, err := json.Marshal(data)
	if err != nil {
		panic(err) // maps and strings only
	}
	e.buf.Reset()
	if id > 0 {
		e.buf.WriteString("id: " + strconv.FormatUint(id, 10) + "\n")
	}
	e.buf.WriteString("event: " + name + "\ndata: ")
	e.buf.Write(b) // JSON holds no newline
	e.buf.WriteString("\n\n")
	e.write()
	if name == "end" {
		e.flush()
	}
}

func (e *eventWriter) comment() {
	e.buf.Reset()
	e.buf.WriteString(":\n\n")
	e.write()
	e.flush()
}

func (e *eventWriter) write() {
	if e.err == nil {
		_, e.err = e.w.Write(e.buf.Bytes())
	}
}

func (e *eventWriter) flush() {
	if e.err == nil {
		e.f.Flush()
	}
}

// liveBuild turns a build's events into what its page shows of them, with
// what it needs of earlier events (a target's kind, a test's attempts so
// far).
type liveBuild struct {
	project string
	kinds   map[string]string
	tests   map[string]*builds.Test
}

type liveEvent struct {
	name string
	data map[string]string
}

// apply decodes one message of the build's subject (an OrderedBuildEvent
// as the edge stored it) into the page's events. A message it cannot read
// changes nothing: the projection decides what the build is, and the page
// shows that once it reloads.
func (lb *liveBuild) apply(data []byte) []liveEvent {
	var obe buildpb.OrderedBuildEvent
	if proto.Unmarshal(data, &obe) != nil {
		return nil
	}
	a := obe.GetEvent().GetBazelEvent()
	if a == nil || a.GetTypeUrl() != bep.TypeURL {
		return nil
	}
	if stdout, stderr, ok := progress(a.GetValue()); ok {
		var evs []liveEvent
		for _, s := range []struct {
			name string
			text []byte
		}{{"stderr", stderr}, {"stdout", stdout}} {
			if len(s.text) > 0 {
				evs = append(evs, liveEvent{"output", map[string]string{"stream": s.name, "html": string(ANSI(s.text))}})
			}
		}
		return evs
	}
	var be bep.BuildEvent
	if proto.Unmarshal(a.GetValue(), &be) != nil {
		return nil
	}
	id := be.GetId()
	switch {
	case be.GetConfigured() != nil && id.GetTargetConfigured() != nil:
		lb.kinds[id.GetTargetConfigured().GetLabel()] = be.GetConfigured().GetTargetKind()
	case be.GetCompleted() != nil && id.GetTargetCompleted() != nil:
		label := id.GetTargetCompleted().GetLabel()
		t := builds.Target{Label: label, Kind: lb.kinds[label], Success: be.GetCompleted().GetSuccess()}
		return lb.row("target", label, "targetRow", t, "success", strconv.FormatBool(t.Success))
	case be.GetTestResult() != nil && id.GetTestResult() != nil:
		label := id.GetTestResult().GetLabel()
		t := lb.test(label)
		m := be.GetTestResult()
		t.Attempts = max(t.Attempts, id.GetTestResult().GetAttempt())
		t.Status = m.GetStatus().String()
		t.DurationMs += millis(m.GetTestAttemptDuration(), m.GetTestAttemptDurationMillis())
		t.Cached = m.GetCachedLocally() || m.GetExecutionInfo().GetCachedRemotely()
		return lb.row("test", label, "testRow", row{lb.project, *t}, "status", t.Status)
	case be.GetTestSummary() != nil && id.GetTestSummary() != nil:
		label := id.GetTestSummary().GetLabel()
		t := lb.test(label)
		m := be.GetTestSummary()
		t.Status = m.GetOverallStatus().String()
		t.Attempts = max(t.Attempts, m.GetAttemptCount())
		t.Shards = max(t.Shards, m.GetShardCount())
		t.DurationMs = millis(m.GetTotalRunDuration(), m.GetTotalRunDurationMillis())
		t.Cached = m.GetTotalNumCached() > 0
		return lb.row("test", label, "testRow", row{lb.project, *t}, "status", t.Status)
	case be.GetFinished() != nil:
		status, state := "failed", "Finished"
		if ec := be.GetFinished().GetExitCode(); ec != nil {
			if ec.GetCode() == 0 {
				status = "succeeded"
			}
			state += fmt.Sprintf(": %s (exit code %d)", ec.GetName(), ec.GetCode())
		} else if be.GetFinished().GetOverallSuccess() {
			status = "succeeded"
		}
		return []liveEvent{{"status", map[string]string{"status": status, "state": state + ". The page shows it all once it is stored."}}}
	}
	return nil
}

func (lb *liveBuild) test(label string) *builds.Test {
	t := lb.tests[label]
	if t == nil {
		t = &builds.Test{Label: label}
		lb.tests[label] = t
	}
	return t
}

// row renders a table row of the page (templates/rows.html) as an event,
// with k: v for live.js's filters.
func (lb *liveBuild) row(event, label, tmpl string, data any, k, v string) []liveEvent {
	html, ok := fragment("build", tmpl, data)
	if !ok {
		return nil
	}
	return []liveEvent{{event, map[string]string{"label": label, "html": html, k: v}}}
}

// row is a table row's data with the build's project, for its links.
type row struct {
	Project string
	T       builds.Test
}

func millis(d interface {
	GetSeconds() int64
	GetNanos() int32
}, ms int64) int64 {
	if d != nil && (d.GetSeconds() != 0 || d.GetNanos() != 0) {
		return d.GetSeconds()*1000 + int64(d.GetNanos())/1e6
	}
	return ms
}

// Field numbers of build_event_stream.BuildEvent.progress and of Progress.
const (
	beProgress     = 3
	progressStdout = 1
	progressStderr = 2
)

// progress slices a Progress event's output out of a BuildEvent's bytes
// (ok: it is one). Output is bytes as the tool printed them, which need
// not be UTF-8, and the protobuf runtime refuses such a string field.
func progress(b []byte) (stdout, stderr []byte, ok bool) {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, nil, false
		}
		b = b[n:]
		if num == beProgress && typ == protowire.BytesType {
			v, n := protowire.ConsumeBytes(b)
			if n < 0 {
				return nil, nil, false
			}
			b, ok = b[n:], true
			for len(v) > 0 {
				num, typ, n := protowire.ConsumeTag(v)
				if n < 0 {
					return nil, nil, false
				}
				v = v[n:]
				if typ == protowire.BytesType && (num == progressStdout || num == progressStderr) {
					text, n := protowire.ConsumeBytes(v)
					if n < 0 {
						return nil, nil, false
					}
					if num == progressStdout {
						stdout = append(stdout, text...)
					} else {
						stderr = append(stderr, text...)
					}
					v = v[n:]
					continue
				}
				if n = protowire.ConsumeFieldValue(num, typ, v); n < 0 {
					return nil, nil, false
				}
				v = v[n:]
			}
			continue
		}
		if n = protowire.ConsumeFieldValue(num, typ, b); n < 0 {
			return nil, nil, false
		}
		b = b[n:]
	}
	return stdout, stderr, ok
}

// listEvents serves the first page of the builds list as it changes, for
// the list's page (live.js): with the page's filters, it reads the page
// again whenever the projector's position has moved (one read by primary
// key every liveCheck while nothing happens), and sends each row that is
// new or changed, and each that left the page:
//
//	event: build  data: {"key":"project/id","index":"0","html":"<tr>..."}
//	event: gone   data: {"key":"project/id"}
//
// The first read sends every row, whatever the page already shows.
func listEvents(src Sources, slots chan struct{}) handler {
	return func(w http.ResponseWriter, r *http.Request, p *pgxpool.Pool) {
		q, err := searchQuery(r)
		elsewhere := scoped(r, &q)
		if err == nil && q.Before != "" {
			err = errors.New("only the first page of the list is live")
		}
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		out, release := startEvents(w, slots)
		if out == nil {
			return
		}
		defer release()
		// At its end (LiveFor, or the process stopping) the browser
		// reconnects by itself and gets every row again.
		ctx, cancel := src.liveContext(r.Context())
		defer cancel()
		shown := map[string]string{} // key → the row's HTML
		var pos uint64
		tick := time.NewTicker(liveCheck)
		defer tick.Stop()
		for first := true; ; first = false {
			if !first {
				select {
				case <-tick.C:
				case <-ctx.Done():
					return
				}
			}
			now, err := builds.Positions(ctx, p)
			if err != nil || (!first && now == pos) {
				out.comment()
				if out.err != nil {
					return
				}
				continue
			}
			pos = now
			var page builds.SearchPage
			if !elsewhere {
				if page, err = builds.Search(ctx, p, q); err != nil {
					continue // the next tick tries again
				}
			}
			// What left the page first, so that the indexes of what
			// follows are those of the page as it is now.
			rows := map[string]bool{}
			for _, b := range page.Builds {
				rows[b.Project+"/"+b.ID] = true
			}
			for key := range shown {
				if !rows[key] {
					delete(shown, key)
					out.send(0, "gone", map[string]string{"key": key})
				}
			}
			for i, b := range page.Builds {
				key := b.Project + "/" + b.ID
				html, ok := fragment("list", "buildRow", b)
				if !ok {
					return
				}
				if shown[key] != html {
					shown[key] = html
					out.send(0, "build", map[string]string{"key": key, "index": strconv.Itoa(i), "html": html})
				}
			}
			out.comment() // flushes
			if out.err != nil {
				return
			}
		}
	}
}
