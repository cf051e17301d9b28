package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// millrace runs the binary with env added and returns stdout; it fails the
// test on a non-zero exit unless wantFail.
func millrace(t *testing.T, env []string, wantFail bool, args ...string) (string, string) {
	t.Helper()
	cmd := exec.Command(binary(t), args...)
	cmd.Env = append(os.Environ(), env...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if (err != nil) != wantFail {
		t.Fatalf("millrace %s: %v\n%s%s", strings.Join(args, " "), err, stdout.String(), stderr.String())
	}
	return stdout.String(), stderr.String()
}

// TestBuildsScrubCommand: rows projected before redaction lose their
// secrets, per project, and --dry-run changes nothing.
func TestBuildsScrubCommand(t *testing.T) {
	db := testenv.Database(t)
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	ctx := context.Background()
	for _, p := range []string{"alpha", "beta"} {
		if _, err := pool.Exec(ctx, `insert into invocations (id, project, command, patterns, user_name, host, first_event_at, last_event_at)
values ($1, $2, 'test', array['//...', '--action_env=TOKEN=SECRET2'], 'ci', 'https://u:SECRET4@host', now(), now())`, "inv-"+p, p); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `select build_partitions_for(((build_key >> 47) / 7)::int4) from invocations where id = $1 and project = $2`, "inv-"+p, p); err != nil {
			t.Fatal(err)
		}
		if _, err := pool.Exec(ctx, `insert into targets (build_key, label_id, failure_reason)
select build_key, build_label_id('//a:b'), 'token ghp_Ab12Cd34Ef56Gh78Ij90Kl12Mn34Op56Qr78 refused' from invocations where id = $1 and project = $2`, "inv-"+p, p); err != nil {
			t.Fatal(err)
		}
	}
	env := []string{"DATABASE_URL=" + db}
	rows := func() string {
		var s string
		if err := pool.QueryRow(ctx, `select string_agg(t::text, E'\n' order by 1) from (
  select i::text from invocations i union all select t::text from targets t) t(t)`).Scan(&s); err != nil {
			t.Fatal(err)
		}
		return s
	}
	before := rows()
	out, _ := millrace(t, env, false, "builds", "scrub", "--dry-run", "--json")
	var st struct {
		Invocations        int64 `json:"invocations"`
		InvocationsChanged int64 `json:"invocations_changed"`
		TargetsChanged     int64 `json:"targets_changed"`
		DryRun             bool  `json:"dry_run"`
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if st.Invocations != 2 || st.InvocationsChanged != 2 || st.TargetsChanged != 2 || !st.DryRun {
		t.Fatalf("dry run: %s", out)
	}
	if rows() != before {
		t.Fatal("--dry-run changed rows")
	}
	out, _ = millrace(t, env, false, "builds", "scrub", "--project", "alpha")
	if !strings.Contains(out, "changed 1 invocations, 1 targets") {
		t.Fatalf("scrub of alpha printed %q", out)
	}
	after := rows()
	for _, line := range strings.Split(after, "\n") {
		secret := strings.Contains(line, "SECRET") || strings.Contains(line, "ghp_")
		if strings.Contains(line, "inv-alpha") && secret {
			t.Errorf("alpha keeps a secret: %s", line)
		}
		if strings.Contains(line, "inv-beta") && !secret {
			t.Errorf("scrubbing alpha changed beta: %s", line)
		}
	}
	if !strings.Contains(after, "--action_env=TOKEN=<redacted>") {
		t.Errorf("the flag name is gone:\n%s", after)
	}
	millrace(t, env, false, "builds", "scrub")
	if s := rows(); strings.Contains(s, "SECRET") || strings.Contains(s, "ghp_") {
		t.Fatalf("secrets left after scrubbing every project:\n%s", s)
	}
	_, errOut := millrace(t, append(env, "MILLRACE_BES_REDACT_PATTERNS=a*"), true, "builds", "scrub")
	if !strings.Contains(errOut, `pattern "a*" matches the empty string`) {
		t.Fatalf("bad pattern: %s", errOut)
	}
}

// TestStreamsPurgeBESCommand: a project's raw events go, with --yes only;
// other projects' stay.
func TestStreamsPurgeBESCommand(t *testing.T) {
	ns := testenv.NATS(t)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{})); err != nil {
		t.Fatal(err)
	}
	for _, subj := range []string{subjects.BES("alpha", "i1"), subjects.BES("alpha", "i1"), subjects.BES("alpha", "i2"),
		subjects.BES("alpha-2", "i3"), subjects.BES("beta", "i1")} {
		if _, err := js.Publish(ctx, subj, []byte("--remote_header=Authorization=Bearer OLD["+subj+"]")); err != nil {
			t.Fatal(err)
		}
	}
	env := []string{"MILLRACE_NATS_URL=" + ns.ClientURL()}
	count := func(project string) uint64 {
		s, err := js.Stream(ctx, subjects.StreamBES)
		if err != nil {
			t.Fatal(err)
		}
		info, err := s.Info(ctx, jetstream.WithSubjectFilter(subjects.BESProjectFilter(project)))
		if err != nil {
			t.Fatal(err)
		}
		var n uint64
		for _, c := range info.State.Subjects {
			n += c
		}
		return n
	}
	_, errOut := millrace(t, env, true, "streams", "purge-bes")
	if !strings.Contains(errOut, "needs --project") {
		t.Fatalf("no project: %s", errOut)
	}
	out, _ := millrace(t, env, false, "streams", "purge-bes", "--project", "alpha")
	if !strings.Contains(out, "BES holds 3 messages of project alpha (2 invocations); run again with --yes") || count("alpha") != 3 {
		t.Fatalf("without --yes: %q, %d left", out, count("alpha"))
	}
	out, _ = millrace(t, env, false, "streams", "purge-bes", "--project", "alpha", "--yes")
	if !strings.Contains(out, "deleted 3 messages") {
		t.Fatalf("with --yes: %q", out)
	}
	if n := count("alpha"); n != 0 {
		t.Fatalf("alpha keeps %d messages", n)
	}
	// Not only gone from the stream: gone from the store's files, although
	// the block they were in still holds other projects' messages (a plain
	// purge leaves their bytes there).
	if err := filepath.WalkDir(ns.JetStreamConfig().StoreDir, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		if bytes.Contains(b, []byte("OLD[bes.alpha.")) {
			t.Errorf("%s still holds alpha's purged secret", p)
		}
		return err
	}); err != nil {
		t.Fatal(err)
	}
	if count("alpha-2") != 1 || count("beta") != 1 {
		t.Fatalf("other projects lost messages: alpha-2 %d, beta %d", count("alpha-2"), count("beta"))
	}
}
