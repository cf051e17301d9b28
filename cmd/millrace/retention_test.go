package main

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/testenv"
)

// TestProjectsRetentionCommand: set, show (table and JSON), back to the
// default, and the refusals: raw events outliving rows, a set without
// --project, a default out of order, and project builds refusing to start
// with a project whose retention a changed default broke.
func TestProjectsRetentionCommand(t *testing.T) {
	db := testenv.Database(t)
	env := []string{"DATABASE_URL=" + db, "RETENTION_DAYS=60"}
	millrace(t, env, false, "projects", "retention", "--project", "acme", "--raw-days", "7", "--rows-days", "40")
	out, _ := millrace(t, env, false, "projects", "retention")
	if !strings.Contains(out, "acme") || !strings.Contains(out, "7*") || !strings.Contains(out, "40*") {
		t.Fatalf("table:\n%s", out)
	}
	out, _ = millrace(t, env, false, "projects", "retention", "--project", "acme", "--json")
	var got struct {
		Raw  int `json:"raw_days"`
		Rows int `json:"rows_days"`
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil || got.Raw != 7 || got.Rows != 40 {
		t.Fatalf("json %q: %+v %v", out, got, err)
	}
	_, errOut := millrace(t, env, true, "projects", "retention", "--project", "acme", "--raw-days", "50")
	if !strings.Contains(errOut, `project "acme": raw events kept 50 days outlive the rows kept 40 days`) {
		t.Fatalf("raw past rows: %s", errOut)
	}
	_, errOut = millrace(t, env, true, "projects", "retention", "--rows-days", "5")
	if !strings.Contains(errOut, "setting a retention needs --project") {
		t.Fatalf("set without a project: %s", errOut)
	}
	_, errOut = millrace(t, []string{"DATABASE_URL=" + db, "RETENTION_DAYS=10"}, true, "projects", "retention")
	if !strings.Contains(errOut, "the default retention: raw events kept 30 days outlive the rows kept 10 days") {
		t.Fatalf("defaults out of order: %s", errOut)
	}
	millrace(t, env, false, "projects", "retention", "--project", "acme", "--rows-days", "0")
	out, _ = millrace(t, env, false, "projects", "retention", "--project", "acme", "--json")
	if !strings.Contains(out, `"rows_days":60`) {
		t.Fatalf("rows back to the default (60): %s", out)
	}

	// A rollup default under acme's rows: the retention refuses to start.
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	if _, err := pool.Exec(context.Background(), "update project_retention set rows_days = 90 where project = 'acme'"); err != nil {
		t.Fatal(err)
	}
	_, errOut = millrace(t, append(env, "RETENTION_ROLLUP_DAYS=80", "MILLRACE_NATS_DIR="+t.TempDir(), "MILLRACE_NATS_LISTEN="+freePort(t),
		"MILLRACE_HTTP_LISTEN=127.0.0.1:0", "MILLRACE_BUCKET_URL="+t.TempDir()), true, "project", "builds")
	if !strings.Contains(errOut, `project "acme"'s retention: rows kept 90 days outlive the rollups kept 80 days`) {
		t.Fatalf("project builds with acme's rows outliving its rollups: %s", errOut)
	}
}

// builds delete refuses --all without --yes, and needs exactly one of --id
// and --all, before it opens anything.
func TestBuildsDeleteRefuses(t *testing.T) {
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--project", "acme", "--all"}, `deletes every build of project "acme": run it again with --yes`},
		{[]string{"--project", "acme"}, "needs --project and one of --id or --all"},
		{[]string{"--project", "acme", "--id", "x", "--all", "--yes"}, "needs --project and one of --id or --all"},
		{[]string{"--id", "x"}, "needs --project and one of --id or --all"},
	} {
		_, errOut := millrace(t, nil, true, append([]string{"builds", "delete"}, c.args...)...)
		if !strings.Contains(errOut, c.want) {
			t.Errorf("builds delete %v: %s", c.args, errOut)
		}
	}
}
