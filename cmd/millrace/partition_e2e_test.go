package main

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
)

// TestPartitionedProjectors: build events in four partitions, the builds
// projector of `millrace dev` and a `project builds` of its own sharing
// them; real Bazel and paced builds of the load generator run while the
// second projector is killed (SIGKILL), and dev's takes its partitions
// over. Bazel's projection matches its JSON, every acknowledged event of
// the load generator is projected once, every partition has its own
// position, and a replay of one partition, and then of all, while dev
// runs on, gives the same rows.
func TestPartitionedProjectors(t *testing.T) {
	needBazel(t)
	db := testenv.Database(t)
	dev := newDev(t, db)
	fast := []string{"MILLRACE_BES_PARTITIONS=4", "MILLRACE_BUILDS_GROUP_HEARTBEAT=200ms"}
	dev.env = append(dev.env, append(fast, "MILLRACE_ARCHIVE_AFTER=1s", "MILLRACE_ARCHIVE_INTERVAL=1s")...)
	dev.start()
	bucketURL := ""
	for _, kv := range dev.env {
		if v, ok := strings.CutPrefix(kv, "MILLRACE_BUCKET_URL="); ok {
			bucketURL = v
		}
	}
	// What another process on dev's backbone, database and bucket needs.
	shared := append([]string{"DATABASE_URL=" + db, "MILLRACE_NATS_URL=" + dev.natsURL, "MILLRACE_NATS_NKEY=" + dev.natsNKey,
		"MILLRACE_BUCKET_URL=" + bucketURL, "MILLRACE_HTTP_LISTEN=127.0.0.1:0"}, fast...)
	second := &devProcess{t: t, args: []string{"project", "builds"},
		env: append(append(os.Environ(), shared...), "MILLRACE_BUILDS_MAX_WAIT=50ms", "MILLRACE_LOG_LEVEL=debug")}
	t.Cleanup(second.kill)
	second.start()

	pool := testPool(t, db)
	ctx := context.Background()
	members := func() int {
		var n int
		pool.QueryRow(ctx, `select count(*) from consumer_members where consumer_group = 'builds' and seen_at > now() - interval '1 second'`).Scan(&n)
		return n
	}
	poll.Until(t, "two builds projectors in the group", func() bool { return members() == 2 }, poll.Within(30*time.Second))
	poll.Until(t, "the second projector to run two partitions", func() bool {
		return strings.Contains(second.output(), "partitions assigned") && strings.Contains(second.output(), "members=2")
	}, poll.Within(30*time.Second))

	const builds, streams = 16, 8
	waitLoad := pacedBuilds(t, dev.besAddr, "load", builds, streams, 5)
	run := newBazelRun(t, 10, dev.besAddr)
	wait := run.start(t)
	poll.Until(t, "the builds' first events projected", func() bool { return lastSeen(pool, run.project, run.invocationID) >= 1 },
		poll.Within(2*time.Minute), poll.Every(10*time.Millisecond))
	second.kill()
	poll.Until(t, "the killed projector's membership to age out", func() bool { return members() == 1 }, poll.Within(30*time.Second))

	code, out := wait()
	run.checkExit(t, code, out, " while a projector of its partitions was killed", dev.output()+second.output())
	run.checkProjection(t, db)
	checkBuildsProjected(t, db, "load", builds, waitLoad())
	for p := range 4 {
		var pos int64
		if err := pool.QueryRow(ctx, `select stream_seq from consumer_positions where consumer = $1 and stream = $2`,
			fmt.Sprintf("builds_%d", p), fmt.Sprintf("BES_%d", p)).Scan(&pos); err != nil || pos == 0 {
			t.Errorf("partition %d: position %d (%v)", p, pos, err)
		}
	}
	waitTrimmed(t, db, dev)
	// The archiver moves each build's console output into its object once
	// its partition's projector has applied it (builds.PositionOf); and
	// no build has events newer than its object (the live rows are
	// final: the replays must give them again).
	poll.Until(t, "every archived build's console output moved and its object current", func() bool {
		var left int
		pool.QueryRow(ctx, `select count(*) from archived_builds a join invocations i on i.id = a.invocation_id and i.project = a.project
			where a.output_seq is null or a.last_event_at < i.last_event_at`).Scan(&left)
		return left == 0
	}, poll.Within(time.Minute))

	live := digest(t, db)
	liveRows := invocationRows(t, db)
	replay := func(args ...string) string {
		cmd := exec.Command(binary(t), append([]string{"replay", "builds"}, args...)...)
		cmd.Env = append(os.Environ(), shared...)
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("millrace replay builds %s: %v\n%s", strings.Join(args, " "), err, out)
		}
		return string(out)
	}
	if out := replay("--partition", "2"); !strings.Contains(out, "replay builds, partition 2 of 4") || strings.Contains(out, "partition 1 of 4") {
		t.Errorf("replay of partition 2 said:\n%s", out)
	}
	checkDigest(t, db, live, liveRows, "partition 2 replayed")
	if out := replay(); !strings.Contains(out, "partition 0 of 4") || !strings.Contains(out, "partition 3 of 4") {
		t.Errorf("replay of every partition said:\n%s", out)
	}
	checkDigest(t, db, live, liveRows, "every partition replayed")
	var paused int
	pool.QueryRow(ctx, `select count(*) from consumer_paused`).Scan(&paused)
	if paused != 0 {
		t.Errorf("%d partitions still paused after the replays", paused)
	}
	dev.stop()
}

// checkDigest compares the projection's digest with want, and names the
// invocations rows that differ from wantRows.
func checkDigest(t *testing.T, db string, want, wantRows map[string]string, after string) {
	t.Helper()
	got := digest(t, db)
	for table, sum := range want {
		if got[table] != sum {
			t.Errorf("%s: table %s differs: %s, want %s", after, table, got[table], sum)
		}
	}
	if got["invocations"] != want["invocations"] {
		rows := invocationRows(t, db)
		for k, r := range wantRows {
			if rows[k] != r {
				t.Errorf("%s: invocation %s\n  was %s\n  now %s", after, k, r, rows[k])
			}
		}
	}
}

// invocationRows are the invocations' rows as text, by project/id.
func invocationRows(t *testing.T, db string) map[string]string {
	t.Helper()
	rows, err := testPool(t, db).Query(context.Background(), `select project || '/' || id, i::text from invocations i`)
	if err != nil {
		t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]string{}
	for rows.Next() {
		var k, r string
		if err := rows.Scan(&k, &r); err != nil {
			t.Fatal(err)
		}
		out[k] = r
	}
	return out
}
