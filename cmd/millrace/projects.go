package main

import (
	"context"
	"flag"
	"log/slog"
	"os"

	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/logs"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
)

// Per-project settings: projects retention.

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
