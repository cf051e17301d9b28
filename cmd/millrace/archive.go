package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/logs"
	"github.com/millrace/millrace/internal/resources"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The raw archive: the archiver (in project builds and dev), zstd train,
// archive verify.

// archiver moves finished builds' raw events into the process's bucket.
func (p *process) archiver(c archive.Config) supervise.Component {
	c.Logger = p.log.With("component", "archiver")
	m := archive.NewMetrics(p.t.reg)
	return p.consumer("archiver", func(ctx context.Context, pool *pgxpool.Pool) error {
		src, err := p.bb.BuildEvents(ctx)
		if err != nil {
			return err
		}
		c.Layout = p.bb.Layout
		a, err := archive.New(c, pool, p.bk, src, m)
		if err != nil {
			return err
		}
		return a.TrimWith(src).MoveOutputWith(outputMover{p.bb.Layout}).Run(ctx)
	})
}

// outputMover is builds.MoveOutput and RestoreOutput as the archive calls
// them (neither package imports the other), each build's output moved
// under its partition's position (builds.PositionOf).
type outputMover struct{ layout subjects.BESLayout }

func (m outputMover) MoveOutput(ctx context.Context, tx pgx.Tx, b archive.OutputBuild, msgs archive.Messages) (archive.OutputMoved, error) {
	r, err := builds.MoveOutput(ctx, tx, builds.PositionOf(m.layout, b.Project, b.ID), b.Project, b.ID, b.Through, b.Moved, builds.Messages(msgs))
	return archive.OutputMoved{Moved: r.Moved, Pending: r.Pending, Bytes: r.Bytes, Differs: r.Differs}, err
}

func (m outputMover) RestoreOutput(ctx context.Context, tx pgx.Tx, b archive.OutputBuild, msgs archive.Messages) error {
	return builds.RestoreOutput(ctx, tx, builds.PositionOf(m.layout, b.Project, b.ID), b.Project, b.ID, b.Through, b.Moved, builds.Messages(msgs))
}

func zstdTrainCommand() command {
	return command{
		Name:    "zstd train",
		Summary: "train the raw archive's zstd dictionary and make it current",
		Usage:   "[recording.besrec ...] | --from-stream [--builds N]",
		Long:    archive.TrainDescription,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo         logs.Options
				ro         resources.Options
				fromStream bool
				n, size    int
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Backbone|resources.Bucket)
			fs.BoolVar(&fromStream, "from-stream", false, "train on builds in the BES stream rather than on recordings")
			fs.IntVar(&n, "builds", 200, "with --from-stream: how many builds, taken at random")
			fs.IntVar(&size, "size", archive.DefaultDictBytes, "largest dictionary, in bytes")
			return func(ctx context.Context, args []string) error {
				if fromStream == (len(args) > 0) || n < 1 || size < 256 {
					return envflag.Usage("zstd train takes recordings or --from-stream (--builds at least 1, --size at least 256)")
				}
				o := ro
				if !fromStream {
					o = ro.Only(resources.Bucket)
				}
				return once("zstd train", &lo, func(ctx context.Context, log *slog.Logger) error {
					return tool(ctx, &o, log, func(r *resources.Opened) error { return trainDict(ctx, r, args, n, size) })
				})(ctx, nil)
			}
		},
	}
}

// trainDict trains the dictionary on the recordings, or on n builds of the
// stream, stores and measures it, and prints it.
func trainDict(ctx context.Context, r *resources.Opened, files []string, n, size int) error {
	builds, err := trainingBuilds(ctx, r.BB, files, n)
	if err != nil {
		return err
	}
	t, err := archive.TrainAndSave(ctx, archive.NewDicts(r.Bucket), builds, size)
	if err != nil {
		return err
	}
	fmt.Println(t)
	return nil
}

// trainingBuilds reads the recordings, or n builds of the stream.
func trainingBuilds(ctx context.Context, bb *streams.Backbone, files []string, n int) (out []archive.Build, err error) {
	if len(files) > 0 {
		return archive.FromRecordings(files)
	}
	src, err := bb.BuildEvents(ctx)
	if err != nil {
		return nil, err
	}
	// More than two messages: an invocation, not a build's two lifecycle
	// events.
	subs, err := src.Sample(ctx, n, 2)
	if err != nil {
		return nil, err
	}
	for _, s := range subs {
		b, err := archive.ReadBuild(ctx, src, s, 16<<20)
		if err != nil {
			return nil, err
		}
		out = append(out, b)
	}
	return out, err
}

func archiveVerifyCommand() command {
	return command{
		Name:    "archive verify",
		Summary: "read archived builds back and check them against the stream and the projection",
		Long:    archive.VerifyDescription,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo     logs.Options
				ro     resources.Options
				vo     archive.VerifyOptions
				asJSON bool
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Backbone|resources.Database|resources.Bucket)
			fs.StringVar(&vo.Project, "project", "", "only this project's builds")
			fs.StringVar(&vo.ID, "id", "", "only builds with this invocation id")
			fs.BoolVar(&asJSON, "json", false, "print JSON: an object per build, then the summary")
			return once("archive verify", &lo, func(ctx context.Context, log *slog.Logger) error {
				return tool(ctx, &ro, log, func(r *resources.Opened) error { return verifyArchive(ctx, r, vo, asJSON) })
			})
		},
	}
}

// verifyArchive runs archive.Verify and prints its findings.
func verifyArchive(ctx context.Context, r *resources.Opened, vo archive.VerifyOptions, asJSON bool) error {
	src, err := r.BB.BuildEvents(ctx)
	if err != nil {
		return err
	}
	vo.Progress = archive.ProgressLine(os.Stderr, "archive verify", "builds")
	sum, err := archive.Verify(ctx, r.Pool, r.Bucket, src, vo, func(f archive.Finding) { archive.WriteFinding(os.Stdout, f, asJSON) })
	fmt.Fprintln(os.Stderr)
	if err != nil {
		return err
	}
	return archive.WriteSummary(os.Stdout, sum, asJSON)
}
