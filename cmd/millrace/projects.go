package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/logs"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
)

// Per-project data: projects retention, builds delete.

func projectsRetentionCommand() command {
	return command{
		Name:    "projects retention",
		Summary: "show or set how long each project's raw events, rows and rollups are kept",
		Usage:   "[--project P] [--raw-days N] [--rows-days N] [--rollup-days N] [--json]",
		Long: `Without a --*-days flag, prints the effective retention in days (0: for ever) of
raw events, finished builds' rows and rollups of every project with builds or
an override, or of --project (* marks its own values). With one, sets --project's
(0: the default); raw may not outlive rows, nor rows rollups (projectors/builds).`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo      logs.Options
				do      database.Options
				rc      builds.RetentionConfig
				raw     int
				project string
				set     builds.RetentionSet
				asJSON  bool
			)
			lo.RegisterFlags(fs)
			do.RegisterFlags(fs)
			rc.RegisterFlags(fs)
			streams.RegisterRetentionRawDays(fs, &raw)
			fs.StringVar(&project, "project", "", "the project to show or set (setting needs it)")
			envflag.OptionalInt(fs, &set.RawDays, "raw-days", "set the project's raw retention to `N` days (0: the default)")
			envflag.OptionalInt(fs, &set.RowsDays, "rows-days", "set the project's rows retention to `N` days (0: the default)")
			envflag.OptionalInt(fs, &set.RollupDays, "rollup-days", "set the project's rollup retention to `N` days (0: the default)")
			fs.BoolVar(&asJSON, "json", false, "print JSON: one object per project")
			return once("projects retention", &lo, func(ctx context.Context, log *slog.Logger) error {
				def, err := rc.Defaults(raw)
				if err != nil {
					return envflag.Usage(err.Error())
				} else if !set.Empty() && project == "" {
					return envflag.Usage("projects retention: setting a retention needs --project")
				}
				pool, err := database.Open(ctx, do.Config(false, log))
				if err != nil {
					return err
				}
				defer pool.Close()
				ps, err := builds.SetOrListRetention(ctx, pool, def, project, set)
				if err != nil {
					return err
				}
				return builds.WriteRetention(os.Stdout, ps, asJSON)
			})
		},
	}
}

func buildsDeleteCommand() command {
	return command{
		Name:    "builds delete",
		Summary: "delete a build or a whole project: rows, rollup counts, raw events",
		Usage:   "--project P (--id ID | --all) [--yes]",
		Long: `Deletes the build (or every build of the project) from the BES stream (its bytes
overwritten), the archive and the database, where the rollups forget what it
counted; no other project's data is touched. --all needs --yes. A build still
sending events starts again with them. See archive/README.md, "Deletion".`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo               logs.Options
				no               streams.Options
				do               database.Options
				ko               bucket.Options
				project, id      string
				all, yes, asJSON bool
			)
			lo.RegisterFlags(fs)
			no.RegisterFlags(fs)
			do.RegisterFlags(fs)
			ko.RegisterFlags(fs)
			fs.StringVar(&project, "project", "", "the project (required)")
			fs.StringVar(&id, "id", "", "the invocation id of the build to delete")
			fs.BoolVar(&all, "all", false, "delete every build of the project")
			fs.BoolVar(&yes, "yes", false, "with --all: really delete them")
			fs.BoolVar(&asJSON, "json", false, "print what was deleted as JSON")
			return once("builds delete", &lo, func(ctx context.Context, log *slog.Logger) error {
				switch {
				case project == "" || (id == "") == !all:
					return envflag.Usage("builds delete needs --project and one of --id or --all")
				case all && !yes:
					return envflag.Usagef("builds delete --all deletes every build of project %q: run it again with --yes", project)
				}
				return withBackbone(ctx, no, func(bb *streams.Backbone, _ streams.Config) error {
					return deleteBuilds(ctx, bb, do, ko, project, id, asJSON, log)
				})
			})
		},
	}
}

// deleteBuilds deletes project's build id, or with id "" the project
// (archive.Delete), with a project's progress on stderr.
func deleteBuilds(ctx context.Context, bb *streams.Backbone, do database.Options, ko bucket.Options, project, id string, asJSON bool, log *slog.Logger) error {
	src, err := besSource(ctx, bb)
	if err != nil {
		return err
	}
	pool, err := database.Open(ctx, do.Config(false, log))
	if err != nil {
		return err
	}
	defer pool.Close()
	bk, err := ko.Open(ctx)
	if err != nil {
		return err
	}
	defer bk.Close()
	erase := func(ctx context.Context, filter string) (uint64, error) {
		return streams.EraseSubjects(ctx, src.Stream, filter, nil)
	}
	progress := func(s string) { fmt.Fprintln(os.Stderr, "builds delete: "+s) }
	if id != "" {
		progress = nil
	}
	d, err := archive.Delete(ctx, pool, bk, erase, builds.DeleteRows, project, id, progress)
	switch {
	case err != nil:
		return err
	case id != "" && d == (archive.Deleted{}):
		return fmt.Errorf("project %q has no build %q (no rows, raw events or archive object)", project, id)
	case asJSON:
		return printJSON(d)
	}
	fmt.Printf("builds delete: deleted %d builds' rows, %d stream messages, %d archive objects of project %q\n", d.Builds, d.Messages, d.Objects, project)
	return nil
}
