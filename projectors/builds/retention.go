package builds

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"strconv"
	"text/tabwriter"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/internal/envflag"
)

// Retention is how many days a project's build data is kept: its raw
// events (the BES stream and the archive), its projected rows (every
// per-build table) and its hourly rollups. Zero keeps rows or rollups for
// ever; raw events always have an age (--retention-raw-days is at least 1).
type Retention struct {
	RawDays    int `json:"raw_days"`
	RowsDays   int `json:"rows_days"`
	RollupDays int `json:"rollup_days"`
}

// RetentionConfig is the process's default retention of projected rows
// and rollups; the raw default is the BES stream's age limit
// (--retention-raw-days, streams.RegisterRetentionRawDays).
type RetentionConfig struct {
	RowsDays, RollupDays int
}

// RegisterFlags registers the defaults' flags on fs.
func (c *RetentionConfig) RegisterFlags(fs *flag.FlagSet) {
	envflag.Int(fs, &c.RowsDays, "retention-days", "RETENTION_DAYS", 0, "days a finished build's projected rows are kept after its last event, for a project without its own (set by millrace projects retention); 0: for ever; at least --retention-raw-days")
	envflag.Int(fs, &c.RollupDays, "retention-rollup-days", "RETENTION_ROLLUP_DAYS", 0, "days hourly rollups are kept, for a project without its own; 0: for ever; at least --retention-days")
}

// Defaults is the retention of a project without overrides, with raw the
// raw events' default (--retention-raw-days), checked (Retention.Check).
func (c RetentionConfig) Defaults(raw int) (Retention, error) {
	r := Retention{RawDays: raw, RowsDays: c.RowsDays, RollupDays: c.RollupDays}
	if raw <= 0 {
		return r, errors.New("--retention-raw-days ($RETENTION_RAW_DAYS) must be at least 1")
	}
	if c.RowsDays < 0 {
		return r, fmt.Errorf("--retention-days ($RETENTION_DAYS) %d is negative; set 0 to keep rows for ever or a positive number of days", c.RowsDays)
	}
	if c.RollupDays < 0 {
		return r, fmt.Errorf("--retention-rollup-days ($RETENTION_ROLLUP_DAYS) %d is negative; set 0 to keep rollups for ever or a positive number of days", c.RollupDays)
	}
	if err := r.Check(); err != nil {
		return r, fmt.Errorf("the default retention: %w", err)
	}
	return r, nil
}

// longer reports whether a (days, 0 = for ever) keeps longer than b.
func longer(a, b int) bool { return b != 0 && (a == 0 || a > b) }

// days says a retention the way an operator set it.
func days(n int) string {
	if n == 0 {
		return "for ever"
	}
	return strconv.Itoa(n) + " days"
}

// Check reports a retention whose parts are out of order. Rows must outlive
// raw events: a replay keeps the rows of builds whose raw events are gone
// (archive.PlanReplay), while raw events kept past their rows would let a
// replay bring deleted builds back and count them in the rollups again.
// Rollups must outlive the rows they count: a build whose rollup row is
// gone would take its counts away from nothing when a replay or a delete
// forgets it.
func (r Retention) Check() error {
	if longer(r.RawDays, r.RowsDays) {
		return fmt.Errorf("raw events kept %s outlive the rows kept %s: the rows retention must be at least the raw one (or 0, for ever)", days(r.RawDays), days(r.RowsDays))
	}
	if longer(r.RowsDays, r.RollupDays) {
		return fmt.Errorf("rows kept %s outlive the rollups kept %s: the rollup retention must be at least the rows one (or 0, for ever)", days(r.RowsDays), days(r.RollupDays))
	}
	return nil
}

// over is r with the overrides of o (a zero field: r's).
func (r Retention) over(o Retention) Retention {
	if o.RawDays != 0 {
		r.RawDays = o.RawDays
	}
	if o.RowsDays != 0 {
		r.RowsDays = o.RowsDays
	}
	if o.RollupDays != 0 {
		r.RollupDays = o.RollupDays
	}
	return r
}

// ProjectRetention is a project's effective retention, and which of its
// parts the project sets itself (Override: zero, the default's).
type ProjectRetention struct {
	Project string `json:"project"`
	Retention
	Override Retention `json:"override"`
}

// sqlRetentionProjects lists every project with builds (counted in the
// rollups, or running) or an override, with its overrides (0: none). The
// projects of running builds come from the running index's few rows.
const sqlRetentionProjects = `
with ps as (
    select project from hourly_rollups
    union select project from invocations where status = 'running'
    union select project from project_retention
)
select ps.project, coalesce(o.raw_days, 0), coalesce(o.rows_days, 0), coalesce(o.rollup_days, 0)
from ps left join project_retention o using (project)
order by ps.project`

// ListRetention returns the effective retention of every project with
// builds or an override, by project, def being the defaults.
func ListRetention(ctx context.Context, q Querier, def Retention) ([]ProjectRetention, error) {
	rows, err := q.Query(ctx, sqlRetentionProjects)
	if err != nil {
		return nil, fmt.Errorf("builds: retention: %w", err)
	}
	out, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (ProjectRetention, error) {
		var p ProjectRetention
		err := r.Scan(&p.Project, &p.Override.RawDays, &p.Override.RowsDays, &p.Override.RollupDays)
		p.Retention = def.over(p.Override)
		return p, err
	})
	if err != nil {
		return nil, fmt.Errorf("builds: retention: %w", err)
	}
	return out, nil
}

// CheckRetention reports the first project (or the defaults) whose
// effective retention breaks Retention.Check: a process that deletes by
// retention refuses to start with one, since a default changed after an
// override was set may break it. rawFloor is the least any project's raw
// events are kept in fact: without the archive's retention (no bucket)
// the BES stream keeps every project's --retention-raw-days (0: the raw
// overrides hold).
func CheckRetention(ctx context.Context, q Querier, def Retention, rawFloor int) error {
	if err := def.Check(); err != nil {
		return RuleError{fmt.Errorf("the default retention: %w", err)}
	}
	ps, err := ListRetention(ctx, q, def)
	if err != nil {
		return err
	}
	for _, p := range ps {
		why := ""
		if p.RawDays < rawFloor {
			p.RawDays, why = rawFloor, " (without a bucket, the BES stream keeps every project's raw events --retention-raw-days)"
		}
		if err := p.Check(); err != nil {
			return RuleError{fmt.Errorf("project %q's retention: %w%s (set it with `millrace projects retention --project %s`)", p.Project, err, why, p.Project)}
		}
	}
	return nil
}

// RuleError is a retention that breaks Retention.Check, as CheckRetention
// finds it (any other error of it is the database's).
type RuleError struct{ Err error }

func (e RuleError) Error() string { return e.Err.Error() }
func (e RuleError) Unwrap() error { return e.Err }

// RetentionSet is what SetRetention changes: a nil field is left as it
// is, 0 goes back to the default, a positive number of days overrides it.
type RetentionSet struct {
	RawDays, RowsDays, RollupDays *int
}

// Empty reports whether s changes nothing.
func (s RetentionSet) Empty() bool {
	return s.RawDays == nil && s.RowsDays == nil && s.RollupDays == nil
}

func (s RetentionSet) apply(o Retention) (Retention, error) {
	for _, f := range []struct {
		name string
		v    *int
		to   *int
	}{{"--raw-days", s.RawDays, &o.RawDays}, {"--rows-days", s.RowsDays, &o.RowsDays}, {"--rollup-days", s.RollupDays, &o.RollupDays}} {
		if f.v == nil {
			continue
		}
		if *f.v < 0 {
			return o, fmt.Errorf("%s %d is negative; set 0 for the default or a positive number of days", f.name, *f.v)
		}
		*f.to = *f.v
	}
	return o, nil
}

// SetRetention changes project's overrides by s and returns its effective
// retention, refusing (and changing nothing) when the result breaks
// Retention.Check. The row is locked while it is read and written, so two
// concurrent sets never together make what each alone would be refused.
func SetRetention(ctx context.Context, pool *pgxpool.Pool, def Retention, project string, s RetentionSet) (ProjectRetention, error) {
	p := ProjectRetention{Project: project}
	if project == "" {
		return p, errors.New("builds: retention: no project")
	}
	err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		// The lock of the row to be, for a project without one yet.
		if _, err := tx.Exec(ctx, `select pg_advisory_xact_lock(hashtext('millrace.project_retention'), hashtext($1))`, project); err != nil {
			return err
		}
		err := tx.QueryRow(ctx, `select coalesce(raw_days, 0), coalesce(rows_days, 0), coalesce(rollup_days, 0)
			from project_retention where project = $1`, project).Scan(&p.Override.RawDays, &p.Override.RowsDays, &p.Override.RollupDays)
		if err != nil && !errors.Is(err, pgx.ErrNoRows) {
			return err
		}
		if p.Override, err = s.apply(p.Override); err != nil {
			return err
		}
		p.Retention = def.over(p.Override)
		if err := p.Check(); err != nil {
			return fmt.Errorf("project %q: %w", project, err)
		}
		if p.Override == (Retention{}) {
			_, err = tx.Exec(ctx, `delete from project_retention where project = $1`, project)
			return err
		}
		_, err = tx.Exec(ctx, `insert into project_retention (project, raw_days, rows_days, rollup_days)
			values ($1, nullif($2, 0), nullif($3, 0), nullif($4, 0))
			on conflict (project) do update set raw_days = excluded.raw_days, rows_days = excluded.rows_days,
			    rollup_days = excluded.rollup_days, updated_at = now()`,
			project, p.Override.RawDays, p.Override.RowsDays, p.Override.RollupDays)
		return err
	})
	if err != nil {
		return p, fmt.Errorf("builds: retention: %w", err)
	}
	return p, nil
}

// SetOrListRetention sets project's retention by s when s changes
// anything (SetRetention) and returns it; else it returns project's
// effective retention (the defaults for one without builds or an
// override), or every project's when project is "".
func SetOrListRetention(ctx context.Context, pool *pgxpool.Pool, def Retention, project string, s RetentionSet) ([]ProjectRetention, error) {
	if !s.Empty() {
		p, err := SetRetention(ctx, pool, def, project, s)
		return []ProjectRetention{p}, err
	}
	ps, err := ListRetention(ctx, pool, def)
	if err != nil || project == "" {
		return ps, err
	}
	for _, p := range ps {
		if p.Project == project {
			return []ProjectRetention{p}, nil
		}
	}
	return []ProjectRetention{{Project: project, Retention: def}}, nil
}

// WriteRetention prints ps as `millrace projects retention` does: a table
// whose * marks a project's own value, or one JSON object per line.
func WriteRetention(w io.Writer, ps []ProjectRetention, asJSON bool) error {
	if asJSON {
		enc := json.NewEncoder(w)
		for _, p := range ps {
			if err := enc.Encode(p); err != nil {
				return err
			}
		}
		return nil
	}
	mark := func(days, own int) string {
		if own != 0 {
			return strconv.Itoa(days) + "*"
		}
		return strconv.Itoa(days)
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "PROJECT\tRAW DAYS\tROWS DAYS\tROLLUP DAYS")
	for _, p := range ps {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\n", p.Project, mark(p.RawDays, p.Override.RawDays),
			mark(p.RowsDays, p.Override.RowsDays), mark(p.RollupDays, p.Override.RollupDays))
	}
	return tw.Flush()
}
