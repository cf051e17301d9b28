package archive_test

import (
	"context"
	"errors"
	"io"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

func TestMain(m *testing.M) {
	code := m.Run()
	testenv.DropTemplate()
	os.Exit(code)
}

// flaky is a bucket that fails every operation while down is set: an
// outage of the store.
type flaky struct {
	*bucket.Bucket
	down atomic.Bool
}

var errDown = errors.New("bucket down")

func (f *flaky) Get(ctx context.Context, key string) ([]byte, error) {
	if f.down.Load() {
		return nil, errDown
	}
	return f.Bucket.Get(ctx, key)
}

func (f *flaky) NewWriter(ctx context.Context, key string) (*bucket.Writer, error) {
	if f.down.Load() {
		return nil, errDown
	}
	return f.Bucket.NewWriter(ctx, key)
}

func (f *flaky) NewReader(ctx context.Context, key string) (io.ReadCloser, error) {
	if f.down.Load() {
		return nil, errDown
	}
	return f.Bucket.NewReader(ctx, key)
}

type env struct {
	ctx   context.Context
	url   string
	pool  *pgxpool.Pool
	js    jetstream.JetStream
	src   streams.SubjectReader
	store *flaky
}

func newEnv(t *testing.T) *env {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	pool, url := testenv.Pool(t)
	nc, err := nats.Connect(testenv.NATS(t).ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, _ := jetstream.New(nc)
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	s, err := js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	bk, err := bucket.Open(ctx, "file://"+t.TempDir()+"/bucket")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bk.Close() })
	return &env{ctx: ctx, url: url, pool: pool, js: js, src: streams.SubjectReader{Stream: s}, store: &flaky{Bucket: bk}}
}

// publish stores a recorded build's messages on its subject, as the edge
// would, and returns the last one's sequence.
func (e *env) publish(t *testing.T, b archive.Build) uint64 {
	t.Helper()
	var last uint64
	for _, m := range b.Messages {
		ack, err := e.js.PublishMsg(e.ctx, &nats.Msg{Subject: m.SubjectName, Header: nats.Header(m.Headers), Data: m.Payload})
		if err != nil {
			t.Fatal(err)
		}
		last = ack.Sequence
	}
	return last
}

// finished makes the build's invocations row, as the projector leaves a
// finished build whose last event was stored ago.
func (e *env) finished(t *testing.T, project, id string, ago time.Duration, events, lastSeq int) {
	t.Helper()
	_, err := e.pool.Exec(e.ctx, `
insert into invocations (id, project, status, stream_done, first_event_at, last_event_at, last_event_bucket, event_count, last_sequence)
values ($1, $2, 'failed', true, now() - $3::interval, now() - $3::interval,
        date_bin('5 minutes', now() - $3::interval, timestamptz '2000-01-01 00:00:00+00'), $4, $5)
on conflict (id, project) do update set last_event_at = excluded.last_event_at, last_event_bucket = excluded.last_event_bucket,
    event_count = excluded.event_count, last_sequence = excluded.last_sequence`,
		id, project, ago.String(), events, lastSeq)
	if err != nil {
		t.Fatal(err)
	}
}

type archivedRow struct {
	Events, LastSeq int64
	Key             string
}

func (e *env) archived(t *testing.T, project, id string) (archivedRow, bool) {
	t.Helper()
	var r archivedRow
	err := e.pool.QueryRow(e.ctx, `select events, last_seq, object_key from archived_builds where project = $1 and invocation_id = $2`,
		project, id).Scan(&r.Events, &r.LastSeq, &r.Key)
	if err != nil {
		return r, false
	}
	return r, true
}

const (
	project = "millrace-fixtures"
	testID  = "ea8ce61d-03a8-4221-bbab-4581a0acff79"
)

// tools counts a recorded build's tool events as the projector does.
func tools(b archive.Build) (n, last int) {
	for _, m := range b.Messages {
		if m.Header("Millrace-Kind") == "tool" {
			n++
			last = max(last, atoiOr(m.Header("Millrace-Sequence")))
		}
	}
	return n, last
}

func atoiOr(s string) int {
	n := 0
	for _, c := range s {
		n = n*10 + int(c-'0')
	}
	return n
}

// TestArchiverAfterDelay: a finished build is archived once its last
// event is After old, not before; the object holds the stream's messages;
// late events re-archive it whole; verify finds it good.
func TestArchiverAfterDelay(t *testing.T) {
	e := newEnv(t)
	b := invocation(t, "bazel-test-60.besrec")
	last := e.publish(t, b)
	n, lastTool := tools(b)
	e.finished(t, project, testID, 5*time.Minute, n, lastTool)
	a, err := archive.New(archive.Config{After: 10 * time.Minute}, e.pool, e.store, e.src, nil)
	if err != nil {
		t.Fatal(err)
	}
	if found, _, err := a.Pass(e.ctx); err != nil || found != 0 {
		t.Fatalf("a build finished 5m ago: %d due, %v", found, err)
	}
	if ok, _ := e.store.Exists(e.ctx, archive.BuildKey(project, testID)); ok {
		t.Fatal("archived before the delay")
	}
	e.finished(t, project, testID, 11*time.Minute, n, lastTool)
	if found, _, err := a.Pass(e.ctx); err != nil || found != 1 {
		t.Fatalf("a build finished 11m ago: %d archived, %v", found, err)
	}
	row, ok := e.archived(t, project, testID)
	if !ok || row.Events != int64(len(b.Messages)) || row.LastSeq != int64(last) || row.Key != archive.BuildKey(project, testID) {
		t.Fatalf("archived_builds: %+v (%v); want %d events up to %d", row, ok, len(b.Messages), last)
	}
	if found, _, _ := a.Pass(e.ctx); found != 0 {
		t.Fatalf("an archived build is due again: %d", found)
	}
	verify(t, e, 0)

	// A late event: the build is archived again, whole.
	late := archive.Build{Messages: b.Messages[len(b.Messages)-1:]}
	late.Messages[0].Headers["Nats-Msg-Id"] = []string{"late"}
	last = e.publish(t, late)
	e.finished(t, project, testID, 10*time.Minute+time.Second, n, lastTool)
	if found, _, err := a.Pass(e.ctx); err != nil || found != 1 {
		t.Fatalf("after a late event: %d archived, %v", found, err)
	}
	if row, _ := e.archived(t, project, testID); row.Events != int64(len(b.Messages)+1) || row.LastSeq != int64(last) {
		t.Fatalf("re-archived: %+v, want %d events up to %d", row, len(b.Messages)+1, last)
	}
}

func verify(t *testing.T, e *env, wantBad int) []archive.Finding {
	t.Helper()
	var fs []archive.Finding
	sum, err := archive.Verify(e.ctx, e.pool, e.store, e.src, archive.VerifyOptions{}, func(f archive.Finding) { fs = append(fs, f) })
	if err != nil {
		t.Fatal(err)
	}
	if sum.Bad != wantBad || sum.Builds == 0 {
		t.Fatalf("verify: %+v, findings %+v; want %d bad", sum, fs, wantBad)
	}
	return fs
}

// TestArchiverResumesAfterCrash: an object written by an archiver that
// died before it recorded the build (here: half an object at the key, no
// row) is written again, whole, and recorded.
func TestArchiverResumesAfterCrash(t *testing.T) {
	e := newEnv(t)
	b := invocation(t, "bazel-test-60.besrec")
	e.publish(t, b)
	n, lastTool := tools(b)
	e.finished(t, project, testID, time.Hour, n, lastTool)
	key := archive.BuildKey(project, testID)
	obj := encode(t, b.Messages, nil)
	if err := e.store.Put(e.ctx, key, obj[:len(obj)/2]); err != nil {
		t.Fatal(err)
	}
	a, _ := archive.New(archive.Config{}, e.pool, e.store, e.src, nil)
	if found, _, err := a.Pass(e.ctx); err != nil || found != 1 {
		t.Fatalf("pass: %d, %v", found, err)
	}
	if st, err := archive.ReadStats(e.ctx, e.store, archive.NewDicts(e.store), key); err != nil || st.Messages != uint64(len(b.Messages)) {
		t.Fatalf("object after the resumed archive: %+v, %v", st, err)
	}
	verify(t, e, 0)
}

// TestArchiverBucketOutage: while the bucket fails, archiving pauses (the
// paused gauge, failures by reason bucket) and the stream takes events;
// once the bucket is back, the build is archived.
func TestArchiverBucketOutage(t *testing.T) {
	e := newEnv(t)
	b := invocation(t, "bazel-build-10.besrec")
	e.publish(t, b)
	n, lastTool := tools(b)
	e.finished(t, project, "4132743f-f8c2-4341-90c8-70e094d45b16", time.Hour, n, lastTool)
	reg := prometheus.NewRegistry()
	m := archive.NewMetrics(reg)
	e.store.down.Store(true)
	a, _ := archive.New(archive.Config{Interval: 50 * time.Millisecond, MaxPause: 100 * time.Millisecond}, e.pool, e.store, e.src, m)
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() { cancel(); <-done }()
	gauge := func(name string) float64 {
		mfs, _ := reg.Gather()
		for _, mf := range mfs {
			if mf.GetName() == name {
				return mf.GetMetric()[0].GetGauge().GetValue()
			}
		}
		return -1
	}
	poll.Until(t, "archiving paused", func() bool { return gauge("millrace_archive_paused") == 1 })
	if gauge("millrace_archive_oldest_pending_seconds") < 3600 {
		t.Fatalf("oldest pending: %v s, want an hour", gauge("millrace_archive_oldest_pending_seconds"))
	}
	// Ingest goes on: the stream takes a build's events.
	other := invocation(t, "bazel-test-60.besrec")
	e.publish(t, other)
	e.store.down.Store(false)
	poll.Until(t, "the build archived once the bucket is back", func() bool {
		_, ok := e.archived(t, project, "4132743f-f8c2-4341-90c8-70e094d45b16")
		return ok && gauge("millrace_archive_paused") == 0
	})
	if f := failures(t, reg, "bucket"); f < 1 {
		t.Fatalf("failures{reason=bucket} = %v", f)
	}
}

// failures is millrace_archive_failures_total{reason}.
func failures(t *testing.T, reg *prometheus.Registry, reason string) float64 {
	t.Helper()
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			if mf.GetName() == "millrace_archive_failures_total" && m.GetLabel()[0].GetValue() == reason {
				return m.GetCounter().GetValue()
			}
		}
	}
	t.Fatalf("no failures{reason=%q}", reason)
	return 0
}

// TestVerifyCatchesTampering: an object changed in the bucket (another
// build's events in its place, and then a flipped byte) is reported bad
// with its build.
func TestVerifyCatchesTampering(t *testing.T) {
	e := newEnv(t)
	b := invocation(t, "bazel-test-60.besrec")
	e.publish(t, b)
	n, lastTool := tools(b)
	e.finished(t, project, testID, time.Hour, n, lastTool)
	a, _ := archive.New(archive.Config{}, e.pool, e.store, e.src, nil)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	key := archive.BuildKey(project, testID)
	// Same sequences, one event's data changed: decodes fine, differs
	// from the stream.
	orig, _ := e.store.Get(e.ctx, key)
	read := readAll(t, e, key)
	read[3].Payload = append([]byte{}, read[3].Payload...)
	read[3].Payload[0] ^= 1
	if err := e.store.Put(e.ctx, key, encode(t, read, nil)); err != nil {
		t.Fatal(err)
	}
	fs := verify(t, e, 1)
	if fs[0].Invocation != testID || fs[0].Error == "" {
		t.Fatalf("finding: %+v", fs[0])
	}
	t.Logf("tampered data: %s", fs[0].Error)
	e.store.Put(e.ctx, key, flip(orig, len(orig)/2))
	// A flipped byte: the stream comparison or zstd's and the trailer's
	// checksums catch it, whichever comes first.
	fs = verify(t, e, 1)
	if fs[0].Error == "" {
		t.Fatalf("flipped byte: %+v", fs[0])
	}
	if _, err := archive.ReadStats(e.ctx, e.store, archive.NewDicts(e.store), key); !errors.Is(err, archive.ErrCorrupt) {
		t.Fatalf("flipped byte, read alone: %v; want ErrCorrupt", err)
	}
	var verr string
	e.pool.QueryRow(e.ctx, `select verify_error from archived_builds`).Scan(&verr)
	if verr == "" {
		t.Fatal("the verdict is not recorded")
	}
}

func readAll(t *testing.T, e *env, key string) []*archive.Message {
	t.Helper()
	obj, err := e.store.Get(e.ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	msgs, _, err := decode(obj, archive.NewDicts(e.store).Loader(e.ctx))
	if err != nil {
		t.Fatal(err)
	}
	return msgs
}

// TestArchiverBuildGone: a finished build the stream no longer holds (past
// its age limit) is recorded with no object, once, and counted.
func TestArchiverBuildGone(t *testing.T) {
	e := newEnv(t)
	e.finished(t, project, "gone", time.Hour, 10, 10)
	reg := prometheus.NewRegistry()
	a, _ := archive.New(archive.Config{}, e.pool, e.store, e.src, archive.NewMetrics(reg))
	if found, _, err := a.Pass(e.ctx); err != nil || found != 1 {
		t.Fatalf("pass: %d, %v", found, err)
	}
	row, ok := e.archived(t, project, "gone")
	if !ok || row.Key != "" || row.Events != 0 {
		t.Fatalf("archived_builds: %+v, %v; want a row with no object", row, ok)
	}
	if found, _, _ := a.Pass(e.ctx); found != 0 {
		t.Fatalf("a build gone from the stream is due again")
	}
	if f := failures(t, reg, "gone"); f != 1 {
		t.Fatalf("failures{reason=gone} = %v", f)
	}
	if ok, _ := e.store.Exists(e.ctx, archive.BuildKey(project, "gone")); ok {
		t.Fatal("an empty object was stored")
	}
}

// looks counts the archiver's looks for builds: the statements on a pool
// that read invocations as the archiver's due and upcoming builds do.
type looks struct{ n atomic.Int64 }

func (l *looks) TraceQueryStart(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	if strings.Contains(d.SQL, "from invocations i") {
		l.n.Add(1)
	}
	return ctx
}

func (*looks) TraceQueryEnd(context.Context, *pgx.Conn, pgx.TraceQueryEndData) {}

// tracedPool opens a second pool on e's database whose statements tr sees.
func tracedPool(t *testing.T, url string, tr pgx.QueryTracer) *pgxpool.Pool {
	t.Helper()
	cfg, err := pgxpool.ParseConfig(url)
	if err != nil {
		t.Fatal(err)
	}
	cfg.ConnConfig.Tracer = tr
	pool, err := pgxpool.NewWithConfig(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(pool.Close)
	return pool
}

// TestArchiverIdleLooksWhenDue: an archiver with nothing due does not ask
// PostgreSQL every Interval: it looks once, sleeps until the build it saw
// is due, and archives it then, in two looks where an archiver looking
// every Interval (10 ms here) makes a hundred.
func TestArchiverIdleLooksWhenDue(t *testing.T) {
	e := newEnv(t)
	var l looks
	pool := tracedPool(t, e.url, &l)
	b := invocation(t, "bazel-test-60.besrec")
	e.publish(t, b)
	n, lastTool := tools(b)
	const after = time.Hour
	e.finished(t, project, testID, after-time.Second, n, lastTool) // due in a second
	a, err := archive.New(archive.Config{After: after, Interval: 10 * time.Millisecond}, pool, e.store, e.src, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() { cancel(); <-done }()
	poll.Until(t, "the build archived once due", func() bool {
		_, ok := e.archived(t, project, testID)
		return ok
	})
	// Each look asks for the builds due and for the next one to be.
	if got := l.n.Load(); got > 4 {
		t.Fatalf("%d statements looked for builds before the one build was archived; want 2 looks (4)", got)
	}
	if ok, _ := e.store.Exists(e.ctx, archive.BuildKey(project, testID)); !ok {
		t.Fatal("no object")
	}
}

// TestArchiverLooksEveryAfterForBuildsUnseen: a build projected already
// due after the archiver's last look (the projector was behind, or its
// sweep abandoned the build) is archived by the look After later.
func TestArchiverLooksEveryAfterForBuildsUnseen(t *testing.T) {
	e := newEnv(t)
	var l looks
	pool := tracedPool(t, e.url, &l)
	a, err := archive.New(archive.Config{After: 200 * time.Millisecond, Interval: 10 * time.Millisecond}, pool, e.store, e.src, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(e.ctx)
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() { cancel(); <-done }()
	poll.Until(t, "the first look", func() bool { return l.n.Load() >= 2 })
	b := invocation(t, "bazel-test-60.besrec")
	e.publish(t, b)
	n, lastTool := tools(b)
	e.finished(t, project, testID, time.Hour, n, lastTool)
	poll.Until(t, "the build archived by a later look", func() bool {
		_, ok := e.archived(t, project, testID)
		return ok
	})
}
