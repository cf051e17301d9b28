package archive_test

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

const tenant = "other-tenant"

// asProject is b as another project's client would have sent it: the same
// invocation ids, another project.
func asProject(b archive.Build, p string) archive.Build {
	out := archive.Build{Subject: b.Subject}
	for _, m := range b.Messages {
		c := *m
		c.SubjectName = strings.Replace(m.SubjectName, "bes."+project+".", "bes."+p+".", 1)
		c.Headers = map[string][]string{}
		for k, v := range m.Headers {
			c.Headers[k] = v
		}
		c.Headers["Millrace-Project"] = []string{p}
		if id := m.Headers["Nats-Msg-Id"]; len(id) > 0 { // not a duplicate of the first project's
			c.Headers["Nats-Msg-Id"] = []string{p + "/" + id[0]}
		}
		out.Messages = append(out.Messages, &c)
	}
	return out
}

// deleteEnv holds the two fixture builds in two projects with the same
// invocation ids, projected and archived, their raw events in the stream.
func newDeleteEnv(t *testing.T) *env {
	e := newEnv(t)
	for _, name := range []string{"bazel-test-60.besrec", "bazel-build-10.besrec"} {
		for _, b := range fixture(t, name) {
			e.publish(t, b)
			e.publish(t, asProject(b, tenant))
		}
	}
	p, _ := builds.New(builds.Config{})
	rc := streams.RunnerConfig{Stream: subjects.StreamBES, Filter: subjects.BESFilter, Logger: slog.New(slog.DiscardHandler)}
	r, err := streams.NewRunner(e.js, e.pool, p, rc, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()
	info, err := e.src.Stream.Info(e.ctx)
	if err != nil {
		t.Fatal(err)
	}
	poll.Until(t, "the builds projected", func() bool {
		var pos int64
		e.pool.QueryRow(e.ctx, "select coalesce(max(stream_seq), 0) from consumer_positions where consumer = $1", builds.ConsumerName).Scan(&pos)
		return uint64(pos) >= info.State.LastSeq
	}, poll.Within(time.Minute))
	cancel()
	<-done
	a, err := archive.New(archive.Config{After: time.Millisecond, Logger: slog.New(slog.DiscardHandler)}, e.pool, e.store, e.src, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *env) eraser() archive.Eraser {
	return func(ctx context.Context, project, id string) (uint64, error) {
		filter := subjects.BESProjectFilter(project)
		if id != "" {
			filter = subjects.BES(project, id)
		}
		return streams.EraseSubjects(ctx, e.src.Stream, filter, nil)
	}
}

// holds is what project keeps of build id: rows of every table, rollup
// count, archive rows, stream messages.
type holding struct{ invocations, targets, rollupBuilds, archived, messages int }

// buildKeys are the build keys holds has seen, by project/id.
var buildKeys sync.Map

func (e *env) holds(t *testing.T, p, id string) holding {
	t.Helper()
	var h holding
	q := func(sql string, dst *int, args ...any) {
		if err := e.pool.QueryRow(e.ctx, sql, args...).Scan(dst); err != nil {
			t.Fatal(err)
		}
	}
	q("select count(*) from invocations where project = $1 and id = $2", &h.invocations, p, id)
	// By the build's key, remembered from before its invocation row went:
	// rows left behind by a delete are still counted.
	var key *int64
	if err := e.pool.QueryRow(e.ctx, "select build_key from invocations where project = $1 and id = $2", p, id).Scan(&key); err == nil {
		buildKeys.Store(p+"/"+id, *key)
	}
	if k, ok := buildKeys.Load(p + "/" + id); ok {
		q("select count(*) from targets where build_key = $1", &h.targets, k)
	}
	q("select coalesce(sum(builds), 0)::int from hourly_rollups where project = $1", &h.rollupBuilds, p)
	q("select count(*) from archived_builds where project = $1 and invocation_id = $2", &h.archived, p, id)
	h.messages = int(e.inStream(t, subjects.BES(p, id)))
	return h
}

// A build deleted on request leaves no row, no count in the rollups, no
// stream message and no archive object; the other project's build of the
// same id keeps all of them. Then the whole project goes, the other stays.
func TestDeleteBuildAndProjectOnRequest(t *testing.T) {
	e := newDeleteEnv(t)
	other := e.holds(t, tenant, testID)
	if other.invocations != 1 || other.targets == 0 || other.rollupBuilds != 2 || other.archived != 1 || other.messages == 0 {
		t.Fatalf("the other project's build before: %+v", other)
	}
	key, _ := e.archived(t, project, testID)
	d, err := archive.Delete(e.ctx, e.pool, e.store, e.eraser(), builds.DeleteRows, project, testID, nil)
	if err != nil {
		t.Fatal(err)
	}
	if d.Builds != 1 || d.Objects != 1 || d.Messages == 0 {
		t.Fatalf("deleted %+v", d)
	}
	if got := e.holds(t, project, testID); got != (holding{rollupBuilds: 1}) {
		t.Fatalf("the deleted build still holds %+v (rollups: want the other build's 1)", got)
	}
	if _, err := e.store.Get(e.ctx, key.Key); !errors.Is(err, bucket.ErrNotFound) {
		t.Fatalf("its object: %v", err)
	}
	if got := e.holds(t, tenant, testID); got != other {
		t.Fatalf("the other project's build of the same id: %+v, was %+v", got, other)
	}
	if got := e.holds(t, project, otherID); got.invocations != 1 || got.archived != 1 || got.messages == 0 {
		t.Fatalf("the project's other build: %+v", got)
	}

	var steps []string
	d, err = archive.Delete(e.ctx, e.pool, e.store, e.eraser(), builds.DeleteRows, project, "", func(s string) { steps = append(steps, s) })
	if err != nil {
		t.Fatal(err)
	}
	if d.Builds != 1 || d.Objects != 1 || len(steps) == 0 {
		t.Fatalf("project deleted %+v, progress %q", d, steps)
	}
	for _, table := range []string{"invocations", "targets", "tests", "hourly_rollups", "archived_builds"} {
		var n int
		e.pool.QueryRow(e.ctx, "select count(*) from "+table+" where project = $1", project).Scan(&n)
		if n != 0 {
			t.Errorf("%s keeps %d rows of the deleted project", table, n)
		}
	}
	if n := e.inStream(t, subjects.BESProjectFilter(project)); n != 0 {
		t.Errorf("the stream keeps %d messages of the deleted project", n)
	}
	if got := e.holds(t, tenant, testID); got != other {
		t.Fatalf("the other project after the delete of the project: %+v, was %+v", got, other)
	}
	if got := e.holds(t, tenant, otherID); got.invocations != 1 || got.archived != 1 || got.messages == 0 {
		t.Fatalf("the other project's second build: %+v", got)
	}
}
