package commitsload

import (
	"bytes"
	"context"
	"flag"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"google.golang.org/grpc"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/testenv"
	"github.com/millrace/millrace/services/commits"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

const testKey = "commitsload-test-key-0001"

// backbone is an embedded JetStream with the millrace streams.
type backbone struct {
	url string
	js  jetstream.JetStream
}

func startBackbone(t *testing.T) backbone {
	t.Helper()
	ns := testenv.NATS(t)
	nc, err := nats.Connect(ns.ClientURL())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(nc.Close)
	js, err := jetstream.New(nc)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := streams.Apply(ctx, js, streams.StreamSpecs(streams.Config{Replicas: 1})); err != nil {
		t.Fatal(err)
	}
	return backbone{url: ns.ClientURL(), js: js}
}

// startEdge serves a commits edge on bb (reading folded versions from
// store, when set) over gRPC on loopback and returns its address. Each
// call is a fresh edge: nothing of a world is in its memory yet.
func startEdge(t *testing.T, bb backbone, store *bucket.Bucket) string {
	t.Helper()
	keys, err := commits.ParseKeys("*=" + testKey)
	if err != nil {
		t.Fatal(err)
	}
	cfg := commits.Config{Keys: keys}
	if store != nil {
		cfg.Store = store
	}
	srv, err := commits.New(context.Background(), cfg, bb.js, commits.NewMetrics(nil), nil)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	srv.Register(g)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go g.Serve(lis)
	t.Cleanup(g.Stop)
	return lis.Addr().String()
}

func memBucket(t *testing.T) *bucket.Bucket {
	t.Helper()
	bk, err := bucket.Open(context.Background(), "mem://")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { bk.Close() })
	return bk
}

func run(t *testing.T, cfg Config) *Report {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var progress bytes.Buffer
	rep, err := Run(ctx, cfg, &progress)
	t.Logf("progress:\n%s", progress.String())
	if err != nil {
		t.Fatalf("Run: %v", err)
	}
	return rep
}

// checkList checks List, or logs that the edge does not serve it yet.
func checkList(t *testing.T, v *Verify, worlds, docs int) {
	t.Helper()
	if v.ListError != "" {
		t.Logf("List not checked: %s", v.ListError)
		return
	}
	if len(v.List) != worlds {
		t.Fatalf("List checked %d worlds, want %d", len(v.List), worlds)
	}
	for _, l := range v.List {
		if l.Docs != int64(docs) || l.Missing != 0 || l.Stale != 0 || l.Newer != 0 || l.Foreign != 0 || l.Error != "" {
			t.Errorf("List of %s: %+v, want all %d documents at their latest version", l.World, l, docs)
		}
	}
}

// TestWriteFoldVerify: a fill and random updates (some compare-and-set)
// by several writers on two worlds, a fold into the bucket, then the
// oracle on the same edge and, from the ledger, on a fresh one: nothing
// lost, no gaps.
func TestWriteFoldVerify(t *testing.T) {
	bb := startBackbone(t)
	bk := memBucket(t)
	addr := startEdge(t, bb, bk)
	ledger := filepath.Join(t.TempDir(), "ledger")
	cfg := Config{
		Addr: addr, APIKey: testKey, World: "w", Worlds: 2, Docs: 40, BodyBytes: 64,
		Writers: 2, InFlight: 4, Fill: true, Writes: 300, CASFraction: 0.3,
		Fold: true, NATSURL: bb.url, Bucket: bk, Ledger: ledger, ProgressEvery: -1, Seed: 7,
	}
	rep := run(t, cfg)
	w := rep.Write
	if w.FillAcked != 80 || w.Acked+w.Conflicts != 380 || w.Errors != 0 || w.DuplicateVersions != 0 {
		t.Fatalf("write: %+v", w)
	}
	if w.CASWrites == 0 || w.Latency.Count == 0 || w.AckedPerS <= 0 {
		t.Errorf("write figures: %+v", w)
	}
	f := rep.Fold
	if f == nil || len(f.Worlds) != 2 || f.Docs != 80 || f.DocsChanged != 80 || f.Versions != int(w.Acked) {
		t.Fatalf("fold: %+v", f)
	}
	if f.Dropped != int(w.Acked)-80 || f.BucketOpsPerDoc <= 0 {
		t.Errorf("fold: %+v", f)
	}
	v := rep.Verify
	if !v.OK || v.Versions != w.Acked || v.Docs != 80 || len(rep.Failed()) > 0 {
		t.Fatalf("verify after the fold: %+v; failed: %v", v, rep.Failed())
	}
	checkList(t, v, 2, 40)

	// A fresh edge on the same stream and bucket: a cold start.
	fresh := startEdge(t, bb, bk)
	rep2 := run(t, Config{Addr: fresh, APIKey: testKey, VerifyOnly: true, Ledger: ledger, ProgressEvery: -1})
	v2 := rep2.Verify
	if !v2.OK || v2.Versions != w.Acked || v2.Addr != fresh || len(rep2.Failed()) > 0 {
		t.Fatalf("verify on a fresh edge: %+v; failed: %v", v2, rep2.Failed())
	}
	checkList(t, v2, 2, 40)
}

// TestOracleFindsLoss: a version acknowledged and then removed from the
// stream behind the edge's back (nothing folded it) must be reported lost
// and as a gap in its document's History.
func TestOracleFindsLoss(t *testing.T) {
	bb := startBackbone(t)
	addr := startEdge(t, bb, nil)
	ledger := filepath.Join(t.TempDir(), "ledger")
	cfg := Config{Addr: addr, APIKey: testKey, World: "loss", Docs: 10, Writers: 1, InFlight: 2,
		Fill: true, Writes: 40, NoVerify: true, Ledger: ledger, ProgressEvery: -1, Seed: 3}
	rep := run(t, cfg)
	if rep.Write.Acked != 50 {
		t.Fatalf("write: %+v", rep.Write)
	}
	led, err := readLedger(ledger)
	if err != nil {
		t.Fatal(err)
	}
	// The first acknowledged version: a fill, overwritten by later puts
	// of its document or not, it is in the stream until deleted here.
	victim := led.acks[0]
	stream, err := bb.js.Stream(context.Background(), subjects.StreamCommits)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.DeleteMsg(context.Background(), victim.version); err != nil {
		t.Fatal(err)
	}
	rep = run(t, Config{Addr: addr, APIKey: testKey, VerifyOnly: true, Ledger: ledger, ProgressEvery: -1})
	v := rep.Verify
	if v.Lost != 1 || v.Gaps != 1 || v.OK || v.Versions != 50 {
		t.Fatalf("verify: %+v, want 1 lost and 1 gap", v)
	}
	failed := strings.Join(rep.Failed(), "; ")
	if !strings.Contains(failed, "1 lost") || !strings.Contains(failed, "1 gaps") {
		t.Errorf("Failed() = %q", failed)
	}
	if len(v.Examples) == 0 || !strings.Contains(strings.Join(v.Examples, "\n"), led.id(victim.doc)) {
		t.Errorf("examples do not name the lost document %s: %v", led.id(victim.doc), v.Examples)
	}

	// An oracle out of time has not seen what it did not read: a finding.
	rep = run(t, Config{Addr: addr, APIKey: testKey, VerifyOnly: true, Ledger: ledger, ProgressEvery: -1, VerifyTimeout: time.Nanosecond})
	if v := rep.Verify; v.Unchecked != 10 || v.DocsSampled != 10 || v.OK || !strings.Contains(strings.Join(rep.Failed(), ";"), "not read back") {
		t.Errorf("verify with no time: %+v, failed %v", v, rep.Failed())
	}
}

// TestRefusalStops: a wrong key stops the run at once with the edge's
// reason.
func TestRefusalStops(t *testing.T) {
	bb := startBackbone(t)
	addr := startEdge(t, bb, nil)
	cfg := Config{Addr: addr, APIKey: "not-the-key-0000000", Docs: 5, Writers: 1, InFlight: 1,
		Duration: time.Minute, NoVerify: true, ProgressEvery: -1}
	start := time.Now()
	rep, err := Run(context.Background(), cfg, nil)
	if err == nil || !strings.Contains(err.Error(), "Unauthenticated") {
		t.Fatalf("err = %v, want the edge's Unauthenticated", err)
	}
	if time.Since(start) > 10*time.Second || rep == nil || rep.Write.Acked != 0 {
		t.Fatalf("took %s, report %+v", time.Since(start), rep)
	}
}

func TestLedgerRoundTrip(t *testing.T) {
	l := newLedger([]string{"a b", "c"}, "x/", 123)
	l.acks = []ack{{world: 0, doc: 5, version: 9, hash: 0xdeadbeef}, {world: 1, doc: 122, version: 10, hash: 1}}
	l.doubts = []doubt{{world: 1, doc: 3, code: "DeadlineExceeded"}}
	path := filepath.Join(t.TempDir(), "l")
	if err := l.write(path, false); err != nil {
		t.Fatal(err)
	}
	more := newLedger([]string{"c"}, "x/", 123)
	more.acks = []ack{{world: 0, doc: 1, version: 11, hash: 2}}
	if err := more.write(path, true); err != nil {
		t.Fatal(err)
	}
	got, err := readLedger(path)
	if err != nil {
		t.Fatal(err)
	}
	if len(got.acks) != 3 || len(got.doubts) != 1 || got.worlds[got.acks[2].world] != "c" || got.acks[0] != l.acks[0] {
		t.Fatalf("read back %+v", got)
	}
	if id := got.id(5); id != "x/0000005" {
		t.Errorf("id(5) = %q", id)
	}
	if n, ok := got.docNum("x/0000122"); !ok || n != 122 {
		t.Errorf("docNum = %d, %v", n, ok)
	}
	for _, bad := range []string{"x/122", "y/0000122", "x/00001x2"} {
		if _, ok := got.docNum(bad); ok {
			t.Errorf("docNum(%q) accepted", bad)
		}
	}
	other := newLedger([]string{"c"}, "z-", 10)
	if err := other.write(path, true); err == nil {
		t.Error("appending another id form was accepted")
	}
}

func TestFlagsAndValidate(t *testing.T) {
	var c Config
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	c.RegisterFlags(fs)
	if err := fs.Parse([]string{"-api-key", testKey, "-worlds", "3", "-pids", "edge=1,nats=2", "-fold"}); err != nil {
		t.Fatal(err)
	}
	if got := strings.Join(c.WorldNames(), ","); got != "load-0,load-1,load-2" {
		t.Errorf("worlds %s", got)
	}
	if c.PIDs["nats"] != 2 {
		t.Errorf("pids %v", c.PIDs)
	}
	err := c.Validate()
	if err == nil || !strings.Contains(err.Error(), "-nats-url") {
		t.Errorf("fold without NATS: %v", err)
	}
	if err := (Config{APIKey: testKey, VerifyOnly: true}).Validate(); err == nil || !strings.Contains(err.Error(), "-ledger") {
		t.Errorf("verify-only without a ledger: %v", err)
	}
	if err := (Config{}).Validate(); err == nil || !strings.Contains(err.Error(), "API key") {
		t.Errorf("no key: %v", err)
	}
}

// A variable that does not parse, or a negative count, fails Validate
// naming the variable: the run never starts on a default in its place.
func TestFlagsBadEnvironment(t *testing.T) {
	for env, val := range map[string]string{
		"MILLRACE_COMMITSLOAD_WRITERS":   "many",
		"MILLRACE_COMMITSLOAD_PIDS":      "edge",
		"MILLRACE_COMMITSLOAD_RATE":      "fast",
		"MILLRACE_COMMITSLOAD_SEED":      "-1",
		"MILLRACE_COMMITSLOAD_IN_FLIGHT": "-4",
	} {
		t.Run(env, func(t *testing.T) {
			t.Setenv(env, val)
			var c Config
			fs := flag.NewFlagSet("x", flag.ContinueOnError)
			c.RegisterFlags(fs)
			if err := fs.Parse([]string{"-api-key", testKey}); err != nil {
				t.Fatal(err)
			}
			if err := c.Validate(); err == nil || !strings.Contains(err.Error(), env) || !strings.Contains(err.Error(), val) {
				t.Fatalf("%s=%s: %v; want an error naming the variable and its value", env, val, err)
			}
		})
	}
}
