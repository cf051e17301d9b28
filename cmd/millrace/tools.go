package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime/debug"
	"time"

	"github.com/millrace/millrace/console"
	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/internal/envflag"
	"github.com/millrace/millrace/migrations"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

func migrateCommand() command {
	return command{
		name:    "migrate",
		summary: "apply the database migrations",
		long:    "Brings the schema up to date. Safe to run from several processes at once (an advisory lock serialises them).",
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo logOptions
				do dbOptions
			)
			lo.register(fs)
			do.register(fs)
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"migrate takes no arguments"}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				url, err := database.URL(ctx, do.config(false, log))
				if err != nil {
					return err
				}
				from, to, err := migrations.ApplyURL(ctx, url)
				if err != nil {
					return err
				}
				fmt.Printf("schema version %d -> %d\n", from, to)
				return nil
			}
		},
	}
}

func streamsApplyCommand() command {
	return command{
		name:    "streams apply",
		summary: "create or update the JetStream streams",
		long:    "Applies the stream specs idempotently; every service also does this at start.",
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo logOptions
				no natsOptions
			)
			lo.register(fs)
			no.register(fs)
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"streams apply takes no arguments"}
				}
				if _, err := lo.logger(); err != nil {
					return err
				}
				bb, nc, err := no.open(ctx, "millrace-streams", nil)
				if err != nil {
					return err
				}
				defer bb.Close()
				for _, s := range streams.StreamSpecs(nc) {
					fmt.Printf("applied %s (%v)\n", s.Name, s.Subjects)
				}
				return nil
			}
		},
	}
}

func streamsInfoCommand() command {
	return command{
		name:    "streams info",
		summary: "show the streams and consumers",
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo     logOptions
				no     natsOptions
				asJSON bool
			)
			lo.register(fs)
			no.register(fs)
			fs.BoolVar(&asJSON, "json", false, "print JSON")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"streams info takes no arguments"}
				}
				if _, err := lo.logger(); err != nil {
					return err
				}
				bb, nc, err := no.open(ctx, "millrace-streams", nil)
				if err != nil {
					return err
				}
				defer bb.Close()
				out, err := streams.Describe(ctx, bb.JS, streams.StreamSpecs(nc))
				if err != nil {
					return err
				}
				if asJSON {
					enc := json.NewEncoder(os.Stdout)
					enc.SetIndent("", "  ")
					return enc.Encode(out)
				}
				for _, s := range out {
					fmt.Printf("%-6s %v  messages=%d bytes=%d seq=%d..%d\n", s.Name, s.Subjects, s.Messages, s.Bytes, s.FirstSeq, s.LastSeq)
					for _, c := range s.Consumers {
						fmt.Printf("  consumer %-12s pending=%d ack_pending=%d ack_floor=%d\n", c.Name, c.Pending, c.AckPending, c.AckFloor)
					}
				}
				return nil
			}
		},
	}
}

func replayBuildsCommand() command {
	return command{
		name:    "replay builds",
		summary: "rebuild the builds projection from the BES stream",
		long: `Empties the builds projection and applies the whole BES stream again; the result
equals what the live projector would have built. Stop the builds projector first
(replay refuses to run while it holds its lock); start it again afterwards.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo logOptions
				no natsOptions
				do dbOptions
				po projectorOptions
			)
			lo.register(fs)
			no.register(fs)
			do.register(fs)
			po.register(fs)
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"replay builds takes no arguments"}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				bb, _, err := no.open(ctx, "millrace-replay", nil)
				if err != nil {
					return err
				}
				defer bb.Close()
				pool, err := database.Open(ctx, do.config(true, log))
				if err != nil {
					return err
				}
				defer pool.Close()
				s, err := bb.JS.Stream(ctx, subjects.StreamBES)
				if err != nil {
					return err
				}
				total := s.CachedInfo().State.LastSeq
				start := time.Now()
				rc := withLogger(po.runnerConfig(), log)
				rc.Progress = replayProgress("replay builds", "events", total)
				proj, err := builds.New(builds.Config{AbandonAfter: po.abandonAfter})
				if err != nil {
					return err
				}
				runner := streams.NewRunner(bb.JS, pool, proj, rc, nil)
				if err := runner.Replay(ctx); err != nil {
					if errors.Is(err, streams.ErrLocked) {
						return errors.New("the builds projector is running (it holds the lock): stop it, replay, then start it again")
					}
					return err
				}
				fmt.Fprintf(os.Stderr, "\nreplay builds: done, %d events in %s\n", total, time.Since(start).Round(time.Millisecond))
				return nil
			}
		},
	}
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
		name:    "builds show",
		summary: "print the projection of one build",
		usage:   "<invocation_id> [--project P]",
		long: `Reads the database directly; no server needs to run.

A build is a project and an invocation id: clients of two projects may choose
the same id (Bazel's --invocation_id). With --project, prints that project's
build. Without it, prints every build with that id (one after the other);
with --json, it prints the build if exactly one project has the id, and
otherwise fails naming the projects that have it, so that a tool never reads
one tenant's build for another's.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo      logOptions
				do      dbOptions
				asJSON  bool
				project string
			)
			lo.register(fs)
			do.register(fs)
			fs.BoolVar(&asJSON, "json", false, "print JSON (the stable format tools compare)")
			envflag.String(fs, &project, "project", "MILLRACE_BUILDS_PROJECT", "", "the project of the build; empty: any project that has the invocation id")
			return func(ctx context.Context, args []string) error {
				if len(args) != 1 {
					return usageError{"builds show takes one invocation id"}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				pool, err := database.Open(ctx, do.config(false, log))
				if err != nil {
					return err
				}
				defer pool.Close()
				bs, err := builds.Find(ctx, pool, project, args[0], asJSON)
				if err != nil {
					return err
				}
				if asJSON {
					enc := json.NewEncoder(os.Stdout)
					enc.SetIndent("", "  ")
					return enc.Encode(bs[0])
				}
				for i, b := range bs {
					if i > 0 {
						fmt.Println()
					}
					console.WriteBuild(os.Stdout, b)
				}
				return nil
			}
		},
	}
}

// version is set at link time (-ldflags "-X main.version=...").
var version = ""

func versionCommand() command {
	return command{
		name:    "version",
		summary: "print the version",
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			return func(ctx context.Context, args []string) error {
				v := version
				if info, ok := debug.ReadBuildInfo(); ok && v == "" {
					v = info.Main.Version
					for _, s := range info.Settings {
						if s.Key == "vcs.revision" {
							v += " " + s.Value
						}
					}
				}
				if v == "" {
					v = "(devel)"
				}
				fmt.Println("millrace", v)
				return nil
			}
		},
	}
}
