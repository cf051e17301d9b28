package builds

import (
	"context"
	"fmt"
	"slices"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Scrubber redacts secrets from text; *redact.Redactor (services/bes/redact)
// is the one the BES edge applies to events before storing them. It must
// return its input unchanged when there is nothing to redact.
type Scrubber interface {
	Text(s string) string
}

// ScrubOptions select and pace a scrub.
type ScrubOptions struct {
	// Project limits the scrub to one project's builds; empty: all.
	Project string
	// DryRun counts what would change and changes nothing.
	DryRun bool
	// Batch is how many invocations are scrubbed per transaction. Default 500.
	Batch int
	// Progress, when set, is called after each batch with the totals so far.
	Progress func(ScrubStats)
}

// ScrubStats counts what a scrub looked at and what it changed (or, in a
// dry run, would change).
type ScrubStats struct {
	Invocations        int64 `json:"invocations"`
	InvocationsChanged int64 `json:"invocations_changed"`
	TargetsChanged     int64 `json:"targets_changed"`
	OutputsChanged     int64 `json:"outputs_changed"` // build_output and build_output_chunks rows, streams of build_output_pages
	// MetadataChanged counts rows of build_metadata, build_command_lines
	// and build_failures.
	MetadataChanged int64 `json:"metadata_changed"`
}

// Scrub applies s to every projected column that holds text from Bazel's
// events (invocations: command, patterns, user, host, workspace; targets:
// kind, failure reason, tags; metadata values; command lines; failures:
// message, stderr and its URIs; console output, decompressed and
// compressed again), for rows projected before the edge redacted events,
// or redacted by rules older than s's. New events
// are redacted at the edge, so the projector never writes a secret back;
// Scrub is idempotent and safe to run while the projector runs (each batch
// locks the rows it rewrites). Rows change only where s changes them.
func Scrub(ctx context.Context, pool *pgxpool.Pool, s Scrubber, opts ScrubOptions) (ScrubStats, error) {
	if opts.Batch <= 0 {
		opts.Batch = 500
	}
	var st ScrubStats
	var after invKey
	for {
		var ids []invKey
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			var err error
			ids, err = scrubBatch(ctx, tx, s, opts, after, &st)
			if err == nil && opts.DryRun {
				return errDryRun
			}
			return err
		})
		if err != nil && err != errDryRun {
			return st, fmt.Errorf("builds: scrub after invocation %q of project %q: %w", after.id, after.project, err)
		}
		if opts.Progress != nil {
			opts.Progress(st)
		}
		if len(ids) < opts.Batch {
			return st, nil
		}
		after = ids[len(ids)-1]
	}
}

// errDryRun rolls a dry run's transaction back.
var errDryRun = fmt.Errorf("dry run")

func scrubBatch(ctx context.Context, tx pgx.Tx, s Scrubber, opts ScrubOptions, after invKey, st *ScrubStats) ([]invKey, error) {
	type inv struct {
		key                            invKey
		command, user, host, workspace *string
		patterns                       []string
	}
	var invs []inv
	rows, err := tx.Query(ctx, `
select id, project, command, patterns, user_name, host, workspace_dir from invocations
where (id, project) > ($1, $2) and ($3 = '' or project = $3)
order by id, project limit $4
for update`, after.id, after.project, opts.Project, opts.Batch)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var v inv
		if err := rows.Scan(&v.key.id, &v.key.project, &v.command, &v.patterns, &v.user, &v.host, &v.workspace); err != nil {
			rows.Close()
			return nil, err
		}
		invs = append(invs, v)
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return nil, err
	}
	ids := make([]invKey, len(invs))
	for i, v := range invs {
		ids[i] = v.key
		st.Invocations++
		changed := false
		for _, p := range []**string{&v.command, &v.user, &v.host, &v.workspace} {
			if *p != nil {
				if n := s.Text(**p); n != **p {
					*p, changed = &n, true
				}
			}
		}
		patterns := slices.Clone(v.patterns)
		for j, p := range patterns {
			patterns[j] = s.Text(p)
		}
		if !slices.Equal(patterns, v.patterns) {
			changed = true
		}
		if !changed {
			continue
		}
		st.InvocationsChanged++
		if _, err := tx.Exec(ctx, `update invocations set command = $3, patterns = $4, user_name = $5, host = $6, workspace_dir = $7 where id = $1 and project = $2`,
			v.key.id, v.key.project, v.command, patterns, v.user, v.host, v.workspace); err != nil {
			return nil, err
		}
	}
	if len(ids) == 0 {
		return ids, nil
	}
	if err := scrubTargets(ctx, tx, s, ids, st); err != nil {
		return nil, err
	}
	mi, mp := keyArrays(ids)
	if err := scrubMetadata(ctx, tx, s, mi, mp, st); err != nil {
		return nil, err
	}
	for _, t := range []struct{ table, key string }{{"build_output", "invocation_id"}, {"build_output_chunks", "invocation_id, first_seq"}} {
		if err := scrubOutput(ctx, tx, s, ids, t.table, st); err != nil {
			return nil, err
		}
	}
	for _, k := range ids {
		for _, stream := range []int16{StreamStdout, StreamStderr} {
			if err := scrubPages(ctx, tx, s, k, stream, st); err != nil {
				return nil, fmt.Errorf("output pages of %s: %w", k.id, err)
			}
		}
	}
	return ids, nil
}

// keyArrays splits build keys into the id and project arrays the
// statements below join on.
func keyArrays(keys []invKey) (ids, projects []string) {
	ids, projects = make([]string, len(keys)), make([]string, len(keys))
	for i, k := range keys {
		ids[i], projects[i] = k.id, k.project
	}
	return ids, projects
}

const scrubKeys = `(invocation_id, project) in (select * from unnest($1::text[], $2::text[]))`

func scrubTargets(ctx context.Context, tx pgx.Tx, s Scrubber, keys []invKey, st *ScrubStats) error {
	ids, projects := keyArrays(keys)
	if err := scrubKinds(ctx, tx, s, ids, projects, st); err != nil {
		return err
	}
	// Rows of running builds too (running.go).
	for _, table := range targetTables {
		if err := scrubTargetsIn(ctx, tx, s, table, ids, projects, st); err != nil {
			return err
		}
	}
	return nil
}

func scrubTargetsIn(ctx context.Context, tx pgx.Tx, s Scrubber, table string, ids, projects []string, st *ScrubStats) error {
	rows, err := tx.Query(ctx, `select t.build_key, t.label_id, t.failure_reason, t.tags from `+table+` t
		where t.build_key in (select build_key from invocations where (id, project) in (select * from unnest($1::text[], $2::text[])))
		for update`, ids, projects)
	if err != nil {
		return err
	}
	type target struct {
		key, label int64
		reason     *string
		tags       []string
	}
	var changed []target
	for rows.Next() {
		var t target
		if err := rows.Scan(&t.key, &t.label, &t.reason, &t.tags); err != nil {
			rows.Close()
			return err
		}
		ch := false
		if t.reason != nil {
			if n := s.Text(*t.reason); n != *t.reason {
				t.reason, ch = &n, true
			}
		}
		if t.tags != nil {
			tags := slices.Clone(t.tags)
			for j := range tags {
				tags[j] = s.Text(tags[j])
			}
			if !slices.Equal(tags, t.tags) {
				t.tags, ch = tags, true
			}
		}
		if ch {
			changed = append(changed, t)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, t := range changed {
		if _, err := tx.Exec(ctx, `update `+table+` set failure_reason = $3, tags = $4 where build_key = $1 and label_id = $2`,
			t.key, t.label, t.reason, t.tags); err != nil {
			return err
		}
		st.TargetsChanged++
	}
	return nil
}

// scrubMetadata redacts the builds' metadata values, failures and
// command lines. A command line's arguments are kept once per project
// (build_argv, by their hash): a redacted one is stored under the hash of
// its new arguments and the build's row pointed at it; the old array goes
// once no row names it, and stays while other builds' rows do (they are
// redacted when their own builds are scrubbed).
func scrubMetadata(ctx context.Context, tx pgx.Tx, s Scrubber, ids, projects []string, st *ScrubStats) error {
	const ofBuilds = `build_key in (select build_key from invocations where (id, project) in (select * from unnest($1::text[], $2::text[])))`
	rows, err := tx.Query(ctx, `select build_key, source, key, value from build_metadata where `+ofBuilds+` for update`, ids, projects)
	if err != nil {
		return err
	}
	type meta struct {
		build              int64
		source, key, value string
	}
	var metas []meta
	var m meta
	if _, err := pgx.ForEachRow(rows, []any{&m.build, &m.source, &m.key, &m.value}, func() error {
		if n := s.Text(m.value); n != m.value {
			m.value = n
			metas = append(metas, m)
		}
		return nil
	}); err != nil {
		return err
	}
	for _, m := range metas {
		if _, err := tx.Exec(ctx, `update build_metadata set value = $4 where build_key = $1 and source = $2 and key = $3`,
			m.build, m.source, m.key, m.value); err != nil {
			return err
		}
		st.MetadataChanged++
	}

	rows, err = tx.Query(ctx, `select f.build_key, f.id, f.message, f.stderr, f.stderr_uri, f.stdout_uri from build_failures f
		where f.build_key in (select build_key from invocations where (id, project) in (select * from unnest($1::text[], $2::text[])))
		for update`, ids, projects)
	if err != nil {
		return err
	}
	type failure struct {
		key, id int64
		texts   [4]*string
	}
	var fails []failure
	var f failure
	if _, err := pgx.ForEachRow(rows, []any{&f.key, &f.id, &f.texts[0], &f.texts[1], &f.texts[2], &f.texts[3]}, func() error {
		changed := false
		for i, p := range f.texts {
			if p != nil {
				if n := s.Text(*p); n != *p {
					f.texts[i], changed = &n, true
				}
			}
		}
		if changed {
			fails = append(fails, f)
		}
		return nil
	}); err != nil {
		return err
	}
	for _, f := range fails {
		if _, err := tx.Exec(ctx, `update build_failures set message = $3, stderr = $4, stderr_uri = $5, stdout_uri = $6 where build_key = $1 and id = $2`,
			f.key, f.id, f.texts[0], f.texts[1], f.texts[2], f.texts[3]); err != nil {
			return err
		}
		st.MetadataChanged++
	}

	rows, err = tx.Query(ctx, `select c.build_key, c.project, c.source, c.label, c.argv_hash, a.argv
		from build_command_lines c join build_argv a on a.project = c.project and a.hash = c.argv_hash
		where c.`+ofBuilds+` for update of c`, ids, projects)
	if err != nil {
		return err
	}
	type line struct {
		build                  int64
		project, source, label string
		hash                   []byte
		argv                   []string
	}
	var lines []line
	var l line
	if _, err := pgx.ForEachRow(rows, []any{&l.build, &l.project, &l.source, &l.label, &l.hash, &l.argv}, func() error {
		argv := slices.Clone(l.argv)
		for i := range argv {
			argv[i] = s.Text(argv[i])
		}
		if !slices.Equal(argv, l.argv) {
			lines = append(lines, line{l.build, l.project, l.source, l.label, slices.Clone(l.hash), argv})
		}
		return nil
	}); err != nil {
		return err
	}
	for _, l := range lines {
		h := argvHash(l.argv)
		if _, err := tx.Exec(ctx, `insert into build_argv (project, hash, argv) values ($1, $2, $3) on conflict do nothing`, l.project, h, l.argv); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `update build_command_lines set argv_hash = $4 where build_key = $1 and source = $2 and label = $3`,
			l.build, l.source, l.label, h); err != nil {
			return err
		}
		// An array a projector's batch holds (it names it in a new row)
		// is skipped: it stays, named.
		if _, err := tx.Exec(ctx, `delete from build_argv a where a.project = $1 and a.hash = $2
			and a.hash in (select hash from build_argv where project = $1 and hash = $2 for update skip locked)
			and not exists (select 1 from build_command_lines c where c.project = a.project and c.argv_hash = a.hash)`, l.project, l.hash); err != nil {
			return err
		}
		st.MetadataChanged++
	}
	return nil
}

// scrubKinds redacts the kinds the builds' targets name. A kind's text is
// kept once (build_kinds) for every build that names it, so its redaction
// holds for all of them; its id stays, and a later build sending the
// text as it was finds the id taken and the redacted text kept.
func scrubKinds(ctx context.Context, tx pgx.Tx, s Scrubber, ids, projects []string, st *ScrubStats) error {
	rows, err := tx.Query(ctx, `select k.id, k.kind from build_kinds k where k.id in (
		select t.kind_id from all_targets t where t.build_key in
		(select build_key from invocations where (id, project) in (select * from unnest($1::text[], $2::text[]))))
		for update`, ids, projects)
	if err != nil {
		return err
	}
	type kind struct {
		id   int32
		text string
	}
	var changed []kind
	var k kind
	if _, err := pgx.ForEachRow(rows, []any{&k.id, &k.text}, func() error {
		if n := s.Text(k.text); n != k.text {
			changed = append(changed, kind{k.id, n})
		}
		return nil
	}); err != nil {
		return err
	}
	for _, k := range changed {
		if _, err := tx.Exec(ctx, `update build_kinds set kind = $2 where id = $1`, k.id, k.text); err != nil {
			return err
		}
		st.TargetsChanged++
	}
	return nil
}

// scrubOutput redacts console output, one stored frame at a time. A
// scratch chunk of a running build is redacted on its own: a secret split
// across two chunks' boundary is not recognised (the build's final
// build_output row, one frame, is).
func scrubOutput(ctx context.Context, tx pgx.Tx, s Scrubber, keys []invKey, table string, st *ScrubStats) error {
	canonical := table == "build_output"
	seqCol := "0::bigint"
	if !canonical {
		seqCol = "first_seq"
	}
	ids, projects := keyArrays(keys)
	rows, err := tx.Query(ctx, `select invocation_id, project, `+seqCol+`, stdout, stderr from `+table+` where `+scrubKeys+` for update`, ids, projects)
	if err != nil {
		return err
	}
	type out struct {
		inv    string
		proj   string
		seq    int64
		o, e   []byte
		on, en int // new uncompressed sizes; 0: unchanged
	}
	var changed []out
	var dec decompressor
	for rows.Next() {
		var r out
		if err := rows.Scan(&r.inv, &r.proj, &r.seq, &r.o, &r.e); err != nil {
			rows.Close()
			return err
		}
		ch := false
		for _, p := range []*[]byte{&r.o, &r.e} {
			plain, err := dec.appendTo(nil, *p)
			if err != nil {
				rows.Close()
				return fmt.Errorf("%s of %s: %w", table, r.inv, err)
			}
			red := s.Text(string(plain))
			if red == string(plain) {
				continue
			}
			ch = true
			if canonical {
				*p = compress([]byte(red))
			} else {
				*p = compressChunk([]byte(red))
			}
			if p == &r.o {
				r.on = len(red)
			} else {
				r.en = len(red)
			}

		}
		if ch {
			changed = append(changed, r)
		}
	}
	rows.Close()
	if err := rows.Err(); err != nil {
		return err
	}
	for _, r := range changed {
		var err error
		if canonical {
			_, err = tx.Exec(ctx, `update build_output set stdout = $2, stderr = $3,
    stdout_bytes = case when $4 > 0 then $4 else stdout_bytes end,
    stderr_bytes = case when $5 > 0 then $5 else stderr_bytes end
where invocation_id = $1 and project = $6`, r.inv, r.o, r.e, r.on, r.en, r.proj)
		} else {
			_, err = tx.Exec(ctx, `update build_output_chunks set stdout = $3, stderr = $4 where invocation_id = $1 and first_seq = $2 and project = $5`, r.inv, r.seq, r.o, r.e, r.proj)
		}
		if err != nil {
			return err
		}
		st.OutputsChanged++
	}
	return nil
}

// scrubPages redacts one stream of a build's output pages, a page at a
// time, and cuts the result into pages again (redaction changes lengths).
// Like a chunk, a page is redacted on its own: a secret split across a
// page boundary is not recognised. Pages before the first change are
// left as they are.
func scrubPages(ctx context.Context, tx pgx.Tx, s Scrubber, k invKey, stream int16, st *ScrubStats) error {
	// Lock the stream's pages first, as the other statements of a scrub
	// lock the rows they rewrite.
	if _, err := tx.Exec(ctx, `select 1 from build_output_pages where invocation_id = $1 and project = $2 and stream = $3 for update`,
		k.id, k.project, stream); err != nil {
		return err
	}
	var out pageRows
	w := &pageWriter{key: k, stream: stream, out: &out}
	changed := false
	const group = 16
	for from := int32(0); ; from += group {
		n := 0
		var plains [][]byte
		err := outputPages(ctx, tx, k, stream, from, from+group-1, func(_ int32, plain []byte) error {
			n++
			red := s.Text(string(plain))
			changed = changed || red != string(plain)
			plains = append(plains, []byte(red))
			return nil
		})
		if err != nil {
			return err
		}
		for _, p := range plains {
			w.write(p)
		}
		if !changed {
			out = pageRows{} // the same cut of the same bytes: the stored pages
		} else if len(out.inv) > 0 {
			if _, err := tx.Exec(ctx, sqlPutPages, out.args()...); err != nil {
				return err
			}
			out = pageRows{}
		}
		if n < group {
			break
		}
	}
	if !changed {
		return nil
	}
	st.OutputsChanged++
	w.flush()
	if len(out.inv) > 0 {
		if _, err := tx.Exec(ctx, sqlPutPages, out.args()...); err != nil {
			return err
		}
	}
	last := w.page
	if len(w.buf) == 0 {
		last--
	}
	_, err := tx.Exec(ctx, `delete from build_output_pages where invocation_id = $1 and project = $2 and stream = $3 and page > $4`,
		k.id, k.project, stream, last)
	return err
}
