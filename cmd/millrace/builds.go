package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/logs"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/services/bes"
	"github.com/millrace/millrace/services/bes/redact"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/streams/projection"
	"github.com/millrace/millrace/subjects"
)

// The BES edge and the builds projection: serve bes, project builds,
// replay builds, builds show, builds scrub.

// projectorOptions tune the builds projector and its consumer.
type projectorOptions struct {
	rc streams.RunnerConfig
	c  builds.Config
	rt builds.RetentionConfig
	ex builds.ExpireConfig
}

// The builds projector's batches. A batch writes a row of each build it
// names, so with many slow builds (1,000 paced streams at 2,500 events/s)
// it writes about one row per event whatever it holds, and fewer, longer
// waits write fewer rows: 500 ms brings about 1,300 events of 750 builds
// (0.55 rows per event; 250 ms: 0.7), while the wait, the apply and the
// commit keep the projection's lag under a second. A batch takes what
// such a wait brings, and a backlog drains in batches of 5,000.
const (
	defaultBuildsBatch   = 5000
	defaultBuildsMaxWait = 500 * time.Millisecond
)

func (o *projectorOptions) register(fs *flag.FlagSet) {
	envflag.Int(fs, &o.rc.Batch, "builds-batch", "MILLRACE_BUILDS_BATCH", defaultBuildsBatch, "most events applied in one transaction")
	envflag.Duration(fs, &o.rc.MaxWait, "builds-max-wait", "MILLRACE_BUILDS_MAX_WAIT", defaultBuildsMaxWait, "how long events may gather before a batch takes them (adds to the projection's lag)")
	envflag.Duration(fs, &o.rc.AckWait, "builds-ack-wait", "MILLRACE_BUILDS_ACK_WAIT", 60*time.Second, "JetStream's redelivery timeout for unacknowledged events")
	o.c.RegisterFlags(fs)
	o.rt.RegisterFlags(fs)
	o.ex.RegisterFlags(fs)
}

// retention deletes what is past each project's retention (rawDays: the
// default of raw events), the raw events too when the bucket is open.
func (o *projectorOptions) retention(p *process, rawDays int, withRaw bool) (supervise.Component, error) {
	def, err := o.rt.Defaults(rawDays)
	if err == nil {
		err = o.ex.Validate()
	}
	if err != nil {
		return supervise.Component{}, envflag.Usage(err.Error())
	}
	cfg, m := o.ex, builds.NewExpireMetrics(p.t.reg)
	cfg.Logger = p.log.With("component", "retention")
	return p.consumer("retention", func(ctx context.Context, pool *pgxpool.Pool) error {
		var raw builds.RawExpirer
		if withRaw {
			src, err := besSource(ctx, p.bb)
			if err != nil {
				return err
			}
			raw = archive.NewRawExpirer(pool, p.bk, streams.SubjectTrimmer{Stream: src.Stream}).RestoreOutputWith(outputMover{}, p.bk)
		}
		x, err := builds.NewExpirer(cfg, def, pool, raw, m)
		if err != nil {
			return err
		}
		return x.Run(ctx)
	}), nil
}

func (o *projectorOptions) runnerConfig(log *slog.Logger) streams.RunnerConfig {
	c := o.rc
	c.Stream, c.Filter, c.Logger = subjects.StreamBES, subjects.BESFilter, log.With("component", "projector")
	return c
}

func (o *projectorOptions) projector() (*builds.Projector, error) {
	p, err := builds.New(o.c)
	if err != nil {
		return nil, envflag.Usage(err.Error())
	}
	return p, nil
}

func serveBESCommand() command {
	return command{
		Name:    "serve bes",
		Summary: "run the Build Event Service edge (Bazel --bes_backend)",
		Long: `Serves google.devtools.build.v1.PublishBuildEvent and publishes every event to
JetStream (bes.<project>.<invocation>); an event is acknowledged to Bazel only
once stored. Several instances may run behind a balancer.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				bo bes.Options
			)
			po.register(fs, "127.0.0.1:8080", "HTTP address: /metrics, /healthz, /readyz", "how long shutdown waits for open streams")
			bo.RegisterFlags(fs)
			return po.run("serve bes", "millrace-bes", func(p *process) (_, edges []supervise.Component, _ error) {
				return nil, []supervise.Component{p.bes(bo)}, nil
			})
		},
	}
}

func projectBuildsCommand() command {
	return command{
		Name:    "project builds",
		Summary: "run the builds projector (BES stream -> PostgreSQL)",
		Long: `Consumes the BES stream into PostgreSQL: invocations, targets, tests, metrics,
build output and hourly rollups. Several instances may run: one applies, the
others stand by (a PostgreSQL advisory lock decides). Beside it, the archiver
moves the raw events of finished builds to the bucket (--bucket-url), one
object per build, --archive-after their last event (archive/README.md).`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				po procOptions
				do database.Options
				bo projectorOptions
				ko bucket.Options
				ac archive.Config
			)
			po.register(fs, "127.0.0.1:8081", "HTTP address: /metrics, /healthz, /readyz", "how long shutdown waits for the batch in progress to commit or roll back")
			do.RegisterFlags(fs)
			bo.register(fs)
			ko.RegisterFlags(fs)
			ac.RegisterFlags(fs)
			return po.run("project builds", "millrace-project-builds", func(p *process) (_, _ []supervise.Component, _ error) {
				proj, err := bo.projector()
				cs := []supervise.Component{p.database(do), p.projector(proj, bo.runnerConfig(p.log))}
				if !ac.Off() { // --archive-after negative: no archiver, no bucket
					cs = append(cs, p.openBucket(ko), p.archiver(ac))
				}
				if err == nil {
					var rt supervise.Component
					rt, err = bo.retention(p, po.nats.RetentionDays, !ac.Off())
					cs = append(cs, rt)
				}
				return cs, nil, err
			})
		},
	}
}

// bes serves the BES edge on the backbone.
func (p *process) bes(o bes.Options) supervise.Component {
	return supervise.Serve("BES edge", func(ctx context.Context) (*supervise.GRPCServer, error) {
		s, err := bes.Start(ctx, o, p.bb, p.t.reg, p.t.kf, p.log)
		if err == nil {
			p.log.Info("accepting build events", "seconds", time.Since(p.begin).Seconds())
		}
		return s, err
	})
}

func replayBuildsCommand() command {
	return command{
		Name:    "replay builds",
		Summary: "rebuild the builds projection from the archive and the BES stream",
		Long: `Empties the builds projection and applies every archived build (from the bucket,
--bucket-url), then the BES stream less what the archive held; the result equals
what the live projector built. A build whose raw events are gone, past
--retention-raw-days, keeps its rows as they are. When the stream has lost events
of a build the archive lacks, it refuses before emptying anything and names the
builds. Stop the builds projector first (replay refuses to run while it holds its
lock); start it again afterwards.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo logs.Options
				no streams.Options
				do database.Options
				bo bucket.Options
				po projectorOptions
			)
			lo.RegisterFlags(fs)
			no.RegisterFlags(fs)
			do.RegisterFlags(fs)
			bo.RegisterFlags(fs)
			po.register(fs)
			return once("replay builds", &lo, func(ctx context.Context, log *slog.Logger) error {
				return replayBuilds(ctx, no, do, bo, po, log)
			})
		},
	}
}

// replayBuilds plans the replay (archive.PlanReplay), says what it will
// do, and replays.
func replayBuilds(ctx context.Context, no streams.Options, do database.Options, bo bucket.Options, po projectorOptions, log *slog.Logger) error {
	bb, cfg, err := openBackbone(ctx, no, "millrace-replay", nil)
	if err != nil {
		return err
	}
	defer bb.Close()
	pool, err := database.Open(ctx, do.Config(true, log))
	if err != nil {
		return err
	}
	defer pool.Close()
	bk, err := bo.Open(ctx)
	if err != nil {
		return err
	}
	defer bk.Close()
	proj, err := po.projector()
	if err != nil {
		return err
	}
	st, err := bb.JS.Stream(ctx, subjects.StreamBES)
	if err != nil {
		return fmt.Errorf("stream %s: %w", subjects.StreamBES, err)
	}
	s := st.CachedInfo().State
	reset := func(ctx context.Context, tx pgx.Tx, keep []archive.BuildID) error {
		ks := make([]builds.Key, len(keep))
		for i, k := range keep {
			ks[i] = builds.Key(k)
		}
		return proj.ResetExcept(ctx, tx, ks)
	}
	plan, planned, err := archive.PlanReplay(ctx, pool, bk, archive.StreamTail{FirstSeq: s.FirstSeq, FirstTime: s.FirstTime, LastSeq: s.LastSeq},
		reset, archive.ReplayOptions{RawKept: cfg.BESMaxAge, Progress: func(done, total int) {
			fmt.Fprintf(os.Stderr, "\rreplay builds: %d/%d archived builds   ", done, total)
		}})
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "replay builds: %d builds from the archive, then the stream; %d kept as they are (raw events past --retention-raw-days)\n",
		planned.Archived, planned.Kept)
	if err := replayStream(ctx, bb, pool, proj, po.runnerConfig(log), plan, "replay builds", "events"); err != nil {
		return err
	}
	return moveOutputAgain(ctx, bb, pool, bk, log)
}

// moveOutputAgain moves the console output that the replay folded into
// pages into the archive again, so that the replay ends where the live run
// was.
func moveOutputAgain(ctx context.Context, bb *streams.Backbone, pool *pgxpool.Pool, bk *bucket.Bucket, log *slog.Logger) error {
	src, err := besSource(ctx, bb)
	if err != nil {
		return err
	}
	a, err := archive.New(archive.Config{Logger: log}, pool, bk, src, nil)
	if err != nil {
		return err
	}
	n, err := a.MoveOutputWith(outputMover{}).MoveAllOutputs(ctx)
	fmt.Fprintf(os.Stderr, "replay builds: the console output of %d archived builds moved into the archive again\n", n)
	return err
}

// replayStream empties p's projection and applies rc.Stream again
// (streams.Runner.Replay), with its progress on stderr under the label
// what; unit names the stream's messages there.
func replayStream(ctx context.Context, bb *streams.Backbone, pool *pgxpool.Pool, p projection.Projector, rc streams.RunnerConfig, plan projection.ReplayPlan, what, unit string) error {
	st, err := bb.JS.Stream(ctx, rc.Stream)
	if err != nil {
		return fmt.Errorf("stream %s: %w", rc.Stream, err)
	}
	total, start := st.CachedInfo().State.LastSeq, time.Now()
	rc.Progress = replayProgress(what, unit, total)
	r, err := streams.NewRunner(bb.JS, pool, p, rc, nil)
	if err == nil {
		err = r.ReplayWith(ctx, plan)
	}
	if errors.Is(err, streams.ErrLocked) {
		return fmt.Errorf("the %s projector is running (it holds its lock): stop it, replay, then start it again", p.Name())
	}
	if err == nil {
		fmt.Fprintf(os.Stderr, "\r%s: done, %d %s in %s\n", what, total, unit, time.Since(start).Round(time.Millisecond))
	}
	return err
}

// replayProgress prints a replay's position on stderr, at most once a
// second and at the end, on one line rewritten in place.
func replayProgress(label, unit string, total uint64) func(streams.Progress) {
	start, last := time.Now(), time.Time{}
	return func(p streams.Progress) {
		if time.Since(last) < time.Second && p.Position < total {
			return
		}
		last = time.Now()
		rate := float64(p.Applied) / max(time.Since(start).Seconds(), 0.001)
		fmt.Fprintf(os.Stderr, "\r%s: %d/%d %s (%.0f/s)   ", label, p.Position, total, unit, rate)
	}
}

func buildsShowCommand() command {
	return command{
		Name:    "builds show",
		Summary: "print the projection of one build",
		Usage:   "<invocation_id> [--project P] [--json | --output]",
		Long: `Reads the database directly; no server needs to run.

A build is a project and an invocation id: clients of two projects may choose
the same id (Bazel's --invocation_id). With --project, prints that project's
build. Without it, prints every build with that id (one after the other);
with --json, it prints the build if exactly one project has the id, and
otherwise fails naming the projects that have it, so that a tool never reads
one tenant's build for another's. With --output, it prints the build's console
output as Bazel printed it (its stdout on standard output, its stderr on
standard error; one project's, as --json), read from the build's archive
object in the bucket (--bucket-url) once the archiver has moved it there.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo      logs.Options
				do      database.Options
				bo      bucket.Options
				asJSON  bool
				output  bool
				project string
			)
			lo.RegisterFlags(fs)
			do.RegisterFlags(fs)
			bo.RegisterFlags(fs)
			fs.BoolVar(&asJSON, "json", false, "print JSON (the stable format tools compare)")
			fs.BoolVar(&output, "output", false, "print the build's console output: stdout to standard output, stderr to standard error")
			envflag.String(fs, &project, "project", "MILLRACE_BUILDS_PROJECT", "", "the project of the build; empty: any project that has the invocation id")
			return func(ctx context.Context, args []string) error {
				if len(args) != 1 || asJSON && output {
					return envflag.Usage("builds show takes one invocation id, and --json or --output")
				}
				return once("builds show", &lo, func(ctx context.Context, log *slog.Logger) error {
					if output {
						return showOutput(ctx, do, bo, project, args[0], log)
					}
					return showBuilds(ctx, do, project, args[0], asJSON, log)
				})(ctx, nil)
			}
		},
	}
}

// showOutput prints the console output of the one build with an
// invocation id (of project, if given), from the database and the archive.
func showOutput(ctx context.Context, do database.Options, bo bucket.Options, project, id string, log *slog.Logger) error {
	pool, err := database.Open(ctx, do.Config(false, log))
	if err != nil {
		return err
	}
	defer pool.Close()
	bk, err := bo.Open(ctx)
	if err != nil {
		return err
	}
	defer bk.Close()
	return console.WriteOutput(ctx, os.Stdout, os.Stderr, builds.OutputReader{DB: pool, Archive: archive.NewObjects(bk)}, project, id)
}

// showBuilds prints the builds with an invocation id (builds.Find).
func showBuilds(ctx context.Context, do database.Options, project, id string, asJSON bool, log *slog.Logger) error {
	pool, err := database.Open(ctx, do.Config(false, log))
	if err != nil {
		return err
	}
	defer pool.Close()
	if asJSON { // streamed: a build of a million events is never held whole
		return builds.FindJSON(ctx, pool, os.Stdout, project, id)
	}
	projects := []string{project}
	if project == "" {
		if projects, err = builds.Projects(ctx, pool, id); err != nil {
			return err
		}
	}
	if len(projects) == 0 {
		return fmt.Errorf("no build %q in the database", id)
	}
	for i, p := range projects { // a page of targets and tests at a time
		if i > 0 {
			fmt.Println()
		}
		err := console.WriteBuildPaged(ctx, os.Stdout, pool, p, id)
		if errors.Is(err, builds.ErrNotFound) {
			_, err = builds.Find(ctx, pool, p, id, false) // says which projects have it
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// What was stored before the edge redacted events: `builds scrub` rewrites
// the projected rows, `streams purge-bes` drops a project's raw events
// (JetStream cannot rewrite a stored message). See the upgrade notes in
// services/bes/README.md.

func buildsScrubCommand() command {
	return command{
		Name:    "builds scrub",
		Summary: "redact secrets from the projected rows of existing builds",
		Long: `Applies the BES edge's redaction rules (the same --bes-redact-* flags) to every
projected column that holds text from Bazel's events: commands, patterns, users,
hosts, workspaces, target kinds, failure reasons, tags and console output. For
builds stored before the edge redacted events. Idempotent; safe while the
projector runs. --dry-run counts what would change.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo     logs.Options
				do     database.Options
				ro     redact.Options
				so     builds.ScrubOptions
				asJSON bool
			)
			lo.RegisterFlags(fs)
			do.RegisterFlags(fs)
			ro.RegisterFlags(fs)
			fs.StringVar(&so.Project, "project", "", "scrub only this project's builds (default: every project)")
			fs.BoolVar(&so.DryRun, "dry-run", false, "count what would change; change nothing")
			fs.IntVar(&so.Batch, "batch", 500, "invocations per transaction")
			fs.BoolVar(&asJSON, "json", false, "print the totals as JSON")
			return once("builds scrub", &lo, func(ctx context.Context, log *slog.Logger) error {
				return scrubBuilds(ctx, do, ro, so, asJSON, log)
			})
		},
	}
}

// scrubBuilds redacts the projected rows, with progress on stderr and the
// totals on stdout.
func scrubBuilds(ctx context.Context, do database.Options, ro redact.Options, so builds.ScrubOptions, asJSON bool, log *slog.Logger) error {
	r, err := ro.Redactor()
	if err != nil {
		return err
	}
	pool, err := database.Open(ctx, do.Config(false, log))
	if err != nil {
		return err
	}
	defer pool.Close()
	start, last, verb := time.Now(), time.Time{}, "changed"
	if so.DryRun {
		verb = "would change"
	}
	so.Progress = func(st builds.ScrubStats) {
		if time.Since(last) >= time.Second {
			last = time.Now()
			fmt.Fprintf(os.Stderr, "\rbuilds scrub: %d invocations scanned, %s %d   ", st.Invocations, verb, st.InvocationsChanged)
		}
	}
	st, err := builds.Scrub(ctx, pool, r, so)
	fmt.Fprintln(os.Stderr)
	switch {
	case err != nil:
		return err
	case asJSON:
		return json.NewEncoder(os.Stdout).Encode(struct {
			builds.ScrubStats
			DryRun bool `json:"dry_run"`
		}{st, so.DryRun})
	}
	fmt.Printf("builds scrub: %d invocations scanned in %s; %s %d invocations, %d targets, %d metadata rows, %d console outputs\n",
		st.Invocations, time.Since(start).Round(time.Millisecond), verb, st.InvocationsChanged, st.TargetsChanged, st.MetadataChanged, st.OutputsChanged)
	return nil
}
