package archive

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/bucket"
	"github.com/millrace/millrace/internal/envflag"
)

// The stream is the recent tail of the archive: once a build is archived,
// checked, not found bad by verify, and read by every consumer that holds
// trimming back, its raw events leave the BES stream. The stream's age
// limit (--retention-raw-days) stays as it is, a safety net: a build never
// archived is removed by it alone.

// ProjectorDurable is the builds projector's durable consumer of BES
// (projectors/builds.ConsumerName, which this package does not import):
// it always holds trimming back, and while it does not exist nothing is
// trimmed.
const ProjectorDurable = "builds"

// Trimmer is what the archiver needs of the BES stream to trim it
// (streams.SubjectTrimmer; no NATS type here, as for Source).
type Trimmer interface {
	// Floor is the lowest ack floor on subject of the durable consumers
	// of the stream and of the holders named; a holder named that does
	// not exist makes it 0 and is returned in missing.
	Floor(ctx context.Context, subject string, holders []string) (floor uint64, missing []string, err error)
	// Trim removes subject's messages at or below seq and returns how
	// many left.
	Trim(ctx context.Context, subject string, seq uint64) (uint64, error)
	// Subject is where a build's events are (as Source's).
	Subject(project, invocation string) string
}

func registerTrimFlags(fs *flag.FlagSet, c *Config) {
	trim := !c.NoTrim
	envflag.Func(fs, "archive-trim", "MILLRACE_ARCHIVE_TRIM",
		"trim archived builds' raw events from the BES stream once every durable consumer of it has read them; false: they stay until --retention-raw-days",
		func(v string) error {
			b, err := strconv.ParseBool(v)
			if err != nil {
				return fmt.Errorf("want true or false: %w", err)
			}
			trim, c.NoTrim = b, !b
			return nil
		})
	if f := fs.Lookup("archive-trim"); f != nil {
		f.Value, f.DefValue = boolFlag{f.Value, &trim}, "true"
	}
	envflag.Func(fs, "archive-hold-for", "MILLRACE_ARCHIVE_HOLD_FOR",
		"durable consumers of BES, comma-separated, that hold trimming back beside the builds projector and every durable consumer of BES: one that does not exist holds everything",
		func(v string) error {
			names := envflag.SplitList(v)
			if err := checkHolders(names); err != nil {
				return err
			}
			c.HoldFor = names
			return nil
		})
}

// boolFlag makes --archive-trim a boolean flag: given alone, it is true.
type boolFlag struct {
	flag.Value
	v *bool
}

func (boolFlag) IsBoolFlag() bool { return true }
func (b boolFlag) String() string { return strconv.FormatBool(b.v != nil && *b.v) }

// checkHolders refuses a name that cannot be a consumer's.
func checkHolders(names []string) error {
	for _, n := range names {
		if n == "" || strings.ContainsAny(n, ".*> \t") {
			return fmt.Errorf("archive: %q in --archive-hold-for is not a consumer's name", n)
		}
	}
	return nil
}

// prior is a build's archived_builds row as an archiver or a trim finds
// it under the build's lock.
type prior struct {
	key          string
	firstSeq     int64
	lastSeq      int64
	trimmed      *int64
	verifyFailed bool
	found        bool
	// The build's console output (output.go): outputSeq set once it has
	// moved into the object, outputBytes its size per stream.
	outputSeq    *int64
	outputBytes  [2]int64
	outputFailed bool // output_error: it differs from PostgreSQL's
	rawExpired   bool
}

// lockBuild takes the build's lock for the transaction and reads its row.
// Archiving a build and trimming it take the lock: an object written from
// the stream alone while the stream's messages of the build were trimmed
// would lack them, and the trim's record would say they are in it.
func lockBuild(ctx context.Context, tx pgx.Tx, project, id string) (p prior, err error) {
	if _, err = tx.Exec(ctx, `select pg_advisory_xact_lock(hashtextextended('archive ' || $1 || ' ' || $2, 0))`, project, id); err == nil {
		err = tx.QueryRow(ctx, `select object_key, first_seq, last_seq, trimmed_seq, verify_error is not null,
       output_seq, coalesce(output_stdout_bytes, 0), coalesce(output_stderr_bytes, 0), output_error is not null, raw_expired_at is not null
from archived_builds where invocation_id = $1 and project = $2`, id, project).Scan(&p.key, &p.firstSeq, &p.lastSeq, &p.trimmed, &p.verifyFailed,
			&p.outputSeq, &p.outputBytes[0], &p.outputBytes[1], &p.outputFailed, &p.rawExpired)
		p.found = err == nil
		if errors.Is(err, pgx.ErrNoRows) {
			err = nil
		}
	}
	if err != nil {
		return p, fmt.Errorf("archive: lock %s of project %s: %w", id, project, err)
	}
	return p, nil
}

// copyObject writes the messages of the object at key to w and returns
// the last one's sequence: the first part of a trimmed build's new
// object. An object that does not decode whole, or is gone, is the
// build's failure (check): the build is not rewritten, and tried again.
func (a *Archiver) copyObject(ctx context.Context, key string, w *Writer) (last uint64, reason string, err error) {
	rc, err := a.store.NewReader(ctx, key)
	if err != nil {
		if errors.Is(err, bucket.ErrNotFound) {
			return 0, ReasonCheck, fmt.Errorf("archive: the object of a trimmed build, %s, is gone: %w", key, err)
		}
		return 0, ReasonBucket, err
	}
	defer rc.Close()
	r, err := NewReader(rc, a.dicts.Loader(ctx))
	if err == nil {
		defer r.Close()
		for {
			m, nerr := r.Next()
			if nerr != nil {
				err = nerr
				break
			}
			if err := w.Write(m); err != nil {
				return 0, ReasonBucket, err
			}
			last = m.Sequence
		}
	}
	switch {
	case err == io.EOF:
		return last, "", nil
	case errors.Is(err, ErrCorrupt), errors.Is(err, ErrDictMissing):
		return 0, ReasonCheck, fmt.Errorf("archive: the object of a trimmed build, %s, to be rewritten: %w", key, err)
	}
	return 0, ReasonBucket, err
}

// untrimmed is one archived build whose events may still be in the stream.
type untrimmed struct{ project, id string }

// trimPass trims the archived builds (at most Batch, oldest first) whose
// every holder has read them, and returns how many it looked at when all
// of them were trimmed (a full batch: there may be more), else 0.
func (a *Archiver) trimPass(ctx context.Context) (int, string, error) {
	if a.trim == nil {
		return 0, "", nil
	}
	rows, err := a.pool.Query(ctx, `
select project, invocation_id from archived_builds
where object_key <> '' and verify_error is null and (trimmed_seq is null or trimmed_seq < last_seq)
order by last_seq
limit $1`, a.cfg.Batch)
	if err != nil {
		a.m.failures.WithLabelValues(ReasonDatabase).Inc()
		return 0, ReasonDatabase, fmt.Errorf("archive: builds to trim: %w", err)
	}
	builds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (u untrimmed, err error) {
		return u, r.Scan(&u.project, &u.id)
	})
	if err != nil {
		a.m.failures.WithLabelValues(ReasonDatabase).Inc()
		return 0, ReasonDatabase, fmt.Errorf("archive: builds to trim: %w", err)
	}
	holders := append([]string{ProjectorDurable}, a.cfg.HoldFor...)
	trimmed, missing := 0, map[string]bool{}
	for _, b := range builds {
		done, gone, reason, err := a.trimOne(ctx, b, holders)
		for _, n := range gone {
			missing[n] = true
		}
		switch {
		case ctx.Err() != nil:
			return 0, "", nil
		case reason == ReasonDatabase:
			a.m.failures.WithLabelValues(reason).Inc()
			return 0, reason, err
		case err != nil:
			a.m.failures.WithLabelValues(reason).Inc()
			a.cfg.Logger.Warn("archived build not trimmed; trying again next pass", "project", b.project, "invocation", b.id, "reason", reason, "err", err)
		case done:
			trimmed++
		}
	}
	if len(missing) > 0 {
		a.cfg.Logger.Warn("trimming of archived builds held back: a consumer that holds it back does not exist", "holder", strings.Join(sortedKeys(missing), ","))
	}
	var waiting int64
	if err := a.pool.QueryRow(ctx, `select count(*) from archived_builds
where object_key <> '' and verify_error is null and (trimmed_seq is null or trimmed_seq < last_seq)`).Scan(&waiting); err != nil {
		a.m.failures.WithLabelValues(ReasonDatabase).Inc()
		return 0, ReasonDatabase, fmt.Errorf("archive: builds to trim: %w", err)
	}
	a.m.waitingForHolder.Set(float64(waiting))
	a.untrimmed = waiting
	if trimmed < a.cfg.Batch {
		trimmed = 0
	}
	return trimmed, "", nil
}

// trimOne trims one build if every holder has read it: the row says so
// first (trimmed_seq, under the build's lock, so that an archiver that
// rewrites the build takes its first messages from the object), then the
// stream's messages go. A trim that fails puts the row back.
func (a *Archiver) trimOne(ctx context.Context, b untrimmed, holders []string) (done bool, missing []string, reason string, err error) {
	subject := a.trim.Subject(b.project, b.id)
	tx, err := a.pool.Begin(ctx)
	if err != nil {
		return false, nil, ReasonDatabase, fmt.Errorf("archive: trim %s of project %s: %w", b.id, b.project, err)
	}
	defer tx.Rollback(ctx)
	p, err := lockBuild(ctx, tx, b.project, b.id)
	if err != nil {
		return false, nil, ReasonDatabase, err
	}
	// Never an object that is missing or found bad: the stream may be all
	// that is left of the build.
	if !p.found || p.key == "" || p.verifyFailed || (p.trimmed != nil && *p.trimmed >= p.lastSeq) {
		return false, nil, "", nil
	}
	floor, missing, err := a.trim.Floor(ctx, subject, holders)
	if err != nil {
		return false, nil, ReasonStream, err
	}
	if floor < uint64(p.lastSeq) {
		return false, missing, "", nil
	}
	if _, err := tx.Exec(ctx, `update archived_builds set trimmed_seq = $3 where invocation_id = $1 and project = $2`,
		b.id, b.project, p.lastSeq); err != nil {
		return false, nil, ReasonDatabase, fmt.Errorf("archive: trim %s of project %s: %w", b.id, b.project, err)
	}
	if err := tx.Commit(ctx); err != nil {
		return false, nil, ReasonDatabase, fmt.Errorf("archive: trim %s of project %s: %w", b.id, b.project, err)
	}
	n, err := a.trim.Trim(ctx, subject, uint64(p.lastSeq))
	if err != nil {
		// Put the row back, so that the next pass trims again; if that
		// fails too, the stream's age limit removes the messages.
		if _, uerr := a.pool.Exec(ctx, `update archived_builds set trimmed_seq = $4
where invocation_id = $1 and project = $2 and trimmed_seq = $3`, b.id, b.project, p.lastSeq, p.trimmed); uerr != nil {
			err = errors.Join(err, uerr)
		}
		return false, nil, ReasonStream, err
	}
	a.m.trimmedBuilds.Inc()
	a.m.trimmedMsgs.Add(float64(n))
	a.cfg.Logger.Debug("archived build trimmed from the stream", "project", b.project, "invocation", b.id, "to", p.lastSeq, "messages", n)
	return true, nil, "", nil
}

func sortedKeys(m map[string]bool) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
