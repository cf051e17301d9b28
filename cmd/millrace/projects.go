package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/logs"
	"github.com/millrace/millrace/internal/resources"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
)

// Per-project data: projects retention, builds delete.

func projectsRetentionCommand() command {
	return command{
		Name:    "projects retention",
		Summary: "show or set how long each project's raw events, rows and rollups are kept",
		Usage:   "[--project P] [--raw-days N] [--rows-days N] [--rollup-days N] [--json]",
		Long:    builds.RetentionDescription,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo      logs.Options
				ro      resources.Options
				rc      builds.RetentionConfig
				raw     int
				project string
				set     builds.RetentionSet
				asJSON  bool
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Database)
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
				return tool(ctx, &ro, log, func(r *resources.Opened) error {
					ps, err := builds.SetOrListRetention(ctx, r.Pool, def, project, set)
					if err != nil {
						return err
					}
					return builds.WriteRetention(os.Stdout, ps, asJSON)
				})
			})
		},
	}
}

func buildsDeleteCommand() command {
	return command{
		Name:    "builds delete",
		Summary: "delete a build or a whole project: rows, rollup counts, raw events",
		Usage:   "--project P (--id ID | --all) [--yes]",
		Long:    archive.DeleteDescription,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo               logs.Options
				ro               resources.Options
				project, id      string
				all, yes, asJSON bool
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Backbone|resources.Database|resources.Bucket)
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
				return tool(ctx, &ro, log, func(r *resources.Opened) error { return deleteBuilds(ctx, r, project, id, asJSON) })
			})
		},
	}
}

// deleteBuilds deletes project's build id, or with id "" the project
// (archive.Delete), with a project's progress on stderr.
func deleteBuilds(ctx context.Context, r *resources.Opened, project, id string, asJSON bool) error {
	src, err := r.BB.BuildEvents(ctx)
	if err != nil {
		return err
	}
	erase := func(ctx context.Context, project, id string) (uint64, error) {
		return src.Erase(ctx, project, id, nil)
	}
	progress := func(s string) { fmt.Fprintln(os.Stderr, "builds delete: "+s) }
	if id != "" {
		progress = nil
	}
	d, err := archive.Delete(ctx, r.Pool, r.Bucket, erase, builds.DeleteRows, project, id, progress)
	switch {
	case err != nil:
		return err
	case id != "" && d == (archive.Deleted{}):
		return fmt.Errorf("project %q has no build %q (no rows, raw events or archive object)", project, id)
	}
	return archive.WriteDeleted(os.Stdout, d, project, asJSON)
}
