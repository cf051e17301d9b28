package main

import (
	"context"
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
	"github.com/millrace/millrace/internal/resources"
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
	rc    streams.RunnerConfig
	group streams.GroupConfig
	c     builds.Config
	rt    builds.RetentionConfig
	ex    builds.ExpireConfig
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
	envflag.Duration(fs, &o.group.HeartbeatEvery, "builds-group-heartbeat", "MILLRACE_BUILDS_GROUP_HEARTBEAT", streams.DefaultGroupHeartbeat, "with --bes-partitions above 1: how often an instance renews its membership of the builds projectors' group and reads the others' (a joining or leaving instance's partitions move within about two of these); one that died gives its partitions up five of these after its last")
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
			src, err := p.bb.BuildEvents(ctx)
			if err != nil {
				return err
			}
			raw = archive.NewRawExpirer(pool, p.bk, src).RestoreOutputWith(outputMover{p.bb.Layout}, p.bk)
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

// buildsProjector runs the builds projector: its one runner, or, when
// build events are partitioned, this instance's share of the partitions
// (streams.Backbone.RunByPartition).
func (p *process) buildsProjector(proj *builds.Projector, o *projectorOptions) supervise.Component {
	return p.consumer(builds.ConsumerName, func(ctx context.Context, pool *pgxpool.Pool) error {
		gc := o.group
		gc.Group, gc.Logger = builds.ConsumerName, p.log.With("component", "projector")
		return p.bb.RunByPartition(ctx, pool, o.runnerConfig(p.log), gc, p.t.sm, func(part int) projection.Projector {
			return proj.ForPartition(p.bb.Layout, part)
		})
	})
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
		Long:    builds.ProjectDescription,
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
				cs := []supervise.Component{p.database(do), p.buildsProjector(proj, &bo)}
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
		Long:    builds.ReplayDescription,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo   logs.Options
				ro   resources.Options
				po   projectorOptions
				part int
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Backbone|resources.Migrated|resources.Bucket)
			po.register(fs)
			fs.IntVar(&part, "partition", -1, "with --bes-partitions above 1: replay this partition alone (-1: every partition, one after the other); the projectors go on with the others")
			return once("replay builds", &lo, func(ctx context.Context, log *slog.Logger) error {
				return ro.Run(ctx, "millrace-replay", serviceConsumers(), log, func(r *resources.Opened) error { return replayBuilds(ctx, r, po, part, log) })
			})
		},
	}
}

// replayBuilds replays the builds projection, each partition of build
// events in turn or partition part alone (streams.ReplayByPartition:
// the partitions it replays paused, the projectors running on with the
// others; in the one-stream layout the projector must be stopped), then
// moves the console output into the archive again.
func replayBuilds(ctx context.Context, r *resources.Opened, po projectorOptions, part int, log *slog.Logger) error {
	proj, err := po.projector()
	if err != nil {
		return err
	}
	host, _ := os.Hostname()
	err = streams.ReplayByPartition(ctx, r.Pool, r.BB.Layout, builds.ConsumerName, part, fmt.Sprintf("replay builds on %s, process %d", host, os.Getpid()), os.Stderr,
		func(part int) error {
			return replayPartition(ctx, r, po, proj.ForPartition(r.BB.Layout, part), part, log)
		})
	if err != nil {
		return err
	}
	return moveOutputAgain(ctx, r, log)
}

// replayPartition replays partition part by its projector pp (the whole
// projection in the one-stream layout) by the plan archive.PlanReplay
// makes once the replay holds the stream (streams.Runner.ReplayPlanned),
// and says what it will do.
func replayPartition(ctx context.Context, r *resources.Opened, po projectorOptions, pp *builds.Projector, part int, log *slog.Logger) error {
	l, rc, label := r.BB.Layout, po.runnerConfig(log), "replay builds"
	rc.Stream, rc.Filter = l.Stream(part), l.Filter(part)
	if l.Partitioned() {
		label = fmt.Sprintf("replay builds, partition %d of %d", part, l.N())
	}
	reset := func(ctx context.Context, tx pgx.Tx, keep []archive.BuildID) error {
		ks := make([]builds.Key, len(keep))
		for i, k := range keep {
			ks[i] = builds.Key(k)
		}
		return pp.ResetExcept(ctx, tx, ks)
	}
	return replayStream(ctx, r.BB, r.Pool, pp, rc, func(ctx context.Context) (projection.ReplayPlan, error) {
		st, err := r.BB.Stream(ctx, rc.Stream)
		if err != nil {
			return projection.ReplayPlan{}, err
		}
		s := st.CachedInfo().State
		plan, planned, err := archive.PlanReplay(ctx, r.Pool, r.Bucket, archive.StreamTail{FirstSeq: s.FirstSeq, FirstTime: s.FirstTime, LastSeq: s.LastSeq},
			reset, archive.ReplayOptions{RawKept: r.Streams.BESMaxAge, Progress: archive.ProgressLine(os.Stderr, label, "archived builds"),
				Layout: l, Partition: part})
		if err == nil {
			fmt.Fprintf(os.Stderr, "%s: %d builds from the archive, then the stream; %d kept as they are (raw events past --retention-raw-days)\n",
				label, planned.Archived, planned.Kept)
		}
		return plan, err
	}, label, "events")
}

// moveOutputAgain moves the console output that the replay folded into
// pages into the archive again, so that the replay ends where the live run
// was.
func moveOutputAgain(ctx context.Context, r *resources.Opened, log *slog.Logger) error {
	src, err := r.BB.BuildEvents(ctx)
	if err != nil {
		return err
	}
	a, err := archive.New(archive.Config{Logger: log, Layout: r.BB.Layout}, r.Pool, r.Bucket, src, nil)
	if err != nil {
		return err
	}
	n, err := a.MoveOutputWith(outputMover{r.BB.Layout}).MoveAllOutputs(ctx)
	fmt.Fprintf(os.Stderr, "replay builds: the console output of %d archived builds moved into the archive again\n", n)
	return err
}

// replayStream empties p's projection and applies rc.Stream again by plan,
// with its progress on stderr under label (streams.Runner.ReplayReported);
// unit names the stream's messages there.
func replayStream(ctx context.Context, bb *streams.Backbone, pool *pgxpool.Pool, p projection.Projector, rc streams.RunnerConfig, plan streams.Planner, label, unit string) error {
	r, err := streams.NewRunner(bb.JS, pool, p, rc, nil)
	if err != nil {
		return err
	}
	return r.ReplayReported(ctx, plan, os.Stderr, label, unit)
}

func buildsShowCommand() command {
	return command{
		Name:    "builds show",
		Summary: "print the projection of one build",
		Usage:   "<invocation_id> [--project P] [--json | --output]",
		Long:    builds.ShowDescription,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo      logs.Options
				ro      resources.Options
				asJSON  bool
				output  bool
				project string
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Database|resources.Bucket)
			fs.BoolVar(&asJSON, "json", false, "print JSON (the stable format tools compare)")
			fs.BoolVar(&output, "output", false, "print the build's console output: stdout to standard output, stderr to standard error")
			envflag.String(fs, &project, "project", "MILLRACE_BUILDS_PROJECT", "", "the project of the build; empty: any project that has the invocation id")
			return func(ctx context.Context, args []string) error {
				if len(args) != 1 || asJSON && output {
					return envflag.Usage("builds show takes one invocation id, and --json or --output")
				}
				o := ro
				if !output { // the bucket holds only console output
					o = ro.Only(resources.Database)
				}
				return once("builds show", &lo, func(ctx context.Context, log *slog.Logger) error {
					return tool(ctx, &o, log, func(r *resources.Opened) error { return showBuilds(ctx, r, project, args[0], asJSON, output) })
				})(ctx, nil)
			}
		},
	}
}

// showBuilds prints the builds with an invocation id (of project, if
// given), or the console output of the one build.
func showBuilds(ctx context.Context, r *resources.Opened, project, id string, asJSON, output bool) error {
	switch {
	case output:
		return console.WriteOutput(ctx, os.Stdout, os.Stderr, builds.OutputReader{DB: r.Pool, Archive: archive.NewObjects(r.Bucket)}, project, id)
	case asJSON: // streamed: a build of a million events is never held whole
		return builds.FindJSON(ctx, r.Pool, os.Stdout, project, id)
	}
	return console.WriteBuilds(ctx, os.Stdout, r.Pool, project, id)
}

// What was stored before the edge redacted events: `builds scrub` rewrites
// the projected rows, `streams purge-bes` drops a project's raw events
// (JetStream cannot rewrite a stored message). See the upgrade notes in
// services/bes/README.md.

func buildsScrubCommand() command {
	return command{
		Name:    "builds scrub",
		Summary: "redact secrets from the projected rows of existing builds",
		Long:    builds.ScrubDescription,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo     logs.Options
				rs     resources.Options
				ro     redact.Options
				so     builds.ScrubOptions
				asJSON bool
			)
			lo.RegisterFlags(fs)
			rs.RegisterFlags(fs, resources.Database)
			ro.RegisterFlags(fs)
			fs.StringVar(&so.Project, "project", "", "scrub only this project's builds (default: every project)")
			fs.BoolVar(&so.DryRun, "dry-run", false, "count what would change; change nothing")
			fs.IntVar(&so.Batch, "batch", 500, "invocations per transaction")
			fs.BoolVar(&asJSON, "json", false, "print the totals as JSON")
			return once("builds scrub", &lo, func(ctx context.Context, log *slog.Logger) error {
				red, err := ro.Redactor()
				if err != nil {
					return err
				}
				return tool(ctx, &rs, log, func(r *resources.Opened) error {
					start := time.Now()
					so.Progress = builds.ScrubProgress(os.Stderr, so.DryRun)
					st, err := builds.Scrub(ctx, r.Pool, red, so)
					fmt.Fprintln(os.Stderr)
					if err != nil {
						return err
					}
					return builds.WriteScrub(os.Stdout, st, so.DryRun, time.Since(start), asJSON)
				})
			})
		},
	}
}
