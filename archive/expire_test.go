package archive_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

func (f *flaky) Delete(ctx context.Context, key string) error {
	if f.down.Load() {
		return errDown
	}
	return f.Bucket.Delete(ctx, key)
}

// archiveTwo archives an old build (testID, last event 40 days ago) and a
// recent one (otherID, an hour ago) of project, their raw events left in
// the stream, and returns their object keys.
func (e *env) archiveTwo(t *testing.T) (oldKey, newKey string) {
	t.Helper()
	old := invocation(t, "bazel-test-60.besrec")
	e.publish(t, old)
	n, last := tools(old)
	e.finished(t, project, testID, 40*24*time.Hour, n, last)
	recent := invocation(t, "bazel-build-10.besrec")
	e.publish(t, recent)
	n, last = tools(recent)
	e.finished(t, project, otherID, time.Hour, n, last)
	a, err := archive.New(archive.Config{Lookback: 60 * 24 * time.Hour}, e.pool, e.store, e.src, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	o, ok1 := e.archived(t, project, testID)
	r, ok2 := e.archived(t, project, otherID)
	if !ok1 || !ok2 || o.Key == "" || r.Key == "" {
		t.Fatalf("not archived: %+v %+v", o, r)
	}
	return o.Key, r.Key
}

// Raw events past retention leave the stream and the bucket; the build's
// rows stay, and its archived_builds row says the object is gone (so the
// archiver does not archive it again, and a replay keeps its rows). A
// build within retention keeps both.
func TestExpireRawDeletesObjectAndStreamKeepsRows(t *testing.T) {
	e := newEnv(t)
	oldKey, newKey := e.archiveTwo(t)
	oldSubject, newSubject := subjects.BES(project, testID), subjects.BES(project, otherID)
	inNew := e.inStream(t, newSubject)
	if e.inStream(t, oldSubject) == 0 || inNew == 0 {
		t.Fatal("the builds' raw events are not in the stream")
	}
	r := archive.NewRawExpirer(e.pool, e.store, streams.SubjectTrimmer{Stream: e.src.Stream})
	n, err := r.ExpireRaw(e.ctx, project, time.Now().Add(-30*24*time.Hour), 10)
	if err != nil || n != 1 {
		t.Fatalf("ExpireRaw: %d, %v; want the old build", n, err)
	}
	if _, err := e.store.Get(e.ctx, oldKey); !errors.Is(err, bucket.ErrNotFound) {
		t.Fatalf("the old build's object: %v, want it gone", err)
	}
	if got := e.inStream(t, oldSubject); got != 0 {
		t.Fatalf("the stream still holds %d of the old build's messages", got)
	}
	if row, ok := e.archived(t, project, testID); !ok || row.Key != "" {
		t.Fatalf("the old build's archived_builds row: %+v %v, want it with no object", row, ok)
	}
	var rows int
	if err := e.pool.QueryRow(e.ctx, "select count(*) from invocations where project = $1", project).Scan(&rows); err != nil || rows != 2 {
		t.Fatalf("invocations rows: %d (%v), want both builds' (rows outlive raw events)", rows, err)
	}
	if _, err := e.store.Get(e.ctx, newKey); err != nil {
		t.Fatalf("the recent build's object: %v", err)
	}
	if got := e.inStream(t, newSubject); got != inNew {
		t.Fatalf("the recent build's messages: %d, want %d", got, inNew)
	}
	// The archiver does not bring it back, even for a late event.
	old := invocation(t, "bazel-test-60.besrec")
	n, last := tools(old)
	var before, after time.Time
	e.pool.QueryRow(e.ctx, "select last_event_at from archived_builds where invocation_id = $1", testID).Scan(&before)
	e.finished(t, project, testID, 35*24*time.Hour, n+1, last+1)
	a, _ := archive.New(archive.Config{Lookback: 60 * 24 * time.Hour}, e.pool, e.store, e.src, nil)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	e.pool.QueryRow(e.ctx, "select last_event_at from archived_builds where invocation_id = $1", testID).Scan(&after)
	if row, _ := e.archived(t, project, testID); row.Key != "" || !after.Equal(before) {
		t.Fatalf("archived again after its raw retention: %+v, last event %v, was %v", row, after, before)
	}
}

// A failing bucket pauses the retention (millrace_retention_paused) and
// deletes nothing; once it is back, the next pass removes the raw events.
func TestExpireRawBucketFailurePauses(t *testing.T) {
	e := newEnv(t)
	oldKey, _ := e.archiveTwo(t)
	reg := prometheus.NewRegistry()
	raw := archive.NewRawExpirer(e.pool, e.store, streams.SubjectTrimmer{Stream: e.src.Stream})
	x, err := builds.NewExpirer(builds.ExpireConfig{Interval: 20 * time.Millisecond, MaxPause: 50 * time.Millisecond},
		builds.Retention{RawDays: 30}, e.pool, raw, builds.NewExpireMetrics(reg))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.pool.Exec(e.ctx, `insert into hourly_rollups (project, hour, duration_hist) values ($1, now(), '{}')`, project); err != nil {
		t.Fatal(err) // the projector would have counted the builds: the retention's list of projects
	}
	e.store.down.Store(true)
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- x.Run(ctx) }()
	poll.Until(t, "retention paused", func() bool { return testenv.Metric(t, reg, "millrace_retention_paused") == 1 })
	if row, _ := e.archived(t, project, testID); row.Key != oldKey {
		t.Fatalf("while the bucket is down: %+v", row)
	}
	e.store.down.Store(false)
	poll.Until(t, "raw events deleted", func() bool {
		return testenv.Metric(t, reg, "millrace_retention_builds_deleted_total", `what="raw"`) == 1 &&
			testenv.Metric(t, reg, "millrace_retention_paused") == 0
	})
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if _, err := e.store.Bucket.Get(e.ctx, oldKey); !errors.Is(err, bucket.ErrNotFound) {
		t.Fatalf("object after the bucket came back: %v", err)
	}
	if n := testenv.Metric(t, reg, "millrace_retention_failures_total", `reason="raw"`); n < 1 {
		t.Fatalf("failures (raw): %v", n)
	}
}
