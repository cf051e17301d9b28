package builds

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
)

// Build keys and partitions (migrations/016_builds_compact.sql).
//
// A build's rows in targets, tests, build_failures and target_causes are
// keyed by its build key, not by (invocation id, project): a bigint that
// grows with time, so that index entries are small, appended in order,
// and a range of keys is a span of time. The tables are range-partitioned
// by it, one partition per 7 days, and a partition past the longest
// retention is dropped whole (retention.go).

const (
	// keySeqBits are the low bits of a build key: its first message's
	// stream sequence. The day of that message is above them.
	keySeqBits = 47
	keySeqMask = 1<<keySeqBits - 1
	// partitionDays is the span of one partition.
	partitionDays = 7
)

// partitionedTables are the tables partitioned by build key.
var partitionedTables = []string{"targets", "tests", "build_failures", "target_causes"}

// buildKey is the key of a build whose first message applied was stored
// at `at` with stream sequence seq. A replay applies the same first
// message (from the stream or the archive, which keeps sequences and
// times), so it finds the same key. One message belongs to one build, so
// keys are unique while sequences stay below 2^47 (2^46 and above are the
// keys migration 016 gave builds projected before it).
func buildKey(at time.Time, seq uint64) int64 {
	day := max(at.Unix(), 0) / 86400
	return day<<keySeqBits | int64(seq&keySeqMask)
}

// keyWeek is the partition (7-day span since 1970-01-01) of a build key.
func keyWeek(key int64) int32 { return int32(key >> keySeqBits / partitionDays) }

// timeWeek is the partition of builds whose first message is at t.
func timeWeek(t time.Time) int32 { return keyWeek(buildKey(t, 0)) }

// weekStart is the first instant of a partition's builds.
func weekStart(week int32) time.Time {
	return time.Unix(int64(week)*partitionDays*86400, 0).UTC()
}

// labelID is build_label_id(label) of migration 016: the first 8 bytes of
// the label's SHA-256. A hash rather than a counter, so the projector
// needs no round trip to name a label and a replay finds the same ids.
func labelID(label string) int64 {
	h := sha256.Sum256([]byte(label))
	return int64(binary.BigEndian.Uint64(h[:8]))
}

// sqlEnsurePartitions creates the partitions of the given weeks that are
// missing (build_partitions_for: made apart and attached, which locks the
// parents only against other DDL).
const sqlEnsurePartitions = `select build_partitions_for(w) from unnest($1::int4[]) w`

// ensurePartitions makes, in tx, the partitions of weeks that the cache
// (nil: none) does not know to exist.
func (c *cache) ensurePartitions(ctx context.Context, tx pgx.Tx, weeks []int32) error {
	missing := weeks
	if c != nil {
		missing = nil
		c.mu.Lock()
		for _, w := range weeks {
			if !c.weeks[w] {
				missing = append(missing, w)
			}
		}
		c.mu.Unlock()
	}
	if len(missing) == 0 {
		return nil
	}
	if _, err := tx.Exec(ctx, sqlEnsurePartitions, missing); err != nil {
		return fmt.Errorf("builds: partitions of weeks %v: %w", missing, err)
	}
	if c == nil {
		return nil
	}
	c.mu.Lock()
	c.pendingWeeks = append(c.pendingWeeks, missing...)
	c.dirty = true
	c.mu.Unlock()
	return nil
}

// EnsurePartitions creates the partitions for builds starting between now
// and ahead (the retention calls it, so that the projector seldom makes
// one in a batch).
func EnsurePartitions(ctx context.Context, db Querier, now time.Time, ahead time.Duration) error {
	var weeks []int32
	for w := timeWeek(now); w <= timeWeek(now.Add(ahead)); w++ {
		weeks = append(weeks, w)
	}
	rows, err := db.Query(ctx, sqlEnsurePartitions, weeks)
	if err != nil {
		return fmt.Errorf("builds: partitions: %w", err)
	}
	rows.Close()
	return rows.Err()
}

// Partition is one week's partitions of the build tables.
type Partition struct {
	Week  int32
	Start time.Time // its builds' first messages are in [Start, Start + 7 days)
}

// Partitions lists the weeks that have partitions, oldest first.
func Partitions(ctx context.Context, db Querier) ([]Partition, error) {
	rows, err := db.Query(ctx, `
		select substring(c.relname from '_w([0-9]+)$')::int4 as week
		from pg_inherits i join pg_class c on c.oid = i.inhrelid
		where i.inhparent = 'targets'::regclass order by 1`)
	if err != nil {
		return nil, fmt.Errorf("builds: partitions: %w", err)
	}
	weeks, err := pgx.CollectRows(rows, pgx.RowTo[int32])
	if err != nil {
		return nil, fmt.Errorf("builds: partitions: %w", err)
	}
	ps := make([]Partition, len(weeks))
	for i, w := range weeks {
		ps[i] = Partition{Week: w, Start: weekStart(w)}
	}
	return ps, nil
}

// sqlBuildKey is, in a read of one build, its key from its invocation id
// ($1) and project ($2): PostgreSQL computes it once (an InitPlan) and
// prunes the partitions the build cannot be in when the query runs.
const sqlBuildKey = `(select build_key from invocations where id = $1 and project = $2)`
