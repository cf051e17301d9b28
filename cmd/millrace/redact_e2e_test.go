package main

import (
	"bytes"
	"context"
	"fmt"
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
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/loadtest/bazelws"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/subjects"
)

// TestBazelSecretsNeverAtRest: a real Bazel build whose command line and
// environment carry secrets (a --remote_header, --action_env, --test_env,
// --repo_env, --host_action_env and --build_metadata values, URL
// credentials, a GitHub token in the client environment, the edge's API
// key sent as --project_id) leaves none of
// them in any file of the JetStream store, any table of the database
// (pg_dump, and the console output decompressed) or any Kafka record; the
// flags' and variables' names are all still there.
func TestBazelSecretsNeverAtRest(t *testing.T) {
	needBazel(t)
	k, err := kfake.NewCluster(kfake.NumBrokers(1))
	if err != nil {
		t.Fatal(err)
	}
	defer k.Close()
	db := testenv.Database(t)
	// Unique per run, so that nothing else on the machine can match.
	tag := fmt.Sprintf("%x", time.Now().UnixNano())
	secret := func(n int) string { return fmt.Sprintf("SECRET%d-%s", n, tag) }
	ghToken := "ghp_" + strings.Repeat("Z", 28) + tag[:8]
	// The edge's API key: Bazel 4 sends it as --project_id, which is also
	// on its command line in the events.
	apiKey := "KEY-" + tag + "-" + tag
	secrets := []string{secret(1), secret(2), secret(3), secret(4), secret(5), secret(6), secret(7), ghToken, apiKey}

	dev := newDev(t, db)
	dev.env = append(dev.env, "MILLRACE_KAFKA_BROKERS="+strings.Join(k.ListenAddrs(), ","), "MILLRACE_KAFKA_PARTITIONS=1",
		"MILLRACE_BES_API_KEYS=e2e="+apiKey)
	dev.start()

	run := newBazelRun(t, 6, dev.besAddr)
	run.project, run.opt.ProjectID = "e2e", apiKey
	run.opt.Extra = []string{
		"--remote_header=Authorization=Bearer " + secret(1),
		"--action_env=TOKEN=" + secret(2),
		"--build_metadata=K=" + secret(3),
		"--build_metadata=URL=https://u:" + secret(4) + "@host.example",
		"--test_env=TEST_TOKEN=" + secret(5),
		"--repo_env=REPO_TOKEN=" + secret(6),
		"--host_action_env=HOST_TOKEN=" + secret(7),
	}
	run.opt.Env = append(bazelws.MinimalEnv(run.opt.Dir), "GH_TOKEN="+ghToken)
	code, out := run.start(t)()
	run.checkExit(t, code, out, "", dev.output())
	// Bazel itself was given the secrets: its own JSON file has them.
	if b, _ := os.ReadFile(run.opt.JSONFile); !bytes.Contains(b, []byte(secret(1))) || !bytes.Contains(b, []byte(ghToken)) {
		t.Fatal("Bazel's --build_event_json_file lacks the secrets: the build did not carry them")
	}
	showJSON(t, db, run.project, run.invocationID) // waits for the projection

	names := []string{"--remote_header=Authorization=", "--action_env=TOKEN=", "--build_metadata=K=", "--build_metadata=URL=",
		"--test_env=TEST_TOKEN=", "--repo_env=REPO_TOKEN=", "--host_action_env=HOST_TOKEN=", "--client_env=GH_TOKEN="}

	// Kafka: every message of the BES stream exported, none with a secret.
	seed, err := nats.NkeyOptionFromSeed(dev.natsNKey)
	if err != nil {
		t.Fatal(err)
	}
	nc, err := nats.Connect(dev.natsURL, seed)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	js, _ := jetstream.New(nc)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	s, err := js.Stream(ctx, subjects.StreamBES)
	if err != nil {
		t.Fatal(err)
	}
	info, err := s.Info(ctx)
	if err != nil {
		t.Fatal(err)
	}
	stored := int(info.State.Msgs)
	cl, err := kgo.NewClient(kgo.SeedBrokers(k.ListenAddrs()...), kgo.ConsumeTopics("millrace.bes"),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()))
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var kafka bytes.Buffer
	records := 0
	for deadline := time.Now().Add(90 * time.Second); records < stored && time.Now().Before(deadline); {
		pctx, pcancel := context.WithTimeout(ctx, 2*time.Second)
		fetches := cl.PollFetches(pctx)
		pcancel()
		fetches.EachRecord(func(r *kgo.Record) {
			records++
			kafka.Write(r.Value)
			kafka.WriteByte('\n')
		})
	}
	if records < stored {
		t.Fatalf("%d of the stream's %d messages reached Kafka\n%s", records, stored, dev.output())
	}
	dev.stop()

	// Every file of the JetStream store, raw.
	var store bytes.Buffer
	err = filepath.WalkDir(storeDir(t, dev), func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		b, err := os.ReadFile(p)
		store.Write(b)
		return err
	})
	if err != nil {
		t.Fatal(err)
	}

	// Every table, as pg_dump writes it, and the console output (stored
	// zstd-compressed) decoded.
	dump, err := exec.Command("pg_dump", "--data-only", "--dbname="+db).Output()
	if err != nil {
		t.Fatalf("pg_dump: %v", err)
	}
	pool, err := pgxpool.New(context.Background(), db)
	if err != nil {
		t.Fatal(err)
	}
	defer pool.Close()
	stdout, stderr, err := builds.Output(context.Background(), pool, run.project, run.invocationID)
	if err != nil {
		t.Fatal(err)
	}
	pg := append(append(dump, stdout...), stderr...)

	for _, where := range []struct {
		name  string
		data  []byte
		names bool // the flag names must be there too
		// PostgreSQL too: the build's command lines are projected, with
		// every flag's name and no secret.
	}{{"the JetStream store", store.Bytes(), true}, {"Kafka", kafka.Bytes(), true}, {"PostgreSQL", pg, true}} {
		if len(where.data) == 0 {
			t.Fatalf("%s: nothing read", where.name)
		}
		for _, sec := range secrets {
			if i := bytes.Index(where.data, []byte(sec)); i >= 0 {
				t.Errorf("%s holds %q: ...%q...", where.name, sec, where.data[max(0, i-80):min(len(where.data), i+len(sec)+20)])
			}
		}
		if where.names {
			for _, n := range names {
				if !bytes.Contains(where.data, []byte(n)) {
					t.Errorf("%s lacks the flag %q", where.name, n)
				}
			}
		}
	}
	// The projection is whole: the build is there as Bazel reported it.
	run.checkProjection(t, db)
}

// storeDir is the dev process's JetStream store directory.
func storeDir(t *testing.T, d *devProcess) string {
	for _, kv := range d.env {
		if v, ok := strings.CutPrefix(kv, "MILLRACE_NATS_DIR="); ok {
			return v
		}
	}
	t.Fatal("dev has no MILLRACE_NATS_DIR")
	return ""
}
