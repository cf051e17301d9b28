package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/loadtest/bazelws"
	"github.com/millrace/millrace/loadtest/besrecord"
	"github.com/millrace/millrace/loadtest/replay"
	"github.com/millrace/millrace/subjects"
)

// The storage scenario: what a build costs to keep. For each workspace
// size it records one real Bazel build (`bazel test //...` of a generated
// workspace, loadtest/bazelws) and replays it -storage-builds times into
// `millrace dev`, each replay a new invocation, then measures what the
// replays added: bytes per build in each table of the builds projection
// (relation sizes, so with page and index overhead, after a VACUUM), in the
// BES stream, and WAL bytes per event. Replays rather than as many real
// builds, because a real build takes most of a minute here and the per-build
// figures need many builds to average out page granularity.
const scStorage = "storage"

// storageTargetPGBytes is the most a 50-target build (about 410 events)
// may keep in PostgreSQL once its raw events are archived: the tables
// that hold finished builds, not runningTables.
const storageTargetPGBytes = 12 * 1000

// runningTables hold the rows of builds in progress only: empty once
// every build has ended, their size is working space bounded by the
// builds running at once (index pages the moves to the partitions freed,
// reused by the next builds), not what a build keeps. Over 100 builds it
// moved between 0 and 1,300 B a build from run to run with the same
// binary; it is reported apart.
var runningTables = map[string]bool{"targets_running": true, "tests_running": true}

// storageTargetArchiveRatio is how many times smaller than the raw events
// a build's archive object must be.
const storageTargetArchiveRatio = 8

// storageConfig sizes the storage scenario (flags of the bench).
type storageConfig struct {
	targets string // comma-separated workspace sizes
	builds  int
	warmup  int
	streams int
	sizes   []int
}

func (c *storageConfig) register(fs *flag.FlagSet) {
	fs.StringVar(&c.targets, "storage-targets", "50,500", "storage: sizes (targets) of the generated workspaces, comma-separated; one real build of each is recorded and replayed")
	fs.IntVar(&c.builds, "storage-builds", 100, "storage: replays of each recorded build, each a new invocation")
	fs.IntVar(&c.warmup, "storage-warmup", 20, "storage: replays before the measured ones, so that what a table allocates once (its first pages, free-space and visibility maps) is not counted per build")
	fs.IntVar(&c.streams, "storage-streams", 4, "storage: replays sent at once")
}

func (c *storageConfig) validate() error {
	errs := negatives(map[string]float64{"storage-builds": float64(c.builds), "storage-warmup": float64(c.warmup), "storage-streams": float64(c.streams)})
	if c.warmup == 0 {
		c.warmup = 20
	}
	if c.builds == 0 {
		c.builds = 100
	}
	if c.streams == 0 {
		c.streams = 4
	}
	c.sizes = nil
	for _, f := range strings.Split(c.targets, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 {
			errs = append(errs, fmt.Errorf("-storage-targets: %q is not a positive number of targets", f))
			continue
		}
		c.sizes = append(c.sizes, n)
	}
	return errors.Join(errs...)
}

// storageReport is one workspace size's figures.
type storageReport struct {
	Targets        int   `json:"targets"`
	EventsPerBuild int   `json:"events_per_build"`
	Builds         int64 `json:"builds"`
	Events         int64 `json:"events"`
	// StreamBytesPerBuild is what the builds added to the BES stream's
	// stored bytes (JetStream's accounting: subject, headers, data and its
	// per-message overhead), per build.
	StreamBytesPerBuild float64 `json:"stream_bytes_per_build"`
	// PostgresBytesPerBuild is each table's growth (heap, TOAST and
	// indexes) per build, and PostgresTotalPerBuild their sum.
	// They are taken once the archiver has archived every build and moved
	// its console output into the object; the BeforeArchive ones once the
	// projector has applied every event, before the archiver's 1 s.
	PostgresBytesPerBuild map[string]float64 `json:"postgres_bytes_per_build"`
	PostgresTotalPerBuild float64            `json:"postgres_total_bytes_per_build"`
	// PostgresKeptPerBuild is PostgresTotalPerBuild without
	// runningTables, PostgresRunningPerBuild theirs.
	PostgresKeptPerBuild               float64            `json:"postgres_kept_bytes_per_build"`
	PostgresRunningPerBuild            float64            `json:"postgres_running_bytes_per_build"`
	PostgresBytesPerBuildBeforeArchive map[string]float64 `json:"postgres_bytes_per_build_before_archive"`
	PostgresTotalPerBuildBeforeArchive float64            `json:"postgres_total_bytes_per_build_before_archive"`
	// PostgresRowBytesPerBuild is the rows' own bytes (pg_column_size of
	// each row) per build, without page, tuple-header or index overhead.
	PostgresRowBytesPerBuild map[string]float64 `json:"postgres_row_bytes_per_build"`
	// WALBytesPerEvent is the server's WAL growth over the replays per
	// event stored: server-wide, so other databases' writes count too.
	WALBytesPerEvent float64 `json:"wal_bytes_per_event"`
	// The archive: each build's object (stored bytes) and the records it
	// holds uncompressed (raw bytes), averaged over the builds, and how
	// many times smaller the object is than the raw records and than what
	// the stream stored for the build.
	ArchiveBytesPerBuild    float64 `json:"archive_bytes_per_build"`
	ArchiveRawBytesPerBuild float64 `json:"archive_raw_bytes_per_build"`
	ArchiveRatio            float64 `json:"archive_ratio"`
	ArchiveRatioToStream    float64 `json:"archive_ratio_to_stream"`
}

// buildsTables are the builds projection's tables the scenario measures; a
// table the binary under test does not have (an older revision's, in A/B
// mode) counts 0.
var buildsTables = []string{"invocations", "targets", "targets_running", "tests", "tests_running", "build_metrics", "build_output", "build_output_pages",
	"build_output_chunks", "hourly_rollups", "build_metadata", "build_command_lines", "build_argv", "build_failures", "target_causes",
	"build_labels", "test_daily"}

func (b *bench) storageScenario(ctx context.Context, rep *scenarioReport) error {
	sc := b.cfg.storage
	rep.Description = fmt.Sprintf("one real `bazel test //...` build of each generated workspace (%s targets), replayed %d times into `millrace dev` after %d replays of warm-up: "+
		"bytes per build in each PostgreSQL table and in the BES stream, WAL bytes per event", sc.targets, sc.builds, sc.warmup)
	if _, err := exec.LookPath("bazel"); err != nil {
		rep.Skipped = "no bazel on PATH: install Bazel 4.2.3 (Debian's bazel-bootstrap; `scripts/deps.sh test` as root does)"
		return nil
	}
	for _, n := range sc.sizes {
		run, err := b.storageRun(ctx, n)
		if err != nil {
			return fmt.Errorf("%d targets: %w", n, err)
		}
		rep.Runs = append(rep.Runs, run)
		st := run.Storage
		fmt.Printf("  %d targets, %d events a build, %d builds: PostgreSQL %.0f B a build kept, %.0f B in the running builds' tables (%s), stream %.0f B, archive %.0f B (%.1fx smaller than its records, %.1fx than the stream's), WAL %.0f B/event\n",
			n, st.EventsPerBuild, st.Builds, st.PostgresKeptPerBuild, st.PostgresRunningPerBuild, tableFigures(st.PostgresBytesPerBuild), st.StreamBytesPerBuild,
			st.ArchiveBytesPerBuild, st.ArchiveRatio, st.ArchiveRatioToStream, st.WALBytesPerEvent)
		rep.Checks = append(rep.Checks, atLeast(fmt.Sprintf("%s: archive, times smaller than the raw events, %d-target build", scStorage, n),
			st.ArchiveRatio, storageTargetArchiveRatio, "x",
			fmt.Sprintf("%.0f B of records in an object of %.0f B; the stream stored %.0f B for the build", st.ArchiveRawBytesPerBuild, st.ArchiveBytesPerBuild, st.StreamBytesPerBuild)))
		if n == 50 {
			rep.Checks = append(rep.Checks, atMost(fmt.Sprintf("%s: PostgreSQL bytes per %d-target build", scStorage, n),
				st.PostgresKeptPerBuild, storageTargetPGBytes, "B",
				fmt.Sprintf("%d events a build, after archiving, without the running builds' tables (%.0f B: working space, not kept) (%s); before archiving %.0f B in all",
					st.EventsPerBuild, st.PostgresRunningPerBuild, tableFigures(st.PostgresBytesPerBuild), st.PostgresTotalPerBuildBeforeArchive)))
		}
	}
	return nil
}

// storageRun records one real build of an n-target workspace, replays it
// into a fresh `millrace dev` and measures what the replays kept.
func (b *bench) storageRun(ctx context.Context, n int) (runReport, error) {
	scripts, err := b.recordBuild(ctx, n)
	if err != nil {
		return runReport{}, err
	}
	// The archiver takes a build a second after its last event.
	s, db, cleanup, err := b.devStackEnv(ctx, fmt.Sprintf("%s-%d", scStorage, n), "MILLRACE_ARCHIVE_AFTER=1s", "MILLRACE_ARCHIVE_INTERVAL=1s")
	if err != nil {
		return runReport{}, err
	}
	defer cleanup()
	conn, connPID, err := connectPID(ctx, s.dbURL)
	if err != nil {
		return runReport{}, err
	}
	defer conn.Close(context.Background())
	sc := b.cfg.storage
	if err := replayBuilds(ctx, s, scripts, sc.warmup, sc.streams); err != nil {
		return runReport{}, fmt.Errorf("warm-up: %w", err)
	}
	if err := settleBuilds(ctx, conn, s, b.cfg.lagTimeout); err != nil {
		return runReport{}, err
	}
	if err := awaitArchived(ctx, conn, b.cfg.lagTimeout); err != nil {
		return runReport{}, fmt.Errorf("warm-up: %w", err)
	}
	before, err := measureStorage(ctx, conn, s.natsURL)
	if err != nil {
		return runReport{}, err
	}
	meter, err := b.pg.meter(ctx, db, connPID)
	if err != nil {
		return runReport{}, err
	}
	defer meter.stop(context.Background())
	start, per := time.Now(), scripts[0].Events()
	if err := replayBuilds(ctx, s, scripts, sc.builds, sc.streams); err != nil {
		return runReport{}, err
	}
	if err := settleBuilds(ctx, conn, s, b.cfg.lagTimeout); err != nil {
		return runReport{}, err
	}
	cost, err := meter.stop(ctx)
	if err != nil {
		return runReport{}, err
	}
	after, err := measureStorage(ctx, conn, s.natsURL)
	if err != nil {
		return runReport{}, err
	}
	unarchived := after.minus(before)
	if unarchived.Builds != int64(sc.builds) {
		return runReport{}, fmt.Errorf("the projection gained %d builds, want %d", unarchived.Builds, sc.builds)
	}
	if err := awaitArchived(ctx, conn, b.cfg.lagTimeout); err != nil {
		return runReport{}, err
	}
	archived, err := measureStorage(ctx, conn, s.natsURL)
	if err != nil {
		return runReport{}, err
	}
	// The stream's figures are those before the archive trimmed it.
	st := archived.minus(before)
	st.StreamBytesPerBuild, st.Events = unarchived.StreamBytesPerBuild, unarchived.Events
	st.PostgresBytesPerBuildBeforeArchive, st.PostgresTotalPerBuildBeforeArchive = unarchived.PostgresBytesPerBuild, unarchived.PostgresTotalPerBuild
	if err := st.measureArchive(ctx, conn, b.cfg.lagTimeout); err != nil {
		return runReport{}, err
	}
	st.Targets, st.EventsPerBuild = n, per
	if st.Events > 0 {
		st.WALBytesPerEvent = round(float64(cost.WALBytes)/float64(st.Events), 1)
	}
	wall := time.Since(start)
	run := runReport{Name: fmt.Sprintf("%d targets, %d builds", n, sc.builds), Mode: "flat out", Streams: sc.streams,
		ElapsedS: round(wall.Seconds(), 2), WindowS: round(wall.Seconds(), 2), WindowEvents: st.Events,
		EventsPerS: round(float64(st.Events)/wall.Seconds(), 0), Invocations: st.Builds, Storage: &st}
	run.Postgres = b.pgReport(cost, st.Events)
	return run, nil
}

// replayBuilds replays the recorded build n times, each a new invocation.
func replayBuilds(ctx context.Context, s *fleetStack, scripts []*replay.Script, n, streams int) error {
	res, err := replay.Run(ctx, replay.Config{Target: s.bes, Scripts: scripts, Streams: streams, Projects: []string{"bench"},
		Events: int64(n * scripts[0].Events()), Seed: uint64(n)})
	if err != nil {
		return err
	}
	if res.Invocations != int64(n) || res.Failed+res.Truncated > 0 {
		return fmt.Errorf("replayed %d builds, %d failed and %d cut short, want %d whole (errors: %v)",
			res.Invocations, res.Failed, res.Truncated, n, res.ErrorSamples)
	}
	return nil
}

// recordBuild runs one real build of an n-target workspace against an
// in-process recorder (loadtest/besrecord) and returns it as a script.
func (b *bench) recordBuild(ctx context.Context, n int) ([]*replay.Script, error) {
	dir, err := mkdir(b.tmp, fmt.Sprintf("%s-%d-ws", scStorage, n))
	if err != nil {
		return nil, err
	}
	defer func() { makeWritable(dir); os.RemoveAll(dir) }()
	exp, err := bazelws.Generate(filepath.Join(dir, "ws"), bazelws.Options{Targets: n, Seed: 7})
	if err != nil {
		return nil, err
	}
	path := filepath.Join(dir, "build.besrec")
	rec, err := besrecord.Start("127.0.0.1:0", path)
	if err != nil {
		return nil, err
	}
	bld, _, err := b.runBazel(ctx, &fleetStack{dir: dir, bes: rec.Addr()}, exp, 0)
	if cerr := rec.Close(); err == nil {
		err = cerr
	}
	if err != nil {
		return nil, err
	}
	recs, err := besrecord.Read(path)
	if err != nil {
		return nil, err
	}
	scripts, skipped := replay.Scripts(recs)
	if len(scripts) != 1 || len(skipped) > 0 {
		return nil, fmt.Errorf("the recording of one build made %d scripts (skipped: %v)", len(scripts), errors.Join(skipped...))
	}
	fmt.Printf("  recorded a %d-target build: bazel exited %d after %.1f s, %d events\n", n, bld.ExitCode, bld.WallS, scripts[0].Events())
	return scripts, nil
}

// settleBuilds waits until the projector has applied the whole stream and
// every build has left 'running' with its output folded, then vacuums the
// tables so that their sizes hold live rows and reusable space only.
func settleBuilds(ctx context.Context, conn *pgx.Conn, s *fleetStack, timeout time.Duration) error {
	_, last, _, err := streamState(ctx, s.natsURL)
	if err != nil {
		return err
	}
	if err := waitPosition(ctx, conn, s.dev, last, timeout); err != nil {
		return err
	}
	deadline := time.Now().Add(timeout)
	for {
		var pending int64
		err := conn.QueryRow(ctx, `select (select count(*) from invocations where status = 'running')
			+ (select count(*) from build_output_chunks)`).Scan(&pending)
		if err != nil {
			return err
		}
		if pending == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d builds still running or with output not folded after %s", pending, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
	tables, err := presentTables(ctx, conn)
	if err != nil {
		return err
	}
	_, err = conn.Exec(ctx, "vacuum "+strings.Join(tables, ", "))
	return err
}

// presentTables is those of buildsTables that the database has.
func presentTables(ctx context.Context, conn *pgx.Conn) ([]string, error) {
	rows, err := conn.Query(ctx, `select t from unnest($1::text[]) with ordinality as u(t, n)
		where to_regclass(t) is not null order by n`, buildsTables)
	if err != nil {
		return nil, err
	}
	return pgx.CollectRows(rows, pgx.RowTo[string])
}

// awaitArchived waits until the archiver has archived every build and
// moved its console output (or found it differs), then vacuums the
// build tables, so that the space the moved output held counts free.
func awaitArchived(ctx context.Context, conn *pgx.Conn, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var left int64
		err := conn.QueryRow(ctx, `select count(*) from invocations i where not exists
			(select 1 from archived_builds a where a.invocation_id = i.id and a.project = i.project and a.object_key <> ''
			 and (a.output_seq >= a.last_seq or a.output_error is not null))`).Scan(&left)
		if err != nil {
			return err
		}
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d builds not archived, or their output not moved, after %s", left, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	_, err := conn.Exec(ctx, "vacuum "+strings.Join(buildsTables, ", "))
	return err
}

// measureArchive waits until the archiver has archived every build and
// takes the archive's figures.
func (r *storageReport) measureArchive(ctx context.Context, conn *pgx.Conn, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		var left int64
		err := conn.QueryRow(ctx, `select count(*) from invocations i where not exists
			(select 1 from archived_builds a where a.invocation_id = i.id and a.project = i.project and a.object_key <> '')`).Scan(&left)
		if err != nil {
			return err
		}
		if left == 0 {
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d builds not archived after %s", left, timeout)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(200 * time.Millisecond):
		}
	}
	var stored, raw float64
	if err := conn.QueryRow(ctx, `select avg(stored_bytes), avg(raw_bytes) from archived_builds`).Scan(&stored, &raw); err != nil {
		return err
	}
	r.ArchiveBytesPerBuild, r.ArchiveRawBytesPerBuild = round(stored, 0), round(raw, 0)
	if stored > 0 {
		r.ArchiveRatio, r.ArchiveRatioToStream = round(raw/stored, 1), round(r.StreamBytesPerBuild/stored, 1)
	}
	return nil
}

// storageState is what the builds occupy at one moment.
type storageState struct {
	builds                  int64
	streamBytes, streamMsgs uint64
	tables, rows            map[string]int64
}

func measureStorage(ctx context.Context, conn *pgx.Conn, natsURL string) (storageState, error) {
	st := storageState{tables: map[string]int64{}, rows: map[string]int64{}}
	tables, err := presentTables(ctx, conn)
	if err != nil {
		return st, err
	}
	for _, t := range tables {
		id := pgx.Identifier{t}.Sanitize()
		var size, rows int64
		// A partitioned table's size is its partitions'.
		err := conn.QueryRow(ctx, "select coalesce((select sum(pg_total_relation_size(relid))::int8 from pg_partition_tree($1::regclass)), pg_total_relation_size($1::regclass)), (select coalesce(sum(pg_column_size(r.*)), 0) from "+id+" r)", t).
			Scan(&size, &rows)
		if err != nil {
			return st, fmt.Errorf("size of %s: %w", t, err)
		}
		st.tables[t], st.rows[t] = size, rows
	}
	if err := conn.QueryRow(ctx, "select count(*) from invocations").Scan(&st.builds); err != nil {
		return st, err
	}
	st.streamBytes, st.streamMsgs, err = streamBytes(ctx, natsURL)
	return st, err
}

// minus is what was added between o and st, per build.
func (st storageState) minus(o storageState) storageReport {
	r := storageReport{Builds: st.builds - o.builds, PostgresBytesPerBuild: map[string]float64{}, PostgresRowBytesPerBuild: map[string]float64{}}
	r.Builds = max(r.Builds, 1)
	per := func(v int64) float64 { return round(float64(v)/float64(r.Builds), 0) }
	var total, running int64
	for _, t := range buildsTables {
		r.PostgresBytesPerBuild[t] = per(st.tables[t] - o.tables[t])
		r.PostgresRowBytesPerBuild[t] = per(st.rows[t] - o.rows[t])
		total += st.tables[t] - o.tables[t]
		if runningTables[t] {
			running += st.tables[t] - o.tables[t]
		}
	}
	r.PostgresTotalPerBuild, r.PostgresKeptPerBuild, r.PostgresRunningPerBuild = per(total), per(total-running), per(running)
	r.StreamBytesPerBuild = per(int64(st.streamBytes) - int64(o.streamBytes))
	// Every message stored is an event of a build (tool or lifecycle).
	r.Events = int64(st.streamMsgs - o.streamMsgs)
	return r
}

// streamBytes is the BES stream's stored bytes and messages.
func streamBytes(ctx context.Context, url string) (bytes, msgs uint64, err error) {
	nc, err := nats.Connect(url, natsOptions(url, nats.Timeout(5*time.Second))...)
	if err != nil {
		return 0, 0, err
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		return 0, 0, err
	}
	s, err := js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		return 0, 0, fmt.Errorf("stream %s: %w", subjects.StreamBES, err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		return 0, 0, err
	}
	return info.State.Bytes, info.State.Msgs, nil
}

// tableFigures lists the tables that hold anything, largest first.
func tableFigures(m map[string]float64) string {
	var ts []string
	for t, v := range m {
		if v != 0 {
			ts = append(ts, t)
		}
	}
	sort.Slice(ts, func(i, j int) bool { return m[ts[i]] > m[ts[j]] })
	parts := make([]string, len(ts))
	for i, t := range ts {
		parts[i] = fmt.Sprintf("%s %.0f", t, m[t])
	}
	return strings.Join(parts, ", ")
}
