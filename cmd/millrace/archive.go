package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/logs"
	"github.com/millrace/millrace/internal/supervise"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The raw archive: the archiver (in project builds and dev), zstd train,
// archive verify.

func besSource(ctx context.Context, bb *streams.Backbone) (streams.SubjectReader, error) {
	s, err := bb.JS.Stream(ctx, subjects.StreamBES)
	if err != nil {
		return streams.SubjectReader{}, fmt.Errorf("stream %s: %w", subjects.StreamBES, err)
	}
	return streams.SubjectReader{Stream: s}, nil
}

// archiver moves finished builds' raw events into the process's bucket.
func (p *process) archiver(c archive.Config) supervise.Component {
	c.Logger = p.log.With("component", "archiver")
	m := archive.NewMetrics(p.t.reg)
	return p.consumer("archiver", func(ctx context.Context, pool *pgxpool.Pool) error {
		src, err := besSource(ctx, p.bb)
		if err != nil {
			return err
		}
		a, err := archive.New(c, pool, p.bk, src, m)
		if err != nil {
			return err
		}
		return a.TrimWith(streams.SubjectTrimmer{Stream: src.Stream}).MoveOutputWith(outputMover{}).Run(ctx)
	})
}

// outputMover is builds.MoveOutput and RestoreOutput as the archive calls
// them (neither package imports the other).
type outputMover struct{}

func (outputMover) MoveOutput(ctx context.Context, tx pgx.Tx, b archive.OutputBuild, msgs archive.Messages) (archive.OutputMoved, error) {
	r, err := builds.MoveOutput(ctx, tx, b.Project, b.ID, b.Through, b.Moved, builds.Messages(msgs))
	return archive.OutputMoved{Moved: r.Moved, Pending: r.Pending, Bytes: r.Bytes, Differs: r.Differs}, err
}

func (outputMover) RestoreOutput(ctx context.Context, tx pgx.Tx, b archive.OutputBuild, msgs archive.Messages) error {
	return builds.RestoreOutput(ctx, tx, b.Project, b.ID, b.Through, b.Moved, builds.Messages(msgs))
}

func zstdTrainCommand() command {
	return command{
		Name:    "zstd train",
		Summary: "train the raw archive's zstd dictionary and make it current",
		Usage:   "[recording.besrec ...] | --from-stream [--builds N]",
		Long: `Trains a dictionary on builds' records as the archive writes them (subjects,
headers and events), from BES recordings (loadtest/besrecord's format) or from
builds in the BES stream, stores it in the bucket (--bucket-url) under a new id
and makes it current: the archiver uses it for the builds it writes next, and
objects written with an older one stay readable. Every fifth build is held out
and archived with the new dictionary and with plain zstd: it prints the
dictionary's id, its size and both ratios.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo         logs.Options
				no         streams.Options
				bo         bucket.Options
				fromStream bool
				n, size    int
			)
			lo.RegisterFlags(fs)
			no.RegisterFlags(fs)
			bo.RegisterFlags(fs)
			fs.BoolVar(&fromStream, "from-stream", false, "train on builds in the BES stream rather than on recordings")
			fs.IntVar(&n, "builds", 200, "with --from-stream: how many builds, taken at random")
			fs.IntVar(&size, "size", archive.DefaultDictBytes, "largest dictionary, in bytes")
			return func(ctx context.Context, args []string) error {
				if fromStream == (len(args) > 0) || n < 1 || size < 256 {
					return envflag.Usage("zstd train takes recordings or --from-stream (--builds at least 1, --size at least 256)")
				}
				return once("zstd train", &lo, func(ctx context.Context, _ *slog.Logger) error {
					builds, err := trainingBuilds(ctx, no, args, n)
					if err != nil {
						return err
					}
					return trainDict(ctx, bo, builds, size)
				})(ctx, nil)
			}
		},
	}
}

// trainingBuilds reads the recordings, or n builds of the stream.
func trainingBuilds(ctx context.Context, no streams.Options, files []string, n int) (out []archive.Build, err error) {
	if len(files) > 0 {
		return archive.FromRecordings(files)
	}
	return out, withBackbone(ctx, no, func(bb *streams.Backbone, _ streams.Config) error {
		src, err := besSource(ctx, bb)
		if err != nil {
			return err
		}
		// More than two messages: an invocation, not a build's two
		// lifecycle events.
		subs, err := streams.SampleSubjects(ctx, src.Stream, subjects.BESFilter, n, 2)
		for _, s := range subs {
			b, err := archive.ReadBuild(ctx, src, s, 16<<20)
			if err != nil {
				return err
			}
			out = append(out, b)
		}
		return err
	})
}

// trainDict trains, stores and measures the dictionary, and prints it.
func trainDict(ctx context.Context, bo bucket.Options, builds []archive.Build, size int) error {
	bk, err := bo.Open(ctx)
	if err != nil {
		return err
	}
	defer bk.Close()
	t, err := archive.TrainAndSave(ctx, archive.NewDicts(bk), builds, size)
	if err != nil {
		return err
	}
	fmt.Println(t)
	return nil
}

func archiveVerifyCommand() command {
	return command{
		Name:    "archive verify",
		Summary: "read archived builds back and check them against the stream and the projection",
		Long: `Reads each archived build's object from the bucket (--bucket-url) and checks it:
it decodes whole to what archived_builds records; event by event (sequence,
stored time, subject, every header, data) against the BES stream while the
stream still holds the build; and its tool events and last tool sequence
against the projection. Prints a line per bad build with the reason and a
summary (--json: one JSON object per build, then the summary), records each
verdict in archived_builds, and exits non-zero if any build is bad. Progress
on standard error.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo     logs.Options
				no     streams.Options
				do     database.Options
				bo     bucket.Options
				vo     archive.VerifyOptions
				asJSON bool
			)
			lo.RegisterFlags(fs)
			no.RegisterFlags(fs)
			do.RegisterFlags(fs)
			bo.RegisterFlags(fs)
			fs.StringVar(&vo.Project, "project", "", "only this project's builds")
			fs.StringVar(&vo.ID, "id", "", "only builds with this invocation id")
			fs.BoolVar(&asJSON, "json", false, "print JSON: an object per build, then the summary")
			return once("archive verify", &lo, func(ctx context.Context, log *slog.Logger) error {
				return verifyArchive(ctx, no, do, bo, vo, asJSON, log)
			})
		},
	}
}

// verifyArchive runs archive.Verify and prints its findings.
func verifyArchive(ctx context.Context, no streams.Options, do database.Options, bo bucket.Options, vo archive.VerifyOptions, asJSON bool, log *slog.Logger) error {
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
	return withBackbone(ctx, no, func(bb *streams.Backbone, _ streams.Config) error {
		src, err := besSource(ctx, bb)
		if err != nil {
			return err
		}
		vo.Progress = func(done, total int) { fmt.Fprintf(os.Stderr, "\rarchive verify: %d/%d builds   ", done, total) }
		sum, err := archive.Verify(ctx, pool, bk, src, vo, func(f archive.Finding) {
			switch {
			case asJSON:
				printJSON(f)
			case f.Error != "":
				fmt.Printf("bad: %s of project %s (%s): %s\n", f.Invocation, f.Project, f.Key, strings.TrimSpace(f.Error))
			}
		})
		fmt.Fprintln(os.Stderr)
		if err != nil {
			return err
		}
		if asJSON {
			printJSON(sum)
		} else {
			fmt.Printf("archive verify: %d builds, %d bad\n", sum.Builds, sum.Bad)
		}
		if sum.Bad > 0 {
			return fmt.Errorf("%d of %d archived builds are bad", sum.Bad, sum.Builds)
		}
		return nil
	})
}
