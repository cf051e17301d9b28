package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"os"
	"time"

	"github.com/millrace/millrace/internal/database"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// What was stored before the edge redacted events: `builds scrub` rewrites
// the projected rows, `streams purge-bes` drops a project's raw events
// (JetStream cannot rewrite a stored message). See the upgrade notes in
// services/bes/README.md.

func buildsScrubCommand() command {
	return command{
		name:    "builds scrub",
		summary: "redact secrets from the projected rows of existing builds",
		long: `Applies the BES edge's redaction rules (the same --bes-redact-* flags) to every
projected column that holds text from Bazel's events: commands, patterns, users,
hosts, workspaces, target kinds, failure reasons, tags and console output. For
builds stored before the edge redacted events. Idempotent; safe while the
projector runs. --dry-run counts what would change.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo      logOptions
				do      dbOptions
				ro      redactOptions
				project string
				dryRun  bool
				batch   int
				asJSON  bool
			)
			lo.register(fs)
			do.register(fs)
			ro.register(fs)
			fs.StringVar(&project, "project", "", "scrub only this project's builds (default: every project)")
			fs.BoolVar(&dryRun, "dry-run", false, "count what would change; change nothing")
			fs.IntVar(&batch, "batch", 500, "invocations per transaction")
			fs.BoolVar(&asJSON, "json", false, "print the totals as JSON")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"builds scrub takes no arguments"}
				}
				log, err := lo.logger()
				if err != nil {
					return err
				}
				r, err := ro.redactor()
				if err != nil {
					return err
				}
				pool, err := database.Open(ctx, do.config(false, log))
				if err != nil {
					return err
				}
				defer pool.Close()
				start, last := time.Now(), time.Time{}
				verb := "changed"
				if dryRun {
					verb = "would change"
				}
				st, err := builds.Scrub(ctx, pool, r, builds.ScrubOptions{Project: project, DryRun: dryRun, Batch: batch,
					Progress: func(st builds.ScrubStats) {
						if time.Since(last) < time.Second {
							return
						}
						last = time.Now()
						fmt.Fprintf(os.Stderr, "\rbuilds scrub: %d invocations scanned, %s %d   ", st.Invocations, verb, st.InvocationsChanged)
					}})
				fmt.Fprintln(os.Stderr)
				if err != nil {
					return err
				}
				if asJSON {
					return json.NewEncoder(os.Stdout).Encode(struct {
						builds.ScrubStats
						DryRun bool `json:"dry_run"`
					}{st, dryRun})
				}
				fmt.Printf("builds scrub: %d invocations scanned in %s; %s %d invocations, %d targets, %d console outputs\n",
					st.Invocations, time.Since(start).Round(time.Millisecond), verb, st.InvocationsChanged, st.TargetsChanged, st.OutputsChanged)
				return nil
			}
		},
	}
}

func streamsPurgeBESCommand() command {
	return command{
		name:    "streams purge-bes",
		summary: "delete a project's raw build events from the BES stream",
		long: `Purges the subjects bes.<project>.> of the BES stream: every raw event of the
project's builds, for events stored before the edge redacted secrets (JetStream
cannot rewrite a stored message). The projected rows stay (scrub them with
builds scrub); a replay of the builds projection can no longer rebuild these
builds. Each message is erased, not only purged: a purge marks messages
deleted but leaves their bytes in the store's blocks until JetStream compacts
them, so each one is overwritten in place (JetStream's secure delete), with
progress on standard error. Without --yes it only counts the messages.`,
		flags: func(fs *flag.FlagSet) func(context.Context, []string) error {
			var (
				lo      logOptions
				no      natsOptions
				project string
				yes     bool
			)
			lo.register(fs)
			no.register(fs)
			fs.StringVar(&project, "project", "", "the project whose raw events go (required)")
			fs.BoolVar(&yes, "yes", false, "really delete them (without it: count only)")
			return func(ctx context.Context, args []string) error {
				if len(args) > 0 {
					return usageError{"streams purge-bes takes no arguments"}
				}
				if project == "" {
					return usageError{"streams purge-bes needs --project"}
				}
				if _, err := lo.logger(); err != nil {
					return err
				}
				bb, _, err := no.open(ctx, "millrace-streams", nil)
				if err != nil {
					return err
				}
				defer bb.Close()
				s, err := bb.JS.Stream(ctx, subjects.StreamBES)
				if err != nil {
					return fmt.Errorf("stream %s: %w", subjects.StreamBES, err)
				}
				filter := subjects.BESProjectFilter(project)
				n, invocations, err := streams.CountSubjects(ctx, s, filter)
				if err != nil {
					return err
				}
				if !yes {
					fmt.Printf("streams purge-bes: %s holds %d messages on %s (%d invocations); run again with --yes to delete them\n",
						subjects.StreamBES, n, filter, invocations)
					return nil
				}
				erased, err := streams.EraseSubjects(ctx, s, filter, func(erased, total uint64) {
					fmt.Fprintf(os.Stderr, "streams purge-bes: erased %d of %d messages\n", erased, max(n, total))
				})
				if err != nil {
					return fmt.Errorf("erase %s (%d messages erased): %w", filter, erased, err)
				}
				fmt.Printf("streams purge-bes: deleted %d messages on %s (%d invocations), their bytes overwritten\n", erased, filter, invocations)
				return nil
			}
		},
	}
}
