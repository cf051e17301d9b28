package builds

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/subjects"
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

// partBits are the bits of a partitioned build's key below its
// sequence, which hold its partition of build events (at most 64:
// streams.MaxBESPartitions).
const partBits = 6

// partitionKey is the key of a build of partition part of layout, as
// buildKey. Partitions number their messages each in its own stream, so
// two builds of a day may start at the same sequence in two partitions:
// a partitioned build's key is its sequence and then its partition, and
// keys stay unique, and the same on a replay, while sequences stay below
// 2^40. One partition's keys are buildKey's, as before partitions.
func partitionKey(layout subjects.BESLayout, part int, at time.Time, seq uint64) int64 {
	if !layout.Partitioned() {
		return buildKey(at, seq)
	}
	return buildKey(at, seq<<partBits|uint64(part))
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

// kindID is build_kind_id(kind) of migration 019: the first 4 bytes of
// the kind's SHA-256. Kinds are few (a rule class each: "genrule rule",
// "sh_test rule", ...), so 32 bits keep them apart (two of 1,000 kinds
// share an id with a chance of about one in 10^4) and a target's row holds
// 4 bytes instead of the text.
func kindID(kind string) int32 {
	h := sha256.Sum256([]byte(kind))
	return int32(binary.BigEndian.Uint32(h[:4]))
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
	// By name rather than by pg_inherits: a week a pass left half dropped
	// (some tables detached) is still listed, and its drop finished.
	rows, err := db.Query(ctx, `
		select distinct substring(relname from '_w([0-9]+)$')::int4 as week from pg_class
		where relkind = 'r' and relname ~ '^(targets|tests|build_failures|target_causes)_w[0-9]+$' order by 1`)
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

// longestRows is the longest rows retention of the default and every
// project's (0: one keeps its rows for ever).
func longestRows(def Retention, ps []ProjectRetention) int {
	longest := def.RowsDays
	for _, p := range ps {
		if longer(p.RowsDays, longest) {
			longest = p.RowsDays
		}
	}
	return longest
}

// sqlWeekExpired reports whether every build keyed in a week is past the
// cutoff: finished, its last event before it. A build that began in the
// week and went on long after still holds the week's partitions.
const sqlWeekExpired = `select not exists (select 1 from invocations
where build_key >= $1 and build_key < $2 and (status = 'running' or last_event_at >= $3))`

// DropPartitions drops, whole, the weeks of the partitioned tables whose
// builds are all past longestDays (every project's rows retention; 0 keeps
// everything), oldest first, and returns how many weeks. Each partition is
// detached concurrently first (no lock that blocks the projector or the
// readers of other weeks), then dropped. The builds' other rows
// (invocations and the tables keyed by invocation id) go by the batched
// deletes of the retention.
func DropPartitions(ctx context.Context, pool *pgxpool.Pool, longestDays int, now time.Time) (int, error) {
	if longestDays == 0 {
		return 0, nil
	}
	cutoff := now.Add(-time.Duration(longestDays) * 24 * time.Hour)
	ps, err := Partitions(ctx, pool)
	if err != nil {
		return 0, err
	}
	dropped := 0
	for _, p := range ps {
		end := weekStart(p.Week + 1)
		if !end.Before(cutoff) {
			break
		}
		lo, hi := int64(p.Week)*partitionDays<<keySeqBits, int64(p.Week+1)*partitionDays<<keySeqBits
		var expired bool
		if err := pool.QueryRow(ctx, sqlWeekExpired, lo, hi, cutoff).Scan(&expired); err != nil {
			return dropped, fmt.Errorf("builds: partitions of week %d: %w", p.Week, err)
		}
		if !expired {
			break
		}
		for _, t := range partitionedTables {
			part := pgx.Identifier{fmt.Sprintf("%s_w%d", t, p.Week)}.Sanitize()
			if _, err := pool.Exec(ctx, fmt.Sprintf("alter table %s detach partition %s concurrently", pgx.Identifier{t}.Sanitize(), part)); err != nil && !notAttached(err) {
				return dropped, fmt.Errorf("builds: detach %s: %w", part, err)
			}
			if _, err := pool.Exec(ctx, "drop table if exists "+part); err != nil {
				return dropped, fmt.Errorf("builds: drop %s: %w", part, err)
			}
		}
		dropped++
	}
	return dropped, nil
}

// notAttached reports a DETACH of a partition that is not (any longer) one:
// an earlier pass stopped between its detach and its drop, or it is gone.
func notAttached(err error) bool {
	var pe *pgconn.PgError
	return errors.As(err, &pe) && (pe.Code == "42P01" || pe.Code == "42P16" || strings.Contains(pe.Message, "is not a partition"))
}

// kindColumn is, in a query over targets aliased alias, a target's kind
// (empty if Bazel did not say) from build_kinds.
func kindColumn(alias string) string {
	return "coalesce((select k.kind from build_kinds k where k.id = " + alias + ".kind_id), '')"
}
