package builds

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"maps"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams/projection"
)

// memArchive holds build objects' messages by key, in stream order, as
// archive.Objects hands them out; it counts the messages it hands out.
type memArchive struct {
	objects map[string][]*msg
	read    int
}

func (a *memArchive) Messages(_ context.Context, key string, fn func(projection.Message) error) error {
	ms, ok := a.objects[key]
	if !ok {
		return fmt.Errorf("bucket: no such object: %s", key)
	}
	for _, m := range ms {
		a.read++
		if err := fn(m); err != nil {
			return err
		}
	}
	return nil
}

func (a *memArchive) walk(key string) Messages {
	return func(fn func(projection.Message) error) error { return a.Messages(context.Background(), key, fn) }
}

// outputPages reads every page of the build through r.
type pageSet struct {
	size  OutputSize
	pages [2][][]byte
	whole [2][]byte
}

func readPages(t *testing.T, r OutputReader, project, id string) pageSet {
	t.Helper()
	ctx := context.Background()
	var ps pageSet
	var err error
	if ps.size, err = r.Sizes(ctx, project, id); err != nil {
		t.Fatal(err)
	}
	for i, n := range []int32{ps.size.StdoutPages, ps.size.StderrPages} {
		for p := range n {
			b, err := r.Page(ctx, project, id, int16(i+1), p)
			if err != nil {
				t.Fatalf("stream %d page %d: %v", i+1, p, err)
			}
			ps.pages[i] = append(ps.pages[i], b)
		}
		if _, err := r.Page(ctx, project, id, int16(i+1), n); !errors.Is(err, ErrNotFound) {
			t.Fatalf("stream %d page %d, past the end: %v, want ErrNotFound", i+1, n, err)
		}
	}
	if ps.whole[0], ps.whole[1], err = r.Output(ctx, project, id); err != nil {
		t.Fatal(err)
	}
	return ps
}

func (ps pageSet) equal(t *testing.T, what string, want pageSet) {
	t.Helper()
	if ps.size != want.size {
		t.Fatalf("%s: sizes %+v, want %+v", what, ps.size, want.size)
	}
	for i := range ps.pages {
		for p := range ps.pages[i] {
			if !bytes.Equal(ps.pages[i][p], want.pages[i][p]) {
				t.Fatalf("%s: stream %d page %d differs (%d bytes, want %d)", what, i+1, p, len(ps.pages[i][p]), len(want.pages[i][p]))
			}
		}
		if !bytes.Equal(ps.whole[i], want.whole[i]) {
			t.Fatalf("%s: stream %d whole: %d bytes, want %d", what, i+1, len(ps.whole[i]), len(want.whole[i]))
		}
	}
}

// move runs MoveOutput in a transaction and records what moved, as the
// archiver does.
func move(t *testing.T, pool *pgxpool.Pool, a *memArchive, key, id string, through uint64, moved [2]int64) OutputMove {
	t.Helper()
	ctx := context.Background()
	ms := a.objects[key]
	last := ms[len(ms)-1].seq
	var res OutputMove
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		var err error
		if res, err = MoveOutput(ctx, tx, ConsumerName, "acme", id, through, moved, a.walk(key)); err != nil || !res.Moved {
			return err
		}
		_, err = tx.Exec(ctx, `insert into archived_builds (invocation_id, project, object_key, dict_id, events, first_seq, last_seq,
			last_event_at, raw_bytes, stored_bytes, archived_at, output_seq, output_stdout_bytes, output_stderr_bytes)
			values ($1, 'acme', $2, 0, $3, $4, $5, now(), 0, 0, now(), $5, $6, $7)
			on conflict (invocation_id, project) do update set last_seq = excluded.last_seq, output_seq = excluded.output_seq,
			output_stdout_bytes = excluded.output_stdout_bytes, output_stderr_bytes = excluded.output_stderr_bytes`,
			id, key, len(ms), ms[0].seq, last, res.Bytes[0], res.Bytes[1])
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

func outputRows(t *testing.T, pool *pgxpool.Pool, id string) int {
	t.Helper()
	var n int
	if err := pool.QueryRow(context.Background(), `select (select count(*) from build_output_pages where invocation_id = $1)
		+ (select count(*) from build_output where invocation_id = $1)`, id).Scan(&n); err != nil {
		t.Fatal(err)
	}
	return n
}

// TestOutputFromTheArchive: a build's output moves into its object and
// reads from it page for page as PostgreSQL held it (sizes, every page,
// the whole); a page reads the object only up to it; a late event's output
// is the pages after the archived ones until a re-archive moves it too;
// without an archive the reads say where the output is.
func TestOutputFromTheArchive(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	b, _, _ := bigOutputBuild(s, "inv-big")
	b.toolAt(5, progressEv(5, "a resend the projector ignores\n", "")) // as the fold must
	applyAll(t, pool, p, s.msgs, 50)
	inPG := readPages(t, OutputReader{DB: pool}, "acme", "inv-big")
	if inPG.size.StdoutPages < 2 || inPG.size.StderrPages < 3 {
		t.Fatalf("the build's output is %+v: want pages enough to cut", inPG.size)
	}

	const key = "archive/builds/acme/inv-big.mrar"
	a := &memArchive{objects: map[string][]*msg{key: append([]*msg{}, s.msgs...)}}
	res := move(t, pool, a, key, "inv-big", 0, [2]int64{})
	if !res.Moved || res.Bytes != [2]int64{inPG.size.StdoutBytes, inPG.size.StderrBytes} {
		t.Fatalf("move: %+v, want moved with %+v", res, inPG.size)
	}
	if n := outputRows(t, pool, "inv-big"); n != 0 {
		t.Fatalf("%d output rows left in PostgreSQL after the move", n)
	}
	r := OutputReader{DB: pool, Archive: a}
	readPages(t, r, "acme", "inv-big").equal(t, "from the archive", inPG)

	// Page 0 of stderr reads the object up to it, not to its end.
	a.read = 0
	if _, err := r.Page(ctx, "acme", "inv-big", StreamStderr, 0); err != nil || a.read >= len(s.msgs)/2 {
		t.Fatalf("page 0 read %d of the object's %d messages (%v)", a.read, len(s.msgs), err)
	}
	// A page past the archived bytes reads no object at all.
	a.read = 0
	if _, err := r.Page(ctx, "acme", "inv-big", StreamStdout, inPG.size.StdoutPages); !errors.Is(err, ErrNotFound) || a.read != 0 {
		t.Fatalf("page past the end: %v after reading %d messages", err, a.read)
	}

	// No archive: sizes still read; a page says where the output is.
	if sz, err := OutputSizes(ctx, pool, "acme", "inv-big"); err != nil || sz != inPG.size {
		t.Fatalf("sizes without an archive: %+v, %v", sz, err)
	}
	if _, err := OutputPage(ctx, pool, "acme", "inv-big", StreamStdout, 0); !errors.Is(err, ErrNoArchive) || !strings.Contains(err.Error(), key) {
		t.Fatalf("a moved page without an archive: %v", err)
	}
	if _, _, err := Output(ctx, pool, "acme", "inv-big"); !errors.Is(err, ErrNoArchive) {
		t.Fatalf("moved output without an archive: %v", err)
	}
	// A missing object is an error naming the build and the key.
	_, err := OutputReader{DB: pool, Archive: &memArchive{}}.Page(ctx, "acme", "inv-big", StreamStderr, 0)
	if err == nil || !strings.Contains(err.Error(), key) || !strings.Contains(err.Error(), "inv-big") {
		t.Fatalf("a missing object: %v", err)
	}

	// A late event: the projector folds it into pages from 0, which read
	// after the archived output: the pages of the build projected
	// without a move.
	mark := len(s.msgs)
	b.tool(progressEv(5000, strings.Repeat("late stdout\n", 9000), "late stderr\n"))
	applyAll(t, pool, p, s.msgs[mark:], 10)
	if outputRows(t, pool, "inv-big") == 0 {
		t.Fatal("the late event's output is not in pages")
	}
	withLate := readPages(t, r, "acme", "inv-big")
	reset := func() {
		t.Helper()
		if _, err := pool.Exec(ctx, `truncate archived_builds`); err != nil {
			t.Fatal(err)
		}
		truncate(t, pool)
	}
	reset()
	applyAll(t, pool, p, s.msgs, 50)
	live := readPages(t, OutputReader{DB: pool}, "acme", "inv-big")
	liveDigest := digest(t, pool)
	withLate.equal(t, "a late event after the move", live)
	if live.size.StdoutBytes <= inPG.size.StdoutBytes+OutputPageBytes {
		t.Fatalf("the late output spans no page: %+v", live.size)
	}

	// Archived again with the late event, its pages move too.
	reset()
	applyAll(t, pool, p, s.msgs[:mark], 50)
	a.objects[key] = append([]*msg{}, s.msgs[:mark]...)
	res = move(t, pool, a, key, "inv-big", 0, [2]int64{})
	applyAll(t, pool, p, s.msgs[mark:], 10)
	a.objects[key] = append([]*msg{}, s.msgs...)
	res = move(t, pool, a, key, "inv-big", s.msgs[mark-1].seq, res.Bytes)
	if !res.Moved || outputRows(t, pool, "inv-big") != 0 {
		t.Fatalf("re-archived: %+v, %d rows left", res, outputRows(t, pool, "inv-big"))
	}
	readPages(t, r, "acme", "inv-big").equal(t, "re-archived", live)

	// Moved once more with a fragment, then brought back into pages (the
	// raw retention deletes the object): the rows of the build projected
	// without a move.
	reset()
	applyAll(t, pool, p, s.msgs[:mark], 50)
	a.objects[key] = append([]*msg{}, s.msgs[:mark]...)
	res = move(t, pool, a, key, "inv-big", 0, [2]int64{})
	applyAll(t, pool, p, s.msgs[mark:], 10)
	if err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		return RestoreOutput(ctx, tx, ConsumerName, "acme", "inv-big", s.msgs[mark-1].seq, res.Bytes, a.walk(key))
	}); err != nil {
		t.Fatal(err)
	}
	if got := digest(t, pool); !maps.Equal(got, liveDigest) {
		t.Fatalf("restored: digest differs from the build projected without a move:\n got %v\nwant %v", got, liveDigest)
	}
}

// TestMoveOutputRefuses: nothing moves while the projector has not
// applied the object's events, or has applied later ones, or the output is
// in scratch chunks; an object whose output differs from the rows (a
// scrubbed page) or a row of before pages longer than a page is refused
// with the reason, the rows untouched.
func TestMoveOutputRefuses(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	p := newProjector(t, Config{})
	s := newStream(t0)
	b, _, _ := bigOutputBuild(s, "inv-big")
	const key = "k"
	a := &memArchive{objects: map[string][]*msg{key: s.msgs}}

	applyAll(t, pool, p, s.msgs[:len(s.msgs)-3], 50) // the end not applied yet
	if res := move(t, pool, a, key, "inv-big", 0, [2]int64{}); !res.Pending {
		t.Fatalf("the projector behind the object: %+v, want pending", res)
	}
	applyAll(t, pool, p, s.msgs[len(s.msgs)-3:], 50)
	mark := len(s.msgs)
	b.tool(progressEv(5000, "late\n", ""))
	applyAll(t, pool, p, s.msgs[mark:], 50)
	if res := move(t, pool, a, key, "inv-big", 0, [2]int64{}); !res.Pending {
		t.Fatalf("a later event applied: %+v, want pending", res)
	}
	a.objects[key] = s.msgs
	before := digest(t, pool)
	if _, err := pool.Exec(ctx, `update build_output_pages set data = $1 where stream = 2 and page = 1`,
		compress(bytes.Repeat([]byte("*"), OutputPageBytes))); err != nil {
		t.Fatal(err)
	}
	scrubbed := digest(t, pool)
	if res := move(t, pool, a, key, "inv-big", 0, [2]int64{}); res.Moved || !strings.Contains(res.Differs, "stream 2") {
		t.Fatalf("a page that differs: %+v", res)
	}
	if res := move(t, pool, a, key, "inv-big", 0, [2]int64{1, 0}); res.Moved || res.Differs == "" {
		t.Fatalf("moved sizes the object does not hold: %+v", res)
	}
	if got := digest(t, pool); !maps.Equal(got, scrubbed) || maps.Equal(got, before) {
		t.Fatal("a refused move changed the rows")
	}

	// A build still running: its output is in scratch chunks.
	s2 := newStream(t0)
	r := s2.invocation("acme", "inv-run")
	r.attemptStarted()
	r.tool(startedEv("inv-run", s2.now))
	r.tool(progressEv(1, "running\n", ""))
	applyAll(t, pool, p, s2.msgs, 50)
	a.objects["r"] = s2.msgs
	if res := move(t, pool, a, "r", "inv-run", 0, [2]int64{}); !res.Pending {
		t.Fatalf("output in chunks: %+v, want pending", res)
	}

	// Folded before pages, one row longer than a page.
	truncate(t, pool)
	s3 := newStream(t0)
	o := s3.invocation("acme", "inv-old")
	o.tool(startedEv("inv-old", s3.now))
	o.tool(progressEv(1, strings.Repeat("x", OutputPageBytes+1), ""))
	o.tool(finishedEv(0, "SUCCESS", s3.now))
	o.finishStream()
	applyAll(t, pool, p, s3.msgs, 50)
	if _, err := pool.Exec(ctx, `delete from build_output_pages`); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `insert into build_output (invocation_id, project, stdout, stderr, stdout_bytes, stderr_bytes)
		values ('inv-old', 'acme', $1, $2, $3, 0)`, compress([]byte(strings.Repeat("x", OutputPageBytes+1))), compress(nil), OutputPageBytes+1); err != nil {
		t.Fatal(err)
	}
	a.objects["o"] = s3.msgs
	if res := move(t, pool, a, "o", "inv-old", 0, [2]int64{}); res.Moved || !strings.Contains(res.Differs, "before pages") {
		t.Fatalf("a legacy row over a page: %+v", res)
	}
	if outputRows(t, pool, "inv-old") != 1 {
		t.Fatal("the legacy row was touched")
	}
}

// TestOutputReadsUseTheIndex: a page, and the whole output, read the
// build's pages by build_output_pages' primary key, and its
// archived_builds row by archived_builds' (a build whose output has moved
// or not).
func TestOutputReadsUseTheIndex(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	exec := func(sql string, args ...any) {
		if _, err := pool.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	exec(`insert into build_output_pages (invocation_id, project, stream, page, bytes, data)
		select 'inv-' || b, 'acme', s, p, 65536, '\x00' from generate_series(1, 2) s, generate_series(0, 999) p, generate_series(0, 20) b`)
	exec(`insert into archived_builds (invocation_id, project, object_key, dict_id, events, first_seq, last_seq,
		last_event_at, raw_bytes, stored_bytes, archived_at, output_seq, output_stdout_bytes, output_stderr_bytes)
		select 'inv-' || b, 'acme', 'k' || b, 0, 1, 1, 1, now(), 0, 0, now(), case when b % 2 = 0 then 1 end, 100000, 5
		from generate_series(0, 20000) b`)
	exec(`analyze build_output_pages`)
	exec(`analyze archived_builds`)
	for _, c := range []struct {
		name, sql string
		args      []any
	}{
		{"page, moved", sqlOutputPage, []any{"inv-2", "acme", int16(1), int32(7), OutputPageBytes}},
		{"page, in PostgreSQL", sqlOutputPage, []any{"inv-3", "acme", int16(2), int32(7), OutputPageBytes}},
		{"whole", sqlOutputAll, []any{"inv-3", "acme"}},
		{"sizes", sqlOutputSize, []any{"inv-2", "acme"}},
	} {
		var raw []byte
		if err := pool.QueryRow(ctx, "explain (format json) "+c.sql, c.args...).Scan(&raw); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		s := string(raw)
		for _, idx := range []string{"build_output_pages_pkey", "archived_builds_pkey"} {
			if !strings.Contains(s, `"Index Name": "`+idx+`"`) {
				t.Errorf("%s: the plan does not use %s: %s", c.name, idx, s)
			}
		}
		if strings.Contains(s, "Seq Scan") {
			t.Errorf("%s: the plan scans a table: %s", c.name, s)
		}
	}
}
