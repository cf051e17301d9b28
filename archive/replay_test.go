package archive_test

import (
	"context"
	"errors"
	"log/slog"
	"maps"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// replayEnv is a stream of two recorded builds, projected live.
type replayEnv struct {
	*env
	proj   *builds.Projector
	rc     streams.RunnerConfig
	first  archive.Build // the older build: archived, then trimmed
	second archive.Build // still in the stream
	live   map[string]string
	// published counts every message stored.
	published uint64
}

func newReplayEnv(t *testing.T) *replayEnv {
	e := &replayEnv{env: newEnv(t)}
	e.first, e.second = invocation(t, "bazel-test-60.besrec"), invocation(t, "bazel-build-10.besrec")
	for _, name := range []string{"bazel-test-60.besrec", "bazel-build-10.besrec"} {
		for _, b := range fixture(t, name) { // every subject: lifecycle ones too, as the edge stores them
			e.publish(t, b)
			e.published += uint64(len(b.Messages))
		}
	}
	var err error
	if e.proj, err = builds.New(builds.Config{}); err != nil {
		t.Fatal(err)
	}
	e.rc = streams.RunnerConfig{Stream: subjects.StreamBES, Filter: subjects.BESFilter, Logger: slog.New(slog.DiscardHandler)}
	r, err := streams.NewRunner(e.js, e.pool, e.proj, e.rc, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()
	last := e.lastSeq(t)
	poll.Until(t, "the builds projected", func() bool {
		var pos int64
		e.pool.QueryRow(e.ctx, "select coalesce(max(stream_seq), 0) from consumer_positions where consumer = $1", builds.ConsumerName).Scan(&pos)
		return uint64(pos) >= last
	}, poll.Within(time.Minute))
	cancel()
	<-done
	e.live = e.digest(t)
	return e
}

func (e *replayEnv) lastSeq(t *testing.T) uint64 {
	t.Helper()
	s, err := e.js.Stream(e.ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	return info.State.LastSeq
}

func (e *replayEnv) digest(t *testing.T) map[string]string {
	t.Helper()
	d, err := builds.Digest(e.ctx, e.pool)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

// archiveFirst archives the first build and trims its messages from the
// stream, as if they had left it.
func (e *replayEnv) archiveFirst(t *testing.T) {
	t.Helper()
	a, err := archive.New(archive.Config{After: time.Millisecond, Logger: slog.New(slog.DiscardHandler)}, e.pool, e.store, e.src, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	row, ok := e.archived(t, project, testID)
	if !ok || row.Key == "" {
		t.Fatalf("first build not archived: %+v", row)
	}
	s, _ := e.js.Stream(e.ctx, subjects.StreamBES)
	if err := streams.TrimSubject(e.ctx, s, subjects.BES(project, testID), uint64(row.LastSeq)); err != nil {
		t.Fatal(err)
	}
}

func (e *replayEnv) tail(t *testing.T) archive.StreamTail {
	t.Helper()
	s, _ := e.js.Stream(e.ctx, subjects.StreamBES)
	info, err := s.Info(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	return archive.StreamTail{FirstSeq: info.State.FirstSeq, FirstTime: info.State.FirstTime, LastSeq: info.State.LastSeq}
}

func (e *replayEnv) reset(ctx context.Context, tx pgx.Tx, keep []archive.BuildID) error {
	ks := make([]builds.Key, len(keep))
	for i, k := range keep {
		ks[i] = builds.Key(k)
	}
	return e.proj.ResetExcept(ctx, tx, ks)
}

// replay replays by plan and returns the plan and how many messages it
// applied.
func (e *replayEnv) replay(t *testing.T, opts archive.ReplayOptions) (archive.ReplayPlanned, uint64) {
	t.Helper()
	plan, planned, err := archive.PlanReplay(e.ctx, e.pool, e.store, e.tail(t), e.reset, opts)
	if err != nil {
		t.Fatal(err)
	}
	var applied uint64
	rc := e.rc
	rc.Progress = func(p streams.Progress) { applied = p.Applied }
	r, err := streams.NewRunner(e.js, e.pool, e.proj, rc, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.ReplayWith(e.ctx, plan); err != nil {
		t.Fatal(err)
	}
	return planned, applied
}

// A build archived and gone from the stream comes back from the archive,
// one archived and still in the stream is applied once: the replay yields
// the live run's rows, every table digested.
func TestReplayReadsTheArchiveThenTheStream(t *testing.T) {
	e := newReplayEnv(t)
	e.archiveFirst(t)
	if _, err := e.pool.Exec(e.ctx, "update invocations set host = 'tampered'"); err != nil {
		t.Fatal(err)
	}
	planned, applied := e.replay(t, archive.ReplayOptions{})
	// Both builds are archived; the second is still in the stream too,
	// and is applied once: every message stored, once, the builds' from
	// the archive and of the stream only the build-level lifecycle events
	// (which are not archived).
	if planned.Archived != 2 || planned.Kept != 0 {
		t.Fatalf("planned %+v, want both builds from the archive and none kept", planned)
	}
	if applied != e.published {
		t.Fatalf("replay applied %d messages, want the %d stored, each once", applied, e.published)
	}
	if got := e.digest(t); !maps.Equal(got, e.live) {
		t.Fatalf("after replay from the archive:\n got %v\nwant %v", got, e.live)
	}
}

// A build the stream has lost and the archive lacks, within raw
// retention, makes the replay refuse, naming it, before anything changes.
func TestReplayRefusesAGap(t *testing.T) {
	e := newReplayEnv(t)
	e.archiveFirst(t)
	if _, err := e.pool.Exec(e.ctx, "delete from archived_builds"); err != nil {
		t.Fatal(err)
	}
	_, planned, err := archive.PlanReplay(e.ctx, e.pool, e.store, e.tail(t), e.reset, archive.ReplayOptions{RawKept: 30 * 24 * time.Hour})
	if !errors.Is(err, archive.ErrGap) || !strings.Contains(err.Error(), testID) || len(planned.Gaps) != 1 {
		t.Fatalf("plan with a gap: %v (%+v), want ErrGap naming %s", err, planned, testID)
	}
	if got := e.digest(t); !maps.Equal(got, e.live) {
		t.Fatal("a refused replay changed the projection")
	}
}

// A build whose raw events are past retention (gone from the stream, not
// archived) keeps its rows as they were; the others are rebuilt.
func TestReplayKeepsBuildsPastRawRetention(t *testing.T) {
	e := newReplayEnv(t)
	e.archiveFirst(t)
	if _, err := e.pool.Exec(e.ctx, "delete from archived_builds"); err != nil {
		t.Fatal(err)
	}
	// Marks: the kept build's stays, the rebuilt one's goes.
	if _, err := e.pool.Exec(e.ctx, "update invocations set host = 'marked'"); err != nil {
		t.Fatal(err)
	}
	planned, _ := e.replay(t, archive.ReplayOptions{RawKept: time.Hour, Now: time.Now().Add(2 * time.Hour)})
	if planned.Kept != 1 || planned.Archived != 0 {
		t.Fatalf("planned %+v, want one build kept", planned)
	}
	var firstHost, secondHost string
	e.pool.QueryRow(e.ctx, "select coalesce(host, '') from invocations where id = $1", testID).Scan(&firstHost)
	e.pool.QueryRow(e.ctx, "select coalesce(host, '') from invocations where id <> $1", testID).Scan(&secondHost)
	if firstHost != "marked" || secondHost == "marked" {
		t.Fatalf("hosts after replay: kept build %q, rebuilt build %q", firstHost, secondHost)
	}
	var n int
	e.pool.QueryRow(e.ctx, "select count(*) from invocations").Scan(&n)
	if n != 2 {
		t.Fatalf("%d builds after replay, want the 2 it started with", n)
	}
}

// A build whose raw events the raw retention removed keeps its rows
// through a replay, even with raw events kept for ever (RawKept 0): the
// archive and the stream lack it, and that is not a gap.
func TestReplayKeepsBuildsWhoseRawEventsExpired(t *testing.T) {
	e := newReplayEnv(t)
	e.archiveFirst(t)
	raw := archive.NewRawExpirer(e.pool, e.store, streams.SubjectTrimmer{Stream: e.src.Stream})
	if n, err := raw.ExpireRaw(e.ctx, project, time.Now().Add(time.Hour), 1); err != nil || n != 1 {
		t.Fatalf("ExpireRaw: %d, %v; want the first build", n, err)
	}
	if row, _ := e.archived(t, project, testID); row.Key != "" {
		t.Fatalf("the first build's raw events not expired: %+v", row)
	}
	planned, _ := e.replay(t, archive.ReplayOptions{})
	if planned.Kept != 1 {
		t.Fatalf("planned %+v, want the first build kept", planned)
	}
	if got := e.digest(t); !maps.Equal(got, e.live) {
		t.Fatalf("after replay:\n got %v\nwant %v", got, e.live)
	}
}
