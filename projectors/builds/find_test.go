package builds

import (
	"context"
	"strings"
	"testing"

	"github.com/millrace/millrace/internal/testenv"
)

// Find picks a build by project and id, and never one tenant's build for
// another's: several projects with the id are an error when one build is
// asked for; Search lists the newest first.
func TestFindAndLatest(t *testing.T) {
	pool, _ := testenv.Pool(t)
	ctx := context.Background()
	if _, err := pool.Exec(ctx, `insert into invocations (id, project, status, command, first_event_at, last_event_at) values
		('same', 'alpha', 'succeeded', 'build', now() - interval '2 minutes', now()),
		('same', 'beta', 'failed', 'test', now() - interval '1 minute', now()),
		('only', 'gamma', 'running', 'build', now(), now())`); err != nil {
		t.Fatal(err)
	}
	bs, err := Find(ctx, pool, "beta", "same", true)
	if err != nil || len(bs) != 1 || bs[0].Project != "beta" || bs[0].Status != "failed" {
		t.Fatalf("beta's build: %+v, %v", bs, err)
	}
	if _, err := Find(ctx, pool, "", "same", true); err == nil || !strings.Contains(err.Error(), "alpha, beta") || !strings.Contains(err.Error(), "--project") {
		t.Fatalf("one build of an id two projects have: %v", err)
	}
	if bs, err := Find(ctx, pool, "", "same", false); err != nil || len(bs) != 2 || bs[0].Project != "alpha" || bs[1].Project != "beta" {
		t.Fatalf("every build of the id: %+v, %v", bs, err)
	}
	if _, err := Find(ctx, pool, "gamma", "same", false); err == nil || !strings.Contains(err.Error(), "projects that have one: alpha, beta") {
		t.Fatalf("another project's id: %v", err)
	}
	if _, err := Find(ctx, pool, "", "nothing", false); err == nil || !strings.Contains(err.Error(), `no build "nothing"`) {
		t.Fatalf("an unknown id: %v", err)
	}
	latest, err := Search(ctx, pool, SearchQuery{Limit: 2})
	if err != nil || len(latest.Builds) != 2 || latest.Builds[0].ID != "only" || latest.Builds[1].Project != "beta" ||
		latest.Builds[1].Command != "test" || latest.Next == "" {
		t.Fatalf("latest 2: %+v, %v", latest, err)
	}
}
