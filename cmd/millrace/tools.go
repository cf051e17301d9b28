package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"strings"

	"github.com/millrace/millrace/internal/cli"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/internal/logs"
	"github.com/millrace/millrace/internal/resources"
	"github.com/millrace/millrace/migrations"
	"github.com/millrace/millrace/streams"
)

func migrateCommand() command {
	return command{
		Name:    "migrate",
		Summary: "apply the database migrations",
		Long:    "Brings the schema up to date. Safe to run from several processes at once (an advisory lock serialises them).",
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo logs.Options
				do database.Options
			)
			lo.RegisterFlags(fs)
			do.RegisterFlags(fs)
			return once("migrate", &lo, func(ctx context.Context, log *slog.Logger) error {
				url, err := database.URL(ctx, do.Config(false, log))
				if err != nil {
					return err
				}
				from, to, err := migrations.ApplyURL(ctx, url)
				if err == nil {
					fmt.Printf("schema version %d -> %d\n", from, to)
				}
				return err
			})
		},
	}
}

func streamsApplyCommand() command {
	return command{
		Name:    "streams apply",
		Summary: "create or update the JetStream streams",
		Long:    "Applies the stream specs idempotently; every service also does this at start.",
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo logs.Options
				ro resources.Options
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Backbone)
			return once("streams apply", &lo, func(ctx context.Context, log *slog.Logger) error {
				return tool(ctx, &ro, log, func(r *resources.Opened) error {
					for _, s := range streams.StreamSpecs(r.Streams) {
						fmt.Printf("applied %s (%v)\n", s.Name, s.Subjects)
					}
					return nil
				})
			})
		},
	}
}

func streamsAccountsCommand() command {
	return command{
		Name:    "streams accounts",
		Summary: "print the NATS accounts configuration of an external cluster",
		Long:    streams.AccountsDescription,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var n int
			envflag.Int(fs, &n, "bes-partitions", "MILLRACE_BES_PARTITIONS", 1, "the backbone's partitions of build events: the reader is kept off each partition's durables too")
			return func(ctx context.Context, args []string) error {
				return streams.WriteAccounts(os.Stdout, streams.Config{ServiceConsumers: serviceConsumers(), BESPartitions: n})
			}
		},
	}
}

func streamsBackupCommand() command {
	return command{
		Name:    "streams backup",
		Summary: "snapshot every stream, with its consumers, into a directory",
		Long:    streams.BackupDescription,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo  logs.Options
				ro  resources.Options
				out string
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Backbone)
			fs.StringVar(&out, "out", "", "directory to write the backup into (made; must not hold one)")
			return once("streams backup", &lo, func(ctx context.Context, log *slog.Logger) error {
				if out == "" {
					return envflag.Usage("streams backup needs --out")
				}
				return tool(ctx, &ro, log, func(r *resources.Opened) error {
					var names []string
					for _, s := range streams.StreamSpecs(r.Streams) {
						names = append(names, s.Name)
					}
					m, err := streams.Backup(ctx, r.BB.Conn, out, names, streams.PrintProgress(os.Stderr, "backed up"))
					m.Write(os.Stdout, "backed up")
					return err
				})
			})
		},
	}
}

func streamsRestoreCommand() command {
	return command{
		Name:    "streams restore",
		Summary: "restore the streams of a backup onto a fresh backbone",
		Long:    streams.RestoreDescription,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo   logs.Options
				ro   resources.Options
				from string
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Backbone)
			fs.StringVar(&from, "from", "", "directory of the backup (streams backup --out)")
			return once("streams restore", &lo, func(ctx context.Context, log *slog.Logger) error {
				if from == "" {
					return envflag.Usage("streams restore needs --from")
				}
				return tool(ctx, &ro, log, func(r *resources.Opened) error {
					m, err := streams.Restore(ctx, r.BB.Conn, r.BB.JS, from, streams.PrintProgress(os.Stderr, "restored"))
					if err != nil {
						return err
					}
					m.Write(os.Stdout, "restored")
					return streams.Apply(ctx, r.BB.JS, streams.StreamSpecs(r.Streams))
				})
			})
		},
	}
}

func streamsInfoCommand() command {
	return command{
		Name:    "streams info",
		Summary: "show the streams and consumers",
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo     logs.Options
				ro     resources.Options
				asJSON bool
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Backbone)
			fs.BoolVar(&asJSON, "json", false, "print JSON")
			return once("streams info", &lo, func(ctx context.Context, log *slog.Logger) error {
				return tool(ctx, &ro, log, func(r *resources.Opened) error {
					out, err := streams.Describe(ctx, r.BB.JS, streams.StreamSpecs(r.Streams))
					switch {
					case err != nil:
						return err
					case asJSON:
						return printJSON(out)
					}
					return streams.WriteInfo(os.Stdout, out)
				})
			})
		},
	}
}

func streamsPurgeBESCommand() command {
	return command{
		Name:    "streams purge-bes",
		Summary: "delete a project's raw build events from the BES stream",
		Long: `Purges the subjects bes.<project>.> of the BES stream: every raw event of the
project's builds, for events stored before the edge redacted secrets (JetStream
cannot rewrite a stored message). The projected rows stay (scrub them with
builds scrub); a replay of the builds projection can no longer rebuild these
builds. Each message is erased, not only purged: a purge marks messages
deleted but leaves their bytes in the store's blocks until JetStream compacts
them, so each one is overwritten in place (JetStream's secure delete), with
progress on standard error. Without --yes it only counts the messages.`,
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo      logs.Options
				ro      resources.Options
				project string
				yes     bool
			)
			lo.RegisterFlags(fs)
			ro.RegisterFlags(fs, resources.Backbone)
			fs.StringVar(&project, "project", "", "the project whose raw events go (required)")
			fs.BoolVar(&yes, "yes", false, "really delete them (without it: count only)")
			return once("streams purge-bes", &lo, func(ctx context.Context, log *slog.Logger) error {
				if project == "" {
					return envflag.Usage("streams purge-bes needs --project")
				}
				return tool(ctx, &ro, log, func(r *resources.Opened) error { return purgeBES(ctx, r.BB, project, yes) })
			})
		},
	}
}

// purgeBES erases the project's raw events (streams.EraseSubjects), or
// with yes unset counts them.
func purgeBES(ctx context.Context, bb *streams.Backbone, project string, yes bool) error {
	src, err := bb.BuildEvents(ctx)
	if err != nil {
		return err
	}
	where := strings.Join(bb.Layout.Streams(), ", ")
	n, invocations, err := src.Count(ctx, project)
	switch {
	case err != nil:
		return err
	case !yes:
		fmt.Printf("streams purge-bes: %s holds %d messages of project %s (%d invocations); run again with --yes to delete them\n",
			where, n, project, invocations)
		return nil
	}
	erased, err := src.Erase(ctx, project, "", func(erased, total uint64) {
		fmt.Fprintf(os.Stderr, "streams purge-bes: erased %d of %d messages\n", erased, max(n, total))
	})
	if err != nil {
		return fmt.Errorf("erase the raw events of project %s (%d messages erased): %w", project, erased, err)
	}
	fmt.Printf("streams purge-bes: deleted %d messages of project %s (%d invocations), their bytes overwritten\n", erased, project, invocations)
	return nil
}

func printJSON(v any) error {
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// version is set at link time (-ldflags "-X main.version=...").
var version = ""

func versionCommand() command {
	return command{
		Name:    "version",
		Summary: "print the version",
		Flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			return func(ctx context.Context, args []string) error {
				fmt.Println("millrace", cli.Version(version))
				return nil
			}
		},
	}
}
