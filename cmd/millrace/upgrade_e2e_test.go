package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/loadtest/balancer"
	"github.com/millrace/millrace/loadtest/besrecord"
	"github.com/millrace/millrace/loadtest/replay"
)

// previousRelease is the revision an upgrade starts from: the main of
// the release before this one. Move it forward when a release is cut
// (ops/runbooks/backup-restore.md, "Upgrade").
const previousRelease = "e6a09d7"

// buildRevision builds rev's millrace binary from the repository's
// history, or skips the test where the history is not there (a shallow
// clone).
func buildRevision(t *testing.T, rev string) string {
	t.Helper()
	if out, err := exec.Command("git", "-C", "../..", "cat-file", "-e", rev+"^{commit}").CombinedOutput(); err != nil {
		t.Skipf("SKIPPED: revision %s is not in this clone's history (%v %s): the upgrade from the previous release did not run", rev, err, out)
	}
	dir := t.TempDir()
	archive := exec.Command("sh", "-c", "git -C ../.. archive "+rev+" | tar -x -C "+dir)
	if out, err := archive.CombinedOutput(); err != nil {
		t.Fatalf("git archive %s: %v\n%s", rev, err, out)
	}
	bin := filepath.Join(dir, "millrace-"+rev)
	build := exec.Command("go", "build", "-o", bin, "./cmd/millrace")
	build.Dir = dir
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building %s: %v\n%s", rev, err, out)
	}
	return bin
}

// TestUpgradeSideBySide: an edge of the previous release and one of this
// tree run side by side behind the balancer on this tree's backbone and
// projector, paced builds going through both; then the old edge is
// upgraded (stopped, started with this tree's binary) while builds run.
// Every build completes and every acknowledged event is projected once:
// the two versions write the same messages.
func TestUpgradeSideBySide(t *testing.T) {
	old := buildRevision(t, previousRelease)
	db := testenv.Database(t)
	dev := newDev(t, db)
	dev.start()
	addrOld, addrNew := freePort(t), freePort(t)
	oldEdge := &devProcess{t: t, bin: old, args: []string{"serve", "bes"}, besAddr: addrOld}
	oldEdge.env = append(os.Environ(), "MILLRACE_NATS_URL="+dev.natsURL, "MILLRACE_NATS_NKEY="+dev.natsNKey,
		"MILLRACE_BES_LISTEN="+addrOld, "MILLRACE_HTTP_LISTEN=127.0.0.1:0", "MILLRACE_SHUTDOWN_TIMEOUT=2s")
	t.Cleanup(oldEdge.kill)
	oldEdge.start()
	besEdge(t, dev, addrNew)
	bal, err := balancer.Start("127.0.0.1:0", addrOld, addrNew)
	if err != nil {
		t.Fatal(err)
	}
	defer bal.Close()

	recs, err := besrecord.Read(filepath.Join("..", "..", "loadtest", "fixtures", "bazel-build-10.besrec"))
	if err != nil {
		t.Fatal(err)
	}
	scripts, _ := replay.Scripts(recs)
	const builds, streams = 12, 6
	done := make(chan *replay.Result, 1)
	go func() {
		res, err := replay.Run(context.Background(), replay.Config{Target: bal.Addr(), Scripts: scripts[:1], Streams: streams,
			Projects: []string{"upgrade"}, Rate: 25 * streams, Events: int64(builds * scripts[0].Events()), Seed: 5})
		if err != nil {
			t.Error(err)
		}
		done <- res
	}()
	poll.Until(t, "builds on both versions' edges", func() bool {
		served, _ := bal.Served()
		return served[addrOld] > 0 && served[addrNew] > 0
	}, poll.Within(30*time.Second))
	oldEdge.stop()
	oldEdge.bin = ""
	oldEdge.start()
	res := <-done
	if res == nil {
		t.Fatal("the load generator failed")
	}
	if len(res.Errors) > 0 || res.Failed > 0 || res.Invocations != builds {
		t.Fatalf("%d of %d builds complete, %d failed, errors %v %v", res.Invocations, builds, res.Failed, res.Errors, res.ErrorSamples)
	}
	pool := testPool(t, db)
	var finished, events int64
	waitUntil(t, "the builds projected", func() bool {
		err := pool.QueryRow(context.Background(),
			"select count(*) filter (where status <> 'running'), coalesce(sum(event_count), 0) from invocations where project = 'upgrade'").Scan(&finished, &events)
		return err == nil && finished == builds
	})
	if events != res.ToolEvents {
		t.Fatalf("the projection holds %d tool events; %d were acknowledged", events, res.ToolEvents)
	}
	t.Logf("%d builds through an edge of %s and one of this tree, the old one upgraded midway; %d streams resumed", builds, previousRelease, res.Resumed)
	dev.stop()
}
