package builds

import (
	"context"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"
)

// Summary is one build in a list of builds (Search; the console's
// list and its JSON twin).
type Summary struct {
	ID         string     `json:"id"`
	Project    string     `json:"project"`
	Status     string     `json:"status"` // running, succeeded, failed, abandoned
	Command    string     `json:"command"`
	ExitName   string     `json:"exit_code_name"`
	Started    *time.Time `json:"started"`
	DurationMs *int64     `json:"duration_ms"`
	Patterns   []string   `json:"patterns"`
	User       string     `json:"user"`
	Host       string     `json:"host"`
	// Branch and Commit are the first of the build's metadata keys that
	// name them (BRANCH, BUILD_SCM_BRANCH, ...; COMMIT_SHA,
	// BUILD_SCM_REVISION, ...).
	Branch        string `json:"branch"`
	Commit        string `json:"commit"`
	TargetsFailed int64  `json:"targets_failed"`
	TestsPassed   int64  `json:"tests_passed"`
	TestsFailed   int64  `json:"tests_failed"` // failed but not flaky
	TestsFlaky    int64  `json:"tests_flaky"`
}

// Find reads the builds with an invocation id: project's build when a
// project is named, else every project's build with it. one asks for
// exactly one (a tool reading JSON): several projects having the id are
// then an error naming them, so that a tool never reads one tenant's build
// for another's. A missing build is an error naming the projects that have
// the id, if any.
func Find(ctx context.Context, q Querier, project, id string, one bool) ([]*Build, error) {
	if project != "" {
		return findIn(ctx, q, project, id)
	}
	projects, err := Projects(ctx, q, id)
	if err != nil {
		return nil, err
	}
	switch {
	case len(projects) == 0:
		return nil, fmt.Errorf("no build %q in the database", id)
	case len(projects) > 1 && one:
		return nil, fmt.Errorf("invocation id %q is a build of %d projects (%s): name one with --project",
			id, len(projects), strings.Join(projects, ", "))
	}
	var bs []*Build
	for _, p := range projects {
		b, err := Show(ctx, q, p, id)
		if err != nil {
			return nil, err
		}
		bs = append(bs, b)
	}
	return bs, nil
}

// FindJSON writes, as WriteJSON does, the one build with an invocation id:
// project's, or when project is empty the only project's that has one.
// Its errors are Find's with one set.
func FindJSON(ctx context.Context, q Querier, w io.Writer, project, id string) error {
	if project == "" {
		projects, err := Projects(ctx, q, id)
		if err != nil {
			return err
		}
		switch {
		case len(projects) == 0:
			return fmt.Errorf("no build %q in the database", id)
		case len(projects) > 1:
			return fmt.Errorf("invocation id %q is a build of %d projects (%s): name one with --project",
				id, len(projects), strings.Join(projects, ", "))
		}
		project = projects[0]
	}
	err := WriteJSON(ctx, q, w, project, id)
	if errors.Is(err, ErrNotFound) {
		_, err = findIn(ctx, q, project, id)
	}
	return err
}

func findIn(ctx context.Context, q Querier, project, id string) ([]*Build, error) {
	b, err := Show(ctx, q, project, id)
	if errors.Is(err, ErrNotFound) {
		projects, perr := Projects(ctx, q, id)
		if perr != nil {
			return nil, perr
		}
		if len(projects) > 0 {
			return nil, fmt.Errorf("project %q has no build %q (projects that have one: %s)", project, id, strings.Join(projects, ", "))
		}
		return nil, fmt.Errorf("project %q has no build %q", project, id)
	}
	if err != nil {
		return nil, err
	}
	return []*Build{b}, nil
}
