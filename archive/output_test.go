package archive_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"maps"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/klauspost/compress/zstd"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/schemas/bep"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// mover is the builds projection's side of moving console output, adapted
// as cmd/millrace adapts it.
type mover struct{}

func (mover) MoveOutput(ctx context.Context, tx pgx.Tx, b archive.OutputBuild, msgs archive.Messages) (archive.OutputMoved, error) {
	r, err := builds.MoveOutput(ctx, tx, builds.ConsumerName, b.Project, b.ID, b.Through, b.Moved, builds.Messages(msgs))
	return archive.OutputMoved{Moved: r.Moved, Pending: r.Pending, Bytes: r.Bytes, Differs: r.Differs}, err
}

func (mover) RestoreOutput(ctx context.Context, tx pgx.Tx, b archive.OutputBuild, msgs archive.Messages) error {
	return builds.RestoreOutput(ctx, tx, builds.ConsumerName, b.Project, b.ID, b.Through, b.Moved, builds.Messages(msgs))
}

// output is everything a reader gets of a build's console output.
type output struct {
	size  builds.OutputSize
	pages [2][][]byte
	whole [2][]byte
}

func readOutput(t *testing.T, r builds.OutputReader, id string) output {
	t.Helper()
	ctx := context.Background()
	var o output
	var err error
	if o.size, err = r.Sizes(ctx, project, id); err != nil {
		t.Fatal(err)
	}
	for i, n := range []int32{o.size.StdoutPages, o.size.StderrPages} {
		for p := range n {
			b, err := r.Page(ctx, project, id, int16(i+1), p)
			if err != nil {
				t.Fatalf("%s stream %d page %d: %v", id, i+1, p, err)
			}
			o.pages[i] = append(o.pages[i], b)
		}
	}
	if o.whole[0], o.whole[1], err = r.Output(ctx, project, id); err != nil {
		t.Fatal(err)
	}
	return o
}

func (o output) same(t *testing.T, what string, want output) {
	t.Helper()
	if o.size != want.size || len(o.whole[0])+len(o.whole[1]) == 0 {
		t.Fatalf("%s: sizes %+v, want %+v", what, o.size, want.size)
	}
	for i := range o.pages {
		for p := range o.pages[i] {
			if !bytes.Equal(o.pages[i][p], want.pages[i][p]) {
				t.Fatalf("%s: stream %d page %d differs", what, i+1, p)
			}
		}
		if !bytes.Equal(o.whole[i], want.whole[i]) {
			t.Fatalf("%s: stream %d: %d bytes, want %d", what, i+1, len(o.whole[i]), len(want.whole[i]))
		}
	}
}

// outputEnv is replayEnv with the builds' output as PostgreSQL held it.
type outputEnv struct {
	*replayEnv
	inPG map[string]output
}

var buildIDs = []string{testID, "4132743f-f8c2-4341-90c8-70e094d45b16"}

func newOutputEnv(t *testing.T, withDict bool) *outputEnv {
	e := &outputEnv{replayEnv: newReplayEnv(t), inPG: map[string]output{}}
	for _, id := range buildIDs {
		e.inPG[id] = readOutput(t, builds.OutputReader{DB: e.pool}, id)
	}
	if withDict {
		bs := []archive.Build{e.first, e.second}
		if _, err := archive.NewDicts(e.store).Save(e.ctx, func(id uint32) ([]byte, error) {
			return archive.Train(bs, id, 0, zstd.SpeedDefault)
		}); err != nil {
			t.Fatal(err)
		}
	}
	return e
}

func (e *outputEnv) archiver(t *testing.T) *archive.Archiver {
	t.Helper()
	a, err := archive.New(archive.Config{After: time.Millisecond, Logger: slog.New(slog.DiscardHandler)}, e.pool, e.store, e.src, nil)
	if err != nil {
		t.Fatal(err)
	}
	return a.MoveOutputWith(mover{})
}

func (e *outputEnv) outputRows(t *testing.T) int {
	t.Helper()
	var n int
	if err := e.pool.QueryRow(e.ctx, `select (select count(*) from build_output_pages) + (select count(*) from build_output)`).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// moved is what archived_builds records of the builds' moved output.
func (e *outputEnv) moved(t *testing.T) map[string]string {
	t.Helper()
	rows, err := e.pool.Query(e.ctx, `select invocation_id, concat_ws(' ', last_seq, coalesce(output_seq::text, '-'),
		coalesce(output_stdout_bytes::text, '-'), coalesce(output_stderr_bytes::text, '-'), coalesce(output_error, '-'))
		from archived_builds`)
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]string{}
	var id, v string
	if _, err := pgx.ForEachRow(rows, []any{&id, &v}, func() error { m[id] = v; return nil }); err != nil {
		t.Fatal(err)
	}
	return m
}

// TestArchiverMovesOutput: once archived, a build's console output leaves
// PostgreSQL and reads from its object, page for page and byte for byte as
// PostgreSQL held it (the object written with a dictionary, the build's
// events trimmed from the stream or not); without the bucket the reads
// say where the output is; a missing object or dictionary is an error
// naming the build and the object or the dictionary.
func TestArchiverMovesOutput(t *testing.T) {
	e := newOutputEnv(t, true)
	if e.outputRows(t) == 0 {
		t.Fatal("the fixtures have no console output")
	}
	t.Logf("output in PostgreSQL: %+v and %+v", e.inPG[buildIDs[0]].size, e.inPG[buildIDs[1]].size)
	a := e.archiver(t)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	if n := e.outputRows(t); n != 0 {
		t.Fatalf("%d output rows left in PostgreSQL after archiving", n)
	}
	for id, m := range e.moved(t) {
		f := strings.Fields(m)
		if f[0] != f[1] || f[4] != "-" {
			t.Fatalf("%s: archived_builds says %s, want its output moved up to its last message", id, m)
		}
	}
	s, _ := e.js.Stream(e.ctx, subjects.StreamBES)
	row, _ := e.archived(t, project, testID)
	if err := streams.TrimSubject(e.ctx, s, subjects.BES(project, testID), uint64(row.LastSeq)); err != nil {
		t.Fatal(err)
	}
	r := builds.OutputReader{DB: e.pool, Archive: archive.NewObjects(e.store)}
	for _, id := range buildIDs {
		readOutput(t, r, id).same(t, id+" from the archive", e.inPG[id])
	}
	if found, _, err := a.Pass(e.ctx); err != nil || found != 0 {
		t.Fatalf("a second pass: %d, %v; want nothing to do", found, err)
	}

	key := archive.BuildKey(project, testID)
	if _, err := builds.OutputPage(e.ctx, e.pool, project, testID, builds.StreamStderr, 0); !errors.Is(err, builds.ErrNoArchive) || !strings.Contains(err.Error(), key) {
		t.Fatalf("no archive: %v", err)
	}
	// The dictionary gone: the error names it.
	d, err := archive.NewDicts(e.store).Current(e.ctx)
	if err != nil || d == nil {
		t.Fatalf("current dictionary: %v, %v", d, err)
	}
	if err := e.store.Delete(e.ctx, archive.DictKey(d.ID)); err != nil {
		t.Fatal(err)
	}
	_, err = builds.OutputReader{DB: e.pool, Archive: archive.NewObjects(e.store)}.Page(e.ctx, project, testID, builds.StreamStderr, 0)
	if !errors.Is(err, archive.ErrDictMissing) || !strings.Contains(err.Error(), strconv.Itoa(int(d.ID))) || !strings.Contains(err.Error(), testID) {
		t.Fatalf("a missing dictionary: %v", err)
	}
	// The object gone: the error names the build and the key.
	if err := e.store.Delete(e.ctx, key); err != nil {
		t.Fatal(err)
	}
	_, err = r.Page(e.ctx, project, testID, builds.StreamStderr, 0)
	if err == nil || !strings.Contains(err.Error(), key) || !strings.Contains(err.Error(), testID) {
		t.Fatalf("a missing object: %v", err)
	}
	t.Logf("a missing object: %v", err)
}

// lateProgress is a progress event of b with output, sent again as the
// build's next tool event after its end.
func lateProgress(t *testing.T, b archive.Build) (m *archive.Message, stdout, stderr string) {
	t.Helper()
	_, last := tools(b)
	for _, src := range b.Messages {
		var obe buildpb.OrderedBuildEvent
		if proto.Unmarshal(src.Payload, &obe) != nil || obe.GetEvent().GetBazelEvent() == nil {
			continue
		}
		var be bep.BuildEvent
		if proto.Unmarshal(obe.GetEvent().GetBazelEvent().GetValue(), &be) != nil || be.GetProgress() == nil {
			continue
		}
		if p := be.GetProgress(); p.GetStdout()+p.GetStderr() != "" {
			obe.SequenceNumber = int64(last + 1)
			data, err := proto.Marshal(&obe)
			if err != nil {
				t.Fatal(err)
			}
			h := maps.Clone(src.Headers)
			h[envelope.Sequence] = []string{strconv.Itoa(last + 1)}
			h[envelope.MsgID] = []string{"late-progress"}
			return &archive.Message{SubjectName: src.SubjectName, Headers: h, Payload: data}, p.GetStdout(), p.GetStderr()
		}
	}
	t.Fatal("no progress event with output")
	return nil, "", ""
}

// catchUp runs the projector until it has applied the whole stream.
func (e *outputEnv) catchUp(t *testing.T) {
	t.Helper()
	r, err := streams.NewRunner(e.js, e.pool, e.proj, e.rc, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx) }()
	defer func() { cancel(); <-done }()
	last := e.lastSeq(t)
	poll.Until(t, "the projector caught up", func() bool {
		var pos int64
		e.pool.QueryRow(e.ctx, "select coalesce(max(stream_seq), 0) from consumer_positions where consumer = $1", builds.ConsumerName).Scan(&pos)
		return uint64(pos) >= last
	}, poll.Within(time.Minute))
}

// TestArchiverMovesLateOutput: a late event of a build whose output has
// moved is folded into pages that read after the archived output; once the
// build is archived again they move too, and the reads stay the same.
func TestArchiverMovesLateOutput(t *testing.T) {
	e := newOutputEnv(t, false)
	a := e.archiver(t)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	id := buildIDs[1]
	late, o, errOut := lateProgress(t, e.second)
	e.publish(t, archive.Build{Messages: []*archive.Message{late}})
	e.catchUp(t)
	if e.outputRows(t) == 0 {
		t.Fatal("the late event's output is not in pages")
	}
	r := builds.OutputReader{DB: e.pool, Archive: archive.NewObjects(e.store)}
	got := readOutput(t, r, id)
	want := e.inPG[id]
	if string(got.whole[0]) != string(want.whole[0])+o || string(got.whole[1]) != string(want.whole[1])+errOut {
		t.Fatalf("output with a late event: %d and %d bytes, want %d+%d and %d+%d",
			len(got.whole[0]), len(got.whole[1]), len(want.whole[0]), len(o), len(want.whole[1]), len(errOut))
	}
	before := e.moved(t)[id]
	// The archiver takes the build again (its last event is newer than its
	// object), and its late output with it.
	poll.Until(t, "the late output moved", func() bool {
		if _, _, err := a.Pass(e.ctx); err != nil {
			t.Fatal(err)
		}
		return e.outputRows(t) == 0
	})
	if after := e.moved(t)[id]; after == before || strings.Fields(after)[0] != strings.Fields(after)[1] {
		t.Fatalf("archived_builds after the re-archive: %s (before %s)", after, before)
	}
	readOutput(t, r, id).same(t, "re-archived", got)
}

// TestReplayMovesOutputAgain: a replay folds the archived builds' output
// into pages again and forgets that it moved; the archiver moves it again,
// and the projection and archived_builds end as the live run left them.
// The raw retention brings moved output back into pages before it deletes
// the object, as the build's rows stay.
func TestReplayMovesOutputAgain(t *testing.T) {
	e := newOutputEnv(t, false)
	a := e.archiver(t)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	live, liveMoved := e.digest(t), e.moved(t)
	e.replay(t, archive.ReplayOptions{})
	if e.outputRows(t) == 0 {
		t.Fatal("the replay folded no output into pages")
	}
	if got := e.digest(t); !maps.Equal(got, e.live) {
		t.Fatalf("after the replay, before the moves:\n got %v\nwant %v", got, e.live)
	}
	if n, _, err := a.MoveOutputs(e.ctx); err != nil || n != 2 {
		t.Fatalf("moves after the replay: %d, %v", n, err)
	}
	if got := e.digest(t); !maps.Equal(got, live) {
		t.Fatalf("after the replay and the moves:\n got %v\nwant %v", got, live)
	}
	if got := e.moved(t); !maps.Equal(got, liveMoved) {
		t.Fatalf("archived_builds after the replay and the moves:\n got %v\nwant %v", got, liveMoved)
	}

	// Raw retention: refused without a way to bring the output back, then
	// the output is back in pages, as projected live, and the object gone.
	raw := archive.NewRawExpirer(e.pool, e.store, streams.SubjectTrimmer{Stream: e.src.Stream})
	if _, err := raw.ExpireRaw(e.ctx, project, time.Now().Add(time.Hour), 2); err == nil || !strings.Contains(err.Error(), "console output") {
		t.Fatalf("raw retention of moved output, nothing to bring it back: %v", err)
	}
	raw.RestoreOutputWith(mover{}, e.store)
	if n, err := raw.ExpireRaw(e.ctx, project, time.Now().Add(time.Hour), 2); err != nil || n != 2 {
		t.Fatalf("raw retention: %d, %v", n, err)
	}
	if got := e.digest(t); !maps.Equal(got, e.live) {
		t.Fatalf("after the raw retention:\n got %v\nwant %v", got, e.live)
	}
	for _, id := range buildIDs {
		if ok, _ := e.store.Exists(e.ctx, archive.BuildKey(project, id)); ok {
			t.Fatalf("%s: the object is still there", id)
		}
		readOutput(t, builds.OutputReader{DB: e.pool}, id).same(t, id+" after the raw retention", e.inPG[id])
	}
	if n, _, err := a.MoveOutputs(e.ctx); err != nil || n != 0 {
		t.Fatalf("moves after the raw retention: %d, %v", n, err)
	}
}
