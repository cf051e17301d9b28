package main

import (
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/loadtest/balancer"
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
	oldEdge := besEdgeProcess(t, dev, addrOld, old)
	oldEdge.start()
	besEdge(t, dev, addrNew)
	bal, err := balancer.Start("127.0.0.1:0", addrOld, addrNew)
	if err != nil {
		t.Fatal(err)
	}
	defer bal.Close()

	const builds, streams = 12, 6
	waitLoad := pacedBuilds(t, bal.Addr(), "upgrade", builds, streams, 5)
	poll.Until(t, "builds on both versions' edges", func() bool {
		served, _ := bal.Served()
		return served[addrOld] > 0 && served[addrNew] > 0
	}, poll.Within(30*time.Second))
	oldEdge.stop()
	oldEdge.bin = ""
	oldEdge.start()
	res := waitLoad()
	checkBuildsProjected(t, db, "upgrade", builds, res)
	t.Logf("%d builds through an edge of %s and one of this tree, the old one upgraded midway; %d streams resumed", builds, previousRelease, res.Resumed)
	dev.stop()
}
