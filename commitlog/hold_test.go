package commitlog_test

import (
	"bytes"
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/millrace/millrace/commitlog"
	"github.com/millrace/millrace/internal/poll"
	"github.com/millrace/millrace/projectors/compactor"
	"github.com/millrace/millrace/subjects"
)

// exportConsumer makes a durable consumer on COMMITS as an export would
// (AckAll, from the start), with the metadata the exports used to be
// found by, and acknowledges its first n deliveries (0: none).
func (e *foldEnv) exportConsumer(name string, n int) {
	e.t.Helper()
	ctx := context.Background()
	c, err := e.js.CreateConsumer(ctx, subjects.StreamCommits, jetstream.ConsumerConfig{Durable: name,
		AckPolicy: jetstream.AckAllPolicy, FilterSubject: subjects.CommitsFilter,
		Metadata: map[string]string{"millrace-export": "kafka"}})
	if err != nil {
		e.t.Fatal(err)
	}
	if n == 0 {
		return
	}
	batch, err := c.Fetch(n, jetstream.FetchMaxWait(5*time.Second))
	if err != nil {
		e.t.Fatal(err)
	}
	var last jetstream.Msg
	got := 0
	for m := range batch.Messages() {
		last, got = m, got+1
	}
	if got != n {
		e.t.Fatalf("export %s: %d deliveries, want %d (%v)", name, got, n, batch.Error())
	}
	if err := last.DoubleAck(ctx); err != nil {
		e.t.Fatal(err)
	}
}

func (e *foldEnv) streamMsgs() uint64 {
	e.t.Helper()
	st, err := e.js.Stream(context.Background(), subjects.StreamCommits)
	if err != nil {
		e.t.Fatal(err)
	}
	return st.CachedInfo().State.Msgs
}

// A holder that does not exist holds every version back (its consumer,
// once made, delivers from the start); once it exists and has
// acknowledged them, the next pass sweeps what was withheld.
func TestFoldMissingHolderWithholdsEverything(t *testing.T) {
	e := newFoldEnv(t, true)
	ctx := context.Background()
	e.put("w", 5, 3) // 15 versions, 5 documents
	c := compactor.MustNew(compactor.Config{}, e.store)
	hold := commitlog.HoldFor("export-later")
	fs, err := commitlog.FoldWorld(ctx, e.js, c, "w", hold)
	if err != nil {
		t.Fatal(err)
	}
	if fs.Dropped != 0 || fs.Withheld != 10 || !slices.Equal(fs.Missing, []string{"export-later"}) {
		t.Fatalf("pass: %d dropped, %d withheld, missing %q; want 0, 10 and the holder", fs.Dropped, fs.Withheld, fs.Missing)
	}
	if n := e.streamMsgs(); n != 15 {
		t.Fatalf("%d versions left in COMMITS, want all 15 while the holder does not exist", n)
	}

	e.exportConsumer("export-later", 15)
	fs, err = commitlog.FoldWorld(ctx, e.js, c, "w", hold)
	if err != nil {
		t.Fatal(err)
	}
	if fs.Swept != 10 || fs.Withheld != 0 || len(fs.Missing) != 0 {
		t.Fatalf("next pass: %d swept, %d withheld, missing %q; want 10, 0 and none", fs.Swept, fs.Withheld, fs.Missing)
	}
	if err := e.folded("w"); err != nil {
		t.Fatal(err)
	}
}

// With no holder named, nothing holds the deletions back: not even a
// consumer that looks like an export (its metadata) and has acknowledged
// nothing. Consumers are not discovered.
func TestFoldWithoutHoldersWithholdsNothing(t *testing.T) {
	e := newFoldEnv(t, true)
	e.exportConsumer("export-kafka-commits", 0)
	e.put("w", 5, 3)
	fs, err := commitlog.FoldWorld(context.Background(), e.js, compactor.MustNew(compactor.Config{}, e.store), "w", commitlog.HoldFor())
	if err != nil {
		t.Fatal(err)
	}
	if fs.Dropped != 10 || fs.Withheld != 0 || len(fs.Missing) != 0 {
		t.Fatalf("pass: %d dropped, %d withheld, missing %q; want 10, 0 and none", fs.Dropped, fs.Withheld, fs.Missing)
	}
	if err := e.folded("w"); err != nil {
		t.Fatal(err)
	}
}

// Only the holders named hold: an export-like consumer that is not named
// does not, however far behind it is.
func TestFoldOnlyNamedHoldersHold(t *testing.T) {
	e := newFoldEnv(t, true)
	e.put("w", 5, 3)
	e.exportConsumer("export-named", 15)
	e.exportConsumer("export-unnamed", 0)
	fs, err := commitlog.FoldWorld(context.Background(), e.js, compactor.MustNew(compactor.Config{}, e.store), "w",
		commitlog.HoldFor("export-named"))
	if err != nil {
		t.Fatal(err)
	}
	if fs.Dropped != 10 || fs.Withheld != 0 {
		t.Fatalf("pass: %d dropped, %d withheld; want 10 and 0 (the consumer behind is no holder)", fs.Dropped, fs.Withheld)
	}
	if err := e.folded("w"); err != nil {
		t.Fatal(err)
	}
}

// logBuffer keeps what a logger wrote, for a test to read while the
// runner goes on writing.
type logBuffer struct {
	mu  sync.Mutex
	buf bytes.Buffer
}

func (b *logBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.buf.Write(p)
}

func (b *logBuffer) count(s string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return strings.Count(b.buf.String(), s)
}

// The runner folds and acknowledges while a holder it was given does not
// exist, deletes nothing meanwhile, and warns of it once however many
// passes find it missing; once the export's consumer exists and has
// caught up, the next pass sweeps, and the runner says so.
func TestFoldRunnerMissingHolder(t *testing.T) {
	e := newFoldEnv(t, true)
	var logs logBuffer
	e.log = slog.New(slog.NewTextHandler(&logs, nil))
	e.run(compactor.MustNew(compactor.Config{}, e.store), commitlog.FoldRunnerConfig{Interval: 50 * time.Millisecond,
		HoldFor: []string{"export-later"}})
	written := 0
	for round := range 3 {
		e.put("w", 5, 2)
		written += 10
		poll.NoError(t, fmt.Sprintf("round %d folded", round), func() error {
			if c, last := e.covered("w"), e.lastOf("w"); c != last {
				return fmt.Errorf("round %d: checkpoint at %d, last version %d", round, c, last)
			}
			return nil
		}, poll.Within(10*time.Second))
		e.waitAcked("compactor")
		if n := e.streamMsgs(); n != uint64(written) {
			t.Fatalf("round %d: %d versions in COMMITS, want all %d while the holder does not exist", round, n, written)
		}
	}
	const warning = "a consumer that holds deletions back does not exist"
	if n := logs.count(warning); n != 1 {
		t.Fatalf("the missing holder was warned of %d times over three rounds, want once", n)
	}

	e.exportConsumer("export-later", written)
	e.put("w", 5, 1)
	e.waitFolded("w")
	if n := logs.count("a consumer that holds deletions back exists again"); n != 1 {
		t.Fatalf("the holder's return was logged %d times, want once", n)
	}
	if n := logs.count(warning); n != 1 {
		t.Fatalf("the missing holder was warned of %d times, want once", n)
	}
}
