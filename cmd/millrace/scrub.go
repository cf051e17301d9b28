package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/projectors/builds"
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
				pool, err := openPool(ctx, do, false, log)
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
				info, err := s.Info(ctx, jetstream.WithSubjectFilter(filter))
				if err != nil {
					return err
				}
				var n uint64
				for _, c := range info.State.Subjects {
					n += c
				}
				if !yes {
					fmt.Printf("streams purge-bes: %s holds %d messages on %s (%d invocations); run again with --yes to delete them\n",
						subjects.StreamBES, n, filter, len(info.State.Subjects))
					return nil
				}
				erased, err := eraseSubjects(ctx, s, filter, n, os.Stderr)
				if err != nil {
					return fmt.Errorf("erase %s (%d messages erased): %w", filter, erased, err)
				}
				fmt.Printf("streams purge-bes: deleted %d messages on %s (%d invocations), their bytes overwritten\n", erased, filter, len(info.State.Subjects))
				return nil
			}
		},
	}
}

// eraseSubjects deletes every message of s on filter with JetStream's
// secure delete, which overwrites the message's bytes in its block: a
// plain purge leaves them on disk until the block is compacted, which a
// block shared with other projects' messages may never be. It reads the
// sequences headers-only, then erases them, reporting progress about once
// a second on progress; total is what the caller counted, for the display.
func eraseSubjects(ctx context.Context, s jetstream.Stream, filter string, total uint64, progress io.Writer) (uint64, error) {
	cons, err := s.OrderedConsumer(ctx, jetstream.OrderedConsumerConfig{FilterSubjects: []string{filter}, HeadersOnly: true})
	if err != nil {
		return 0, fmt.Errorf("read %s: %w", filter, err)
	}
	var seqs []uint64
	for {
		batch, err := cons.FetchNoWait(1000)
		if err != nil {
			return 0, fmt.Errorf("read %s: %w", filter, err)
		}
		n, left := 0, uint64(0)
		for m := range batch.Messages() {
			md, err := m.Metadata()
			if err != nil {
				return 0, err
			}
			seqs = append(seqs, md.Sequence.Stream)
			n, left = n+1, md.NumPending
		}
		if err := batch.Error(); err != nil {
			return 0, fmt.Errorf("read %s: %w", filter, err)
		}
		if n == 0 || left == 0 {
			break
		}
	}
	var erased uint64
	last := time.Now()
	for _, seq := range seqs {
		if err := s.SecureDeleteMsg(ctx, seq); err != nil && !errors.Is(err, jetstream.ErrMsgNotFound) {
			return erased, fmt.Errorf("erase message %d: %w", seq, err)
		}
		erased++
		if time.Since(last) >= time.Second {
			fmt.Fprintf(progress, "streams purge-bes: erased %d of %d messages\n", erased, max(total, uint64(len(seqs))))
			last = time.Now()
		}
	}
	return erased, nil
}
