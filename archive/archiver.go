package archive

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/klauspost/compress/zstd"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/backoff"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/knob"
	"github.com/millrace/millrace/subjects"
)

// Defaults of Config.
const (
	DefaultAfter    = 10 * time.Minute
	DefaultInterval = 30 * time.Second
	DefaultBatch    = 100
	DefaultLookback = 30 * 24 * time.Hour
	DefaultMaxPause = time.Minute
	// Level is the compression level of build objects: zstd's "better",
	// 2-3% smaller objects than its default on the recorded builds at no
	// more CPU once encoders are reused (BenchmarkArchiveBuild: 4.3 ms per
	// 517-event build written and read back, against 4.7 ms).
	Level = zstd.SpeedBetterCompression
)

// Config tunes the archiver.
type Config struct {
	// Layout is how the backbone keeps build events (set by the caller,
	// not a flag: the backbone's).
	Layout subjects.BESLayout
	// After is how long a finished build's last event must be stored
	// before it is archived, so that late events (Bazel's retries, the
	// lifecycle's end) are in. Zero: DefaultAfter; negative: never archive.
	After time.Duration
	// Interval is the least time between two looks for builds to
	// archive once a look found less than a batch (a full batch: the next
	// look is at once), and how often trimming is tried again while
	// archived builds wait for a holder. Between looks the archiver
	// sleeps until the next build it knows of is due, and looks at least
	// every After for those it could not know of (Run). Zero:
	// DefaultInterval.
	Interval time.Duration
	// Batch is the most builds one look takes. Zero: DefaultBatch.
	Batch int
	// Lookback is how far back the archiver looks: builds whose last
	// event is older are not looked at (their events are past the BES
	// stream's age limit anyway). Zero: DefaultLookback (the stream's
	// default age limit).
	Lookback time.Duration
	// MaxPause is the longest pause between tries while the bucket or the
	// database fails. Zero: DefaultMaxPause.
	MaxPause time.Duration
	// NoTrim keeps archived builds' raw events in the BES stream until its
	// age limit (--archive-trim=false); by default they leave it once
	// archived and read by every consumer (trim.go).
	NoTrim bool
	// HoldFor names durable consumers of BES that hold trimming back
	// beside the builds projector's (ProjectorDurable) and every other
	// durable of the stream: one that does not exist holds everything.
	HoldFor []string
	// Logger; nil: slog.Default().
	Logger *slog.Logger
}

// Validate refuses negative values where they mean nothing.
func (c Config) Validate() error {
	return errors.Join(
		knob.NotNegative("archive", "Interval", c.Interval, DefaultInterval),
		knob.NotNegative("archive", "Batch", c.Batch, DefaultBatch),
		knob.NotNegative("archive", "Lookback", c.Lookback, DefaultLookback),
		knob.NotNegative("archive", "MaxPause", c.MaxPause, DefaultMaxPause),
		checkHolders(c.HoldFor))
}

// Off reports whether the configuration turns archiving off.
func (c Config) Off() bool { return c.After < 0 }

func (c Config) withDefaults() Config {
	if c.After == 0 {
		c.After = DefaultAfter
	}
	if c.Interval == 0 {
		c.Interval = DefaultInterval
	}
	if c.Batch == 0 {
		c.Batch = DefaultBatch
	}
	if c.Lookback == 0 {
		c.Lookback = DefaultLookback
	}
	if c.MaxPause == 0 {
		c.MaxPause = DefaultMaxPause
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return c
}

// RegisterFlags registers the archiver's flags with their variables. The
// bucket is the process's (--bucket-url).
func (c *Config) RegisterFlags(fs *flag.FlagSet) {
	envflag.SignedDuration(fs, &c.After, "archive-after", "MILLRACE_ARCHIVE_AFTER", DefaultAfter,
		"how long after its last event a finished build's raw events go to the bucket (--bucket-url); negative: never archive")
	envflag.Duration(fs, &c.Interval, "archive-interval", "MILLRACE_ARCHIVE_INTERVAL", DefaultInterval,
		"least time between the archiver's looks for finished builds once it has archived those it found (a build is archived within it of being due); while none is due it looks when the next it knows of is, and at least every --archive-after")
	envflag.Int(fs, &c.Batch, "archive-batch", "MILLRACE_ARCHIVE_BATCH", DefaultBatch, "most builds the archiver takes per look")
	envflag.Duration(fs, &c.Lookback, "archive-lookback", "MILLRACE_ARCHIVE_LOOKBACK", DefaultLookback,
		"how far back the archiver looks for builds not archived (the BES stream keeps nothing older than its age limit)")
	registerTrimFlags(fs, c)
}

// Source reads the messages of one subject of the BES stream, in stream
// order, each message's fields as arguments (streams.BuildEvents; the
// fields rather than a type so that neither package imports the other).
// Subject is where a build's events are: the backbone's layout of them
// (subjects.BESLayout) is the Source's.
type Source interface {
	Read(ctx context.Context, subject string, fn func(seq uint64, at time.Time, subject string, header map[string][]string, data []byte) error) error
	Subject(project, invocation string) string
}

// read calls fn with each message of subject as a Message.
func read(ctx context.Context, src Source, subject string, fn func(*Message) error) error {
	return src.Read(ctx, subject, func(seq uint64, at time.Time, subject string, h map[string][]string, data []byte) error {
		return fn(&Message{Sequence: seq, Stored: at, SubjectName: subject, Headers: h, Payload: data})
	})
}

// BuildStore is what the archiver needs of the bucket.
type BuildStore interface {
	Store
	NewWriter(ctx context.Context, key string) (*bucket.Writer, error)
	NewReader(ctx context.Context, key string) (io.ReadCloser, error)
}

// Metrics of the archiver.
type Metrics struct {
	builds, raw, stored              prometheus.Counter
	trimmedBuilds, trimmedMsgs       prometheus.Counter
	outputMoved                      prometheus.Counter
	failures                         *prometheus.CounterVec
	oldest, paused, waitingForHolder prometheus.Gauge
}

// Failure reasons, the failures metric's reason label.
const (
	ReasonBucket   = "bucket"   // the bucket failed: archiving pauses
	ReasonDatabase = "database" // PostgreSQL failed: archiving pauses
	ReasonStream   = "stream"   // the BES stream could not be read
	ReasonCheck    = "check"    // the object read back differs from what was written
	ReasonGone     = "gone"     // the stream holds none of the build's events
	ReasonOutput   = "output"   // the object's console output differs from PostgreSQL's: it stays there
)

// NewMetrics makes the archiver's metrics and registers them on reg (nil:
// none).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		builds: prometheus.NewCounter(prometheus.CounterOpts{Name: "millrace_archive_builds_total", Help: "Builds archived (re-archived builds again)."}),
		raw:    prometheus.NewCounter(prometheus.CounterOpts{Name: "millrace_archive_raw_bytes_total", Help: "Bytes of raw events archived, uncompressed."}),
		stored: prometheus.NewCounter(prometheus.CounterOpts{Name: "millrace_archive_stored_bytes_total", Help: "Bytes of archive objects written."}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "millrace_archive_failures_total",
			Help: "Builds the archiver failed to archive, or whose console output it could not move, by reason (bucket, database, stream, check, gone, output)."}, []string{"reason"}),
		oldest: prometheus.NewGauge(prometheus.GaugeOpts{Name: "millrace_archive_oldest_pending_seconds",
			Help: "Age of the last event of the oldest finished build due for the archive and not archived (0: none)."}),
		paused: prometheus.NewGauge(prometheus.GaugeOpts{Name: "millrace_archive_paused",
			Help: "1 while archiving pauses because the bucket or the database fails."}),
		trimmedBuilds: prometheus.NewCounter(prometheus.CounterOpts{Name: "millrace_archive_trimmed_builds_total",
			Help: "Archived builds whose raw events were trimmed from the BES stream."}),
		trimmedMsgs: prometheus.NewCounter(prometheus.CounterOpts{Name: "millrace_archive_trimmed_messages_total",
			Help: "Messages trimmed from the BES stream once archived and read by every consumer."}),
		outputMoved: prometheus.NewCounter(prometheus.CounterOpts{Name: "millrace_archive_output_moved_builds_total",
			Help: "Archived builds whose console output moved from PostgreSQL into their object (a build archived again counts again)."}),
		waitingForHolder: prometheus.NewGauge(prometheus.GaugeOpts{Name: "millrace_archive_trim_waiting_builds",
			Help: "Archived builds whose raw events stay in the BES stream because a consumer that holds trimming back has not read them (or does not exist)."}),
	}
	if reg != nil {
		reg.MustRegister(m.builds, m.raw, m.stored, m.failures, m.oldest, m.paused, m.trimmedBuilds, m.trimmedMsgs, m.outputMoved, m.waitingForHolder)
	}
	for _, r := range []string{ReasonBucket, ReasonDatabase, ReasonStream, ReasonCheck, ReasonGone, ReasonOutput} {
		m.failures.WithLabelValues(r)
	}
	return m
}

// Archiver moves the raw events of finished builds to the bucket: one
// object per build, checked by reading it back, then recorded in
// archived_builds. It reads the stream and the projection, never writes
// either, so ingest and the projector never wait for it; a failing bucket
// pauses it alone.
type Archiver struct {
	cfg   Config
	pool  *pgxpool.Pool
	store BuildStore
	src   Source
	trim  Trimmer     // nil: no trimming
	out   OutputMover // nil: console output stays in PostgreSQL
	dicts *Dicts
	m     *Metrics
	now   func() time.Time

	// What the last pass learnt of when the next one is worth making
	// (nextLook).
	nextDue   time.Time // when the earliest build seen and not yet due is; zero: none
	untrimmed int64     // archived builds a holder has not read yet
}

// New makes an archiver; m may be nil (metrics kept unregistered). It
// does not trim the stream until given a Trimmer (TrimWith).
func New(cfg Config, pool *pgxpool.Pool, store BuildStore, src Source, m *Metrics) (*Archiver, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if m == nil {
		m = NewMetrics(nil)
	}
	return &Archiver{cfg: cfg.withDefaults(), pool: pool, store: store, src: src, dicts: NewDicts(store), m: m, now: time.Now}, nil
}

// TrimWith makes the archiver trim archived builds from the stream through
// t (unless the configuration says NoTrim), and returns it.
func (a *Archiver) TrimWith(t Trimmer) *Archiver {
	if !a.cfg.NoTrim {
		a.trim = t
	}
	return a
}

// MoveOutputWith makes the archiver move archived builds' console output
// from PostgreSQL into their objects through o (output.go), and returns
// it.
func (a *Archiver) MoveOutputWith(o OutputMover) *Archiver {
	a.out = o
	return a
}

// pending is one build due for the archive.
type pending struct {
	project, id string
	lastEventAt time.Time
}

// Run archives until ctx ends (when the configuration turns archiving
// off, it only waits for that). It returns nil then; it never gives up on
// a failing bucket or database (it pauses, with metrics, and tries
// again), since a component's loop that ends stops its process.
func (a *Archiver) Run(ctx context.Context) error {
	if a.cfg.Off() {
		<-ctx.Done()
		return nil
	}
	log := a.cfg.Logger
	pause := backoff.Backoff{Min: min(time.Second, a.cfg.MaxPause), Max: a.cfg.MaxPause, Jitter: true}
	for ctx.Err() == nil {
		start := a.now()
		n, reason, err := a.Pass(ctx)
		if ctx.Err() != nil {
			return nil
		}
		if err != nil {
			a.m.paused.Set(1)
			d := pause.Next()
			log.Warn("archiving paused; retrying", "reason", reason, "err", err, "retry_in", d)
			if !backoff.Sleep(ctx, d) {
				return nil
			}
			continue
		}
		a.m.paused.Set(0)
		pause.Reset()
		if n < a.cfg.Batch && !backoff.Sleep(ctx, a.nextLook(start).Sub(a.now())) {
			return nil
		}
	}
	return nil
}

// nextLook is when Run looks again after a pass that began at start and
// found less than a batch. An idle archiver does not ask PostgreSQL every
// Interval for builds that cannot be due: a build becomes due After its
// last event, so the pass noted the earliest one it saw that is not due
// yet (nextDue). A build the pass could not see (not projected yet) whose
// last event came after start is due after start+After, by when the
// archiver has looked again; one whose events were stored before start
// but projected after waits for that look, so it is archived as late as
// the projector was, and at most After after it is due. A build the
// projector's sweep finishes (abandoned) was due long before and waits
// the same, and so does the console output of an archived build that
// could not move yet (MoveOutputs: the projector behind the object, or an
// object that did not read). While archived builds wait for a holder to
// read them, trimming is tried every Interval, as it was. Looks are never
// closer than Interval: a build is archived within Interval of being due,
// as when the archiver looked every Interval.
func (a *Archiver) nextLook(start time.Time) time.Time {
	at := start.Add(max(a.cfg.After, a.cfg.Interval))
	if !a.nextDue.IsZero() && a.nextDue.Before(at) {
		at = a.nextDue
	}
	if a.untrimmed > 0 {
		at = start
	}
	if floor := start.Add(a.cfg.Interval); at.Before(floor) {
		at = floor
	}
	return at
}

// Pass archives the builds one look finds (at most Batch), then moves the
// console output of archived builds into their objects (at most Batch,
// when given an OutputMover), then trims those archived and read by every
// holder (at most Batch), and returns the largest count (a full batch: the
// caller looks again at once). A
// failure of the bucket or the database ends the pass with its reason
// (the caller pauses); a failure of one build's stream or check is
// counted and logged, and the pass goes on (the build is tried again next
// pass).
func (a *Archiver) Pass(ctx context.Context) (found int, reason string, err error) {
	found, reason, err = a.archivePass(ctx)
	if err != nil || ctx.Err() != nil {
		return found, reason, err
	}
	moved, reason, err := a.MoveOutputs(ctx)
	if err != nil || ctx.Err() != nil {
		return max(found, moved), reason, err
	}
	trimmed, reason, err := a.trimPass(ctx)
	return max(found, moved, trimmed), reason, err
}

// archivePass archives the builds one look finds.
func (a *Archiver) archivePass(ctx context.Context) (found int, reason string, err error) {
	now := a.now()
	builds, err := a.due(ctx, now)
	if err == nil && len(builds) < a.cfg.Batch {
		a.nextDue, err = a.upcoming(ctx, now)
	}
	if err != nil {
		a.m.failures.WithLabelValues(ReasonDatabase).Inc()
		return 0, ReasonDatabase, err
	}
	if len(builds) == 0 {
		a.m.oldest.Set(0)
	} else {
		a.m.oldest.Set(a.now().Sub(builds[0].lastEventAt).Seconds())
	}
	if len(builds) == 0 {
		return 0, "", nil
	}
	// The current dictionary, once a pass: a pass takes a new one within
	// an interval of its training.
	dict, err := a.dicts.Current(ctx)
	if err != nil {
		a.m.failures.WithLabelValues(ReasonBucket).Inc()
		return 0, ReasonBucket, err
	}
	for _, b := range builds {
		reason, err := a.archive(ctx, b, dict)
		if err == nil {
			continue
		}
		if ctx.Err() != nil {
			return found, "", nil
		}
		a.m.failures.WithLabelValues(reason).Inc()
		if reason == ReasonBucket || reason == ReasonDatabase {
			return found, reason, err
		}
		a.cfg.Logger.Warn("build not archived; trying again next pass", "project", b.project, "invocation", b.id, "reason", reason, "err", err)
	}
	return len(builds), "", nil
}

// due lists the finished builds whose last event is at least After old
// and that are not archived, or whose events are newer than their object,
// oldest first.
func (a *Archiver) due(ctx context.Context, now time.Time) ([]pending, error) {
	rows, err := a.pool.Query(ctx, `
select i.project, i.id, i.last_event_at
from invocations i
left join archived_builds a on a.invocation_id = i.id and a.project = i.project
where (i.status <> 'running' or i.stream_done)
  and i.last_event_bucket >= $1 and i.last_event_at <= $2
  and (a.invocation_id is null or (a.last_event_at < i.last_event_at and a.raw_expired_at is null))
order by i.last_event_at
limit $3`, now.Add(-a.cfg.Lookback), now.Add(-a.cfg.After), a.cfg.Batch)
	if err != nil {
		return nil, fmt.Errorf("archive: builds due: %w", err)
	}
	return pgx.CollectRows(rows, func(r pgx.CollectableRow) (p pending, err error) {
		return p, r.Scan(&p.project, &p.id, &p.lastEventAt)
	})
}

// bucketSlack is how much earlier than a last_event_at its
// last_event_bucket may be: the bucket is the time rounded down to 5
// minutes (projectors/builds, eventBucket); an hour keeps the bound right
// should the rounding grow, and the index range small.
const bucketSlack = time.Hour

// sqlUpcoming is the earliest last event of the builds due's conditions
// would list but for its time: finished, not archived (or with events
// newer than their object), last event after the cutoff; on
// invocations_finished_idx, from the bucket of the cutoff.
const sqlUpcoming = `
select min(i.last_event_at)
from invocations i
left join archived_builds a on a.invocation_id = i.id and a.project = i.project
where (i.status <> 'running' or i.stream_done)
  and i.last_event_bucket >= $1 and i.last_event_at > $2
  and (a.invocation_id is null or (a.last_event_at < i.last_event_at and a.raw_expired_at is null))`

// upcoming returns when the earliest finished build that is not due yet
// as of now (its last event less than After old) becomes due; zero when
// there is none.
func (a *Archiver) upcoming(ctx context.Context, now time.Time) (time.Time, error) {
	cutoff := now.Add(-a.cfg.After)
	var last *time.Time
	if err := a.pool.QueryRow(ctx, sqlUpcoming, cutoff.Add(-bucketSlack), cutoff).Scan(&last); err != nil {
		return time.Time{}, fmt.Errorf("archive: builds due next: %w", err)
	}
	if last == nil {
		return time.Time{}, nil
	}
	return last.Add(a.cfg.After), nil
}

// bucketError marks a failure of the bucket inside a stream read.
type bucketError struct{ err error }

func (e bucketError) Error() string { return e.err.Error() }
func (e bucketError) Unwrap() error { return e.err }

// archive writes one build's object, reads it back, and records it, in
// one transaction that holds the build's lock (lockBuild).
func (a *Archiver) archive(ctx context.Context, b pending, dict *Dict) (reason string, err error) {
	start := a.now()
	key := BuildKey(b.project, b.id)
	tx, err := a.pool.Begin(ctx)
	if err != nil {
		return ReasonDatabase, fmt.Errorf("archive: %s of project %s: %w", b.id, b.project, err)
	}
	defer tx.Rollback(ctx)
	prev, err := lockBuild(ctx, tx, b.project, b.id)
	if err != nil {
		return ReasonDatabase, err
	}
	// A trimmed build's first messages are in its object alone: the new
	// object starts with them.
	from := ""
	if prev.trimmed != nil && prev.key != "" {
		from = prev.key
	}
	// A build whose console output has moved into its object: the new one
	// must start with the same messages, or the output would be lost.
	var first uint64
	if prev.outputSeq != nil {
		first = uint64(prev.firstSeq)
	}
	st, stored, reason, err := a.write(ctx, key, from, first, a.src.Subject(b.project, b.id), dict)
	if err != nil {
		return reason, err
	}
	if st.Messages == 0 {
		// The stream keeps none of its events (past its age limit, or
		// erased): recorded so that it is not looked for again.
		a.m.failures.WithLabelValues(ReasonGone).Inc()
		key = ""
	} else if reason, err := a.check(ctx, key, st); err != nil {
		return reason, err
	}
	var dictID uint32
	if dict != nil {
		dictID = dict.ID
	}
	_, err = tx.Exec(ctx, `
insert into archived_builds (invocation_id, project, object_key, dict_id, events, first_seq, last_seq,
                             last_event_at, raw_bytes, stored_bytes, archived_at, position)
values ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
on conflict (invocation_id, project) do update set
    object_key = excluded.object_key, dict_id = excluded.dict_id, events = excluded.events,
    first_seq = excluded.first_seq, last_seq = excluded.last_seq, last_event_at = excluded.last_event_at,
    raw_bytes = excluded.raw_bytes, stored_bytes = excluded.stored_bytes, archived_at = excluded.archived_at,
    position = excluded.position, verified_at = null, verify_error = null, output_error = null`,
		b.id, b.project, key, int64(dictID), int64(st.Messages), int64(st.FirstSeq), int64(st.LastSeq),
		b.lastEventAt, int64(st.RawBytes), stored, a.now(), a.cfg.Layout.Durable(ProjectorDurable, a.cfg.Layout.Partition(b.project, b.id)))
	if err == nil {
		err = tx.Commit(ctx)
	}
	if err != nil {
		return ReasonDatabase, fmt.Errorf("archive: record %s of project %s: %w", b.id, b.project, err)
	}
	if st.Messages > 0 {
		a.m.builds.Inc()
		a.m.raw.Add(float64(st.RawBytes))
		a.m.stored.Add(float64(stored))
		a.cfg.Logger.Debug("build archived", "project", b.project, "invocation", b.id, "messages", st.Messages, "seconds", a.now().Sub(start).Seconds())
	}
	return "", nil
}

// write streams the subject's messages into the object at key, after the
// messages of the object at from when it is set (a trimmed build's: of the
// stream, only the messages after its last are taken); nothing is stored
// when it fails, when there is no message, or when first is set and the
// object would not start with that sequence (check).
func (a *Archiver) write(ctx context.Context, key, from string, first uint64, subject string, dict *Dict) (Stats, int64, string, error) {
	bw, err := a.store.NewWriter(ctx, key)
	if err != nil {
		return Stats{}, 0, ReasonBucket, err
	}
	cw := &counter{w: bw}
	aw, err := NewWriter(cw, dict, Level)
	if err != nil {
		bw.Abort()
		return Stats{}, 0, ReasonBucket, err
	}
	var after uint64 // the last sequence of the object at from
	if from != "" {
		var reason string
		if after, reason, err = a.copyObject(ctx, from, aw); err != nil {
			bw.Abort()
			return Stats{}, 0, reason, err
		}
	}
	err = read(ctx, a.src, subject, func(m *Message) error {
		if m.Sequence <= after {
			return nil // in the object at from already
		}
		if err := aw.Write(m); err != nil {
			return bucketError{err}
		}
		return nil
	})
	var be bucketError
	switch {
	case errors.As(err, &be):
		bw.Abort()
		return Stats{}, 0, ReasonBucket, be.err
	case err != nil:
		bw.Abort()
		return Stats{}, 0, ReasonStream, err
	}
	st, err := aw.Close()
	if err != nil {
		bw.Abort()
		return Stats{}, 0, ReasonBucket, err
	}
	if first != 0 && st.FirstSeq != first {
		bw.Abort()
		return Stats{}, 0, ReasonCheck, fmt.Errorf("archive: %s would start at message %d, not %d: its console output is in the object there", key, st.FirstSeq, first)
	}
	if st.Messages == 0 {
		bw.Abort()
		return st, 0, "", nil
	}
	if err := bw.Close(); err != nil {
		return Stats{}, 0, ReasonBucket, err
	}
	return st, cw.n, "", nil
}

// check reads the object back and compares what its trailer and its
// records say with what was written.
func (a *Archiver) check(ctx context.Context, key string, want Stats) (string, error) {
	got, err := ReadStats(ctx, a.store, a.dicts, key)
	var reason string
	switch {
	case errors.Is(err, ErrCorrupt):
		reason = ReasonCheck
	case err != nil:
		reason = ReasonBucket
	case got != want:
		reason, err = ReasonCheck, fmt.Errorf("archive: %s read back holds %+v, written %+v", key, got, want)
	}
	return reason, err
}

// ReadStats reads the object at key to its end and returns its trailer's
// stats: an error unless it decodes whole and its trailer matches.
func ReadStats(ctx context.Context, store BuildStore, dicts *Dicts, key string) (Stats, error) {
	rc, err := store.NewReader(ctx, key)
	if err != nil {
		return Stats{}, err
	}
	defer rc.Close()
	r, err := NewReader(rc, dicts.Loader(ctx))
	if err != nil {
		return Stats{}, err
	}
	defer r.Close()
	for {
		if _, err := r.Next(); err == io.EOF {
			return r.Stats(), nil
		} else if err != nil {
			return Stats{}, err
		}
	}
}

type counter struct {
	w io.Writer
	n int64
}

func (c *counter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}
