package console

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/millrace/millrace/projectors/builds"
)

// WriteBuild writes one build for a person at a terminal: its status,
// command, exit, duration, who built what (user, host, build metadata,
// workspace status, the canonical command line), failed targets with
// their root causes, and tests.
func WriteBuild(out io.Writer, b *builds.Build) error {
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	writeHead(w, b)
	failed := 0
	for _, t := range b.Targets {
		if !t.Success {
			failed++
		}
	}
	fmt.Fprintf(w, "targets\t%d (%d failed)\n", len(b.Targets), failed)
	for _, t := range b.Targets {
		if !t.Success {
			writeFailed(w, t)
		}
	}
	fmt.Fprintf(w, "tests\t%d\n", len(b.Tests))
	for _, t := range b.Tests {
		fmt.Fprintf(w, "  %s\t%s\n", t.Status, t.Label)
	}
	return w.Flush()
}

func writeHead(w io.Writer, b *builds.Build) {
	fmt.Fprintf(w, "invocation\t%s\nproject\t%s\nstatus\t%s\n", b.ID, b.Project, b.Status)
	if b.Command != nil {
		fmt.Fprintf(w, "command\t%s\n", *b.Command)
	}
	if b.ExitCode != nil && b.ExitCodeName != nil {
		fmt.Fprintf(w, "exit\t%d %s\n", *b.ExitCode, *b.ExitCodeName)
	}
	if b.DurationMs != nil {
		fmt.Fprintf(w, "duration\t%s\n", time.Duration(*b.DurationMs)*time.Millisecond)
	}
	if b.User != nil || b.Host != nil {
		fmt.Fprintf(w, "by\t%s@%s\n", deref(b.User), deref(b.Host))
	}
	for _, k := range slices.Sorted(maps.Keys(b.BuildMetadata)) {
		fmt.Fprintf(w, "metadata\t%s=%s\n", k, b.BuildMetadata[k])
	}
	for _, it := range b.WorkspaceStatus {
		file := "volatile"
		if it.Stable {
			file = "stable"
		}
		fmt.Fprintf(w, "workspace\t%s=%s (%s)\n", it.Key, it.Value, file)
	}
	if b.CommandLine != nil {
		fmt.Fprintf(w, "cmdline\t%s\n", strings.Join(b.CommandLine, " "))
	}
}

// writeFailed writes a failed target: its own reason, and what caused it.
func writeFailed(w io.Writer, t builds.Target) {
	reason := ""
	if t.FailureReason != nil {
		reason = oneLine(*t.FailureReason)
	}
	fmt.Fprintf(w, "  FAILED\t%s\t%s\n", t.Label, reason)
	for _, c := range t.RootCauses {
		fmt.Fprintf(w, "    cause\t%s\n", cause(c))
	}
}

// WriteBuildPaged writes what WriteBuild writes of the build of project
// with the given invocation id, reading its targets and tests a page at a
// time (builds.Targets, builds.Tests), so that a build of any size costs a
// page of memory. Columns are aligned within each page.
func WriteBuildPaged(ctx context.Context, out io.Writer, q builds.Querier, project, id string) error {
	b, err := builds.Head(ctx, q, project, id)
	if err != nil {
		return err
	}
	n, err := builds.CountRows(ctx, q, project, id)
	if err != nil {
		return err
	}
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	writeHead(w, b)
	fmt.Fprintf(w, "targets\t%d (%d failed)\n", n.Targets, n.TargetsNotSucceeded)
	for after := ""; ; {
		ts, err := builds.Targets(ctx, q, project, id, builds.PageQuery{After: after, Limit: builds.MaxPageRows})
		if err != nil || len(ts) == 0 {
			if err != nil {
				return err
			}
			break
		}
		for _, t := range ts {
			if !t.Success {
				writeFailed(w, t)
			}
		}
		if err := w.Flush(); err != nil {
			return err
		}
		after = ts[len(ts)-1].Label
	}
	fmt.Fprintf(w, "tests\t%d\n", n.Tests)
	for after := ""; ; {
		ts, err := builds.Tests(ctx, q, project, id, builds.PageQuery{After: after, Limit: builds.MaxPageRows})
		if err != nil || len(ts) == 0 {
			if err != nil {
				return err
			}
			break
		}
		for _, t := range ts {
			fmt.Fprintf(w, "  %s\t%s\n", t.Status, t.Label)
		}
		if err := w.Flush(); err != nil {
			return err
		}
		after = ts[len(ts)-1].Label
	}
	return w.Flush()
}

// WriteBuilds writes every build with invocation id, or project's alone
// when project is set, one after the other with a blank line between (what
// `millrace builds show` prints), each a page of rows at a time
// (WriteBuildPaged). A build it does not find is an error that names the
// projects that have the id (builds.Find).
func WriteBuilds(ctx context.Context, out io.Writer, q builds.Querier, project, id string) error {
	projects := []string{project}
	if project == "" {
		var err error
		if projects, err = builds.Projects(ctx, q, id); err != nil {
			return err
		}
	}
	if len(projects) == 0 {
		return fmt.Errorf("no build %q in the database", id)
	}
	for i, p := range projects {
		if i > 0 {
			fmt.Fprintln(out)
		}
		err := WriteBuildPaged(ctx, out, q, p, id)
		if errors.Is(err, builds.ErrNotFound) {
			_, err = builds.Find(ctx, q, p, id, false) // says which projects have it
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func deref(s *string) string {
	if s == nil {
		return "?"
	}
	return *s
}

// oneLine keeps a message to its first line, for a table row.
func oneLine(s string) string {
	first, _, _ := strings.Cut(s, "\n")
	return first
}

// cause says what a root cause is: a failed action (label, mnemonic,
// exit code, where its stderr is) or a label that did not load or analyse.
func cause(c builds.Cause) string {
	if c.Kind != "action" {
		return fmt.Sprintf("%s (%s): %s", c.Label, strings.ReplaceAll(c.Kind, "_", " "), oneLine(deref(c.Message)))
	}
	s := c.Label
	if c.Mnemonic != nil {
		s += " " + *c.Mnemonic
	}
	if c.ExitCode != nil {
		s += fmt.Sprintf(" exit %d", *c.ExitCode)
	}
	switch {
	case c.Stderr != nil:
		s += ", stderr: " + oneLine(*c.Stderr)
	case c.StderrURI != nil:
		s += ", stderr at " + *c.StderrURI
	}
	return s
}

// WriteOutput writes the console output of the build with invocation id
// id as Bazel printed it: its stdout to stdout, its stderr to stderr (what
// `millrace builds show --output` prints), through r, which reads it from
// the archive once it has moved there. With project empty, the one
// project that has the id; several are an error naming them.
func WriteOutput(ctx context.Context, stdout, stderr io.Writer, r builds.OutputReader, project, id string) error {
	if project == "" {
		ps, err := builds.Projects(ctx, r.DB, id)
		if err != nil {
			return err
		}
		if len(ps) != 1 {
			return fmt.Errorf("%d projects have a build %q (%s): name one with --project", len(ps), id, strings.Join(ps, ", "))
		}
		project = ps[0]
	}
	o, e := bufio.NewWriter(stdout), bufio.NewWriter(stderr)
	err := r.WriteOutput(ctx, project, id, o, e)
	if errors.Is(err, builds.ErrNotFound) {
		return fmt.Errorf("no build %q of project %q in the database", id, project)
	}
	return errors.Join(err, o.Flush(), e.Flush())
}
