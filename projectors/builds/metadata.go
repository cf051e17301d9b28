package builds

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"unicode/utf8"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/millrace/millrace/schemas/bep"
)

// What a build says about itself (workspace status, --build_metadata, its
// command lines) and the root causes of its failures
// (migrations/013_builds_metadata.sql). Each comes in an event that a build
// sends once, so these rows cost nothing per event: the batch that holds
// the event inserts them, with ON CONFLICT DO NOTHING, so that the first
// value of a key wins whatever the batch boundaries (a key seen twice would
// be a client's repeat; the resend guard already skips Bazel's).

// Sources of build_metadata rows.
const (
	sourceBuildMetadata = "build_metadata"
	sourceStable        = "stable"
	sourceVolatile      = "volatile"
)

// Sources of build_command_lines rows.
//
// Each distinct argument array is stored once per project, in build_argv,
// keyed by argvHash (migrations/017_builds_argv.sql): a project's CI
// builds send the same command lines build after build, so a build's
// rows name their arrays and hold none.
//
// Of the command lines Bazel reports, the projection keeps the canonical
// structured one (every option as Bazel understood it, rc files expanded),
// a "tool" one when it has arguments, and the options given explicitly
// (OptionsParsed's explicit_startup_options and explicit_cmd_line). The
// "original" structured line, the unstructured one and OptionsParsed's full
// lists repeat what those hold (about 8 KB a build in all, where these are
// 3 KB: at 1,000 paced builds all of them cost about 60 WAL bytes per
// event, BenchmarkApplyPaced); they stay in the stream.
const (
	sourceStructured = "structured_command_line"
	sourceOptions    = "options_parsed"
)

// Kinds of build_failures rows (and of target_causes.cause_kind).
const (
	causeAction            = "action"
	causeConfiguredLabel   = "configured_label"
	causeUnconfiguredLabel = "unconfigured_label"
)

// A btree entry must fit a third of a page (about 2,700 bytes), and
// build_metadata_lookup indexes (key, value, project) (migration 022):
// keys and values are cut to these many bytes, at a character boundary.
const maxMetaKey, maxMetaValue = 256, 1024

// cut returns s cut to at most n bytes, at a character boundary.
func cut(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

type metaRow struct{ source, key, value string }

type cmdLine struct {
	source, label string
	argv          []string
}

// failure is a build_failures row; key is its primary key but the build.
type failure struct {
	key                          causeKey
	mnemonic, message            string
	hasExit                      bool
	exitCode                     int32
	stderrURI, stderr, stdoutURI string
}

type causeKey struct{ kind, label, output, config string }

// id is build_failure_id of migration 016: the hash (labelID) of the key's
// parts joined by the unit separator.
func (k causeKey) id() int64 {
	return labelID(k.kind + "\x1f" + k.label + "\x1f" + k.output + "\x1f" + k.config)
}

type cause struct {
	label string
	key   causeKey
}

// statusSource says which workspace status file a key belongs to, by
// Bazel's rule (its WorkspaceStatusAction): keys that start with STABLE_
// and Bazel's own BUILD_EMBED_LABEL, BUILD_HOST and BUILD_USER are stable,
// every other key is volatile. Bazel reports both files in one event.
func statusSource(key string) string {
	switch {
	case strings.HasPrefix(key, "STABLE_"), key == "BUILD_EMBED_LABEL", key == "BUILD_HOST", key == "BUILD_USER":
		return sourceStable
	}
	return sourceVolatile
}

func (v *inv) addMeta(source, key, value string) {
	v.meta = append(v.meta, metaRow{source, cut(clean(key), maxMetaKey), cut(clean(value), maxMetaValue)})
}

func (v *inv) addBuildMetadata(m *bep.BuildMetadata) {
	md := m.GetMetadata()
	keys := make([]string, 0, len(md))
	for k := range md {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	for _, k := range keys {
		v.addMeta(sourceBuildMetadata, k, md[k])
	}
}

func (v *inv) addCmdLine(source, label string, args []string) {
	argv := make([]string, len(args))
	for i, a := range args {
		argv[i] = clean(a)
	}
	v.cmdLines = append(v.cmdLines, cmdLine{source, clean(label), argv})
}

// addStructured flattens a command_line.CommandLine into its arguments:
// chunks as they are, options in their combined form ("--name=value").
func (v *inv) addStructured(be *bazelEvent) {
	m := be.msg.(*bep.StructuredCommandLine)
	label := m.GetCommandLineLabel()
	if label == "" {
		label = be.id.GetStructuredCommandLine().GetCommandLineLabel()
	}
	var args []string
	for _, s := range m.GetSections() {
		args = append(args, s.GetChunkList().GetChunk()...)
		for _, o := range s.GetOptionList().GetOption() {
			switch {
			case o.GetCombinedForm() != "":
				args = append(args, o.GetCombinedForm())
			case o.GetOptionName() != "":
				args = append(args, "--"+o.GetOptionName()+"="+o.GetOptionValue())
			}
		}
	}
	if label == "canonical" || (label != "original" && len(args) > 0) {
		v.addCmdLine(sourceStructured, label, args)
	}
}

func (v *inv) addOptions(m *bep.OptionsParsed) {
	for _, o := range []struct {
		label string
		args  []string
	}{
		{"explicit_startup_options", m.GetExplicitStartupOptions()},
		{"explicit_cmd_line", m.GetExplicitCmdLine()},
	} {
		if len(o.args) > 0 {
			v.addCmdLine(sourceOptions, o.label, o.args)
		}
	}
}

// causeOf returns the build_failures key that a BuildEventId names, if it
// names one.
func causeOf(id *bep.BuildEventId) (causeKey, bool) {
	if a := id.GetActionCompleted(); a != nil {
		return causeKey{causeAction, clean(a.GetLabel()), clean(a.GetPrimaryOutput()), clean(a.GetConfiguration().GetId())}, true
	}
	if l := id.GetConfiguredLabel(); l != nil {
		return causeKey{causeConfiguredLabel, clean(l.GetLabel()), "", clean(l.GetConfiguration().GetId())}, true
	}
	if l := id.GetUnconfiguredLabel(); l != nil {
		return causeKey{causeUnconfiguredLabel, clean(l.GetLabel()), "", ""}, true
	}
	return causeKey{}, false
}

// ownCause reports whether a failed target's event makes the target its
// own root cause: it names no cause at all, or one of its own label (its
// action failed, or its label did not load or analyse).
func ownCause(be *bazelEvent) bool {
	if len(be.children) == 0 {
		return true
	}
	for _, id := range be.children {
		if k, ok := causeOf(id); ok && k.label == be.label {
			return true
		}
	}
	return false
}

// ownAction reports whether a failed target's event names an action of
// the target's own label among its root causes.
func ownAction(be *bazelEvent) bool {
	for _, id := range be.children {
		if k, ok := causeOf(id); ok && k.kind == causeAction && k.label == be.label {
			return true
		}
	}
	return false
}

func (v *inv) addCauses(be *bazelEvent) {
	for _, id := range be.children {
		if k, ok := causeOf(id); ok {
			v.causes = append(v.causes, cause{be.label, k})
		}
	}
}

// addActionFailure records a failed ActionExecuted under its id (the one a
// failed target's event names), with what Bazel says of its stderr: the
// URI, or the contents when the event carries them inline.
func (v *inv) addActionFailure(id *bep.BuildEventId, m *bep.ActionExecuted) {
	k, _ := causeOf(id)
	k.kind = causeAction
	if k.label == "" {
		k.label = clean(m.GetLabel())
	}
	v.failures = append(v.failures, failure{
		key:       k,
		mnemonic:  clean(m.GetType()),
		message:   clean(m.GetFailureDetail().GetMessage()),
		hasExit:   true,
		exitCode:  m.GetExitCode(),
		stderrURI: clean(m.GetStderr().GetUri()),
		stderr:    clean(string(m.GetStderr().GetContents())),
		stdoutURI: clean(m.GetStdout().GetUri()),
	})
}

// addLabelFailure records an Aborted event about a label that failed to
// load or analyse (Bazel names it as a root cause of the targets that
// depend on it).
func (v *inv) addLabelFailure(id *bep.BuildEventId, reason string) {
	if k, ok := causeOf(id); ok {
		v.failures = append(v.failures, failure{key: k, message: clean(reason)})
	}
}

// Writes: one INSERT over unnest() arrays per table, only in the batches
// that hold such rows.

const sqlInsertMetadata = `
insert into build_metadata (build_key, project, source, key, value)
select * from unnest($1::int8[], $2::text[], $3::text[], $4::text[], $5::text[])
on conflict do nothing`

// sqlInsertCommandLines inserts the batch's command lines ($1-$5), and the
// argument arrays ($6-$8: each (project, hash) once) of those it inserted:
// the first value of a key wins, and an array is written only for a row
// that names it. An array already stored is locked (ON CONFLICT DO UPDATE
// locks the row whatever its WHERE says) until the batch commits, so that
// deleting another build that named it cannot collect it meanwhile: the
// collector skips a locked array, and one it locked first and deleted is
// inserted again here once it commits (collectArgv).
const sqlInsertCommandLines = `
with cl as (
    insert into build_command_lines (build_key, project, source, label, argv_hash)
    select * from unnest($1::int8[], $2::text[], $3::text[], $4::text[], $5::bytea[])
    on conflict do nothing
    returning project, argv_hash
)
insert into build_argv as a (project, hash, argv)
select u.project, u.hash, string_to_array(u.argv, E'\x1f')
from unnest($6::text[], $7::bytea[], $8::text[]) as u(project, hash, argv)
where exists (select 1 from cl where cl.project = u.project and cl.argv_hash = u.hash)
on conflict (project, hash) do update set argv = a.argv where false`

// argvHash is build_argv's key of an argument array: the SHA-256 of each
// argument's bytes preceded by their length as 4 bytes, big-endian, the
// encoding of the SQL function build_argv_hash (migration 017, which
// hashes existing rows with it; TestArgvHashMatchesSQL holds the two
// equal). argv must be the array as stored (see onceCols.add).
func argvHash(argv []string) []byte {
	h := sha256.New()
	var n [4]byte
	for _, a := range argv {
		binary.BigEndian.PutUint32(n[:], uint32(len(a)))
		h.Write(n[:])
		h.Write([]byte(a))
	}
	return h.Sum(nil)
}

const sqlInsertFailures = `
insert into build_failures as f (build_key, id, reported, kind, label, primary_output, configuration, mnemonic,
    exit_code, message, stderr_uri, stderr, stdout_uri)
select u.build_key, u.id, u.reported, u.kind, u.label, u.output, u.config, nullif(u.mnemonic, ''), u.exit_code,
       nullif(u.message, ''), nullif(u.stderr_uri, ''), nullif(u.stderr, ''), nullif(u.stdout_uri, '')
from unnest($1::int8[], $2::int8[], $3::bool[], $4::text[], $5::text[], $6::text[], $7::text[], $8::text[], $9::int4[],
            $10::text[], $11::text[], $12::text[], $13::text[])
     as u(build_key, id, reported, kind, label, output, config, mnemonic, exit_code, message, stderr_uri, stderr, stdout_uri)
on conflict (build_key, id) do update set
    reported = true, mnemonic = excluded.mnemonic, exit_code = excluded.exit_code, message = excluded.message,
    stderr_uri = excluded.stderr_uri, stderr = excluded.stderr, stdout_uri = excluded.stdout_uri
where excluded.reported and not f.reported`

const sqlInsertCauses = `
insert into target_causes (build_key, label_id, cause_id)
select * from unnest($1::int8[], $2::int8[], $3::int8[])
on conflict do nothing`

// argvKey is a build_argv key, the hash as a string (a map key).
type argvKey struct{ project, hash string }

// onceCols are the batch's rows of the four tables, as unnest() arguments.
type onceCols struct {
	meta struct {
		build                       []int64
		project, source, key, value []string
	}
	cmd struct {
		build                  []int64
		project, source, label []string
		hash                   [][]byte
	}
	// argv holds each (project, hash) of cmd once: ON CONFLICT DO UPDATE
	// may not meet a row twice in one statement.
	argv struct {
		project, argv []string
		hash          [][]byte
		seen          map[argvKey]bool
	}
	fail struct {
		at                                    map[[2]int64]int // index of a (build, id) in the arrays
		key, id                               []int64
		reported                              []bool
		kind, label, output, config, mnemonic []string
		exitCode                              []pgtype.Int4
		message, stderrURI, stderr, stdoutURI []string
	}
	cause struct{ key, label, id []int64 }
}

func (c *onceCols) add(v *inv) {
	p, k := v.key.project, v.buildKey
	for _, m := range v.meta {
		r := &c.meta
		r.project, r.build = append(r.project, p), append(r.build, k)
		r.source, r.key, r.value = append(r.source, m.source), append(r.key, m.key), append(r.value, m.value)
	}
	for _, l := range v.cmdLines {
		// Hashed as stored: joinList replaces the separator in arguments,
		// and string_to_array makes [""] the empty array.
		joined := joinList(l.argv)
		hash := argvHash(splitList(joined))
		r := &c.cmd
		r.project, r.build = append(r.project, p), append(r.build, k)
		r.source, r.label, r.hash = append(r.source, l.source), append(r.label, l.label), append(r.hash, hash)
		a := &c.argv
		if k := (argvKey{p, string(hash)}); !a.seen[k] {
			if a.seen == nil {
				a.seen = map[argvKey]bool{}
			}
			a.seen[k] = true
			a.project, a.hash, a.argv = append(a.project, p), append(a.hash, hash), append(a.argv, joined)
		}
	}
	for _, f := range v.failures {
		c.addFailure(v.buildKey, f, true)
	}
	for _, k := range v.causes {
		r := &c.cause
		r.key, r.label, r.id = append(r.key, v.buildKey), append(r.label, labelID(k.label)), append(r.id, k.key.id())
		// The cause's own row, until (or unless) an event reports it.
		c.addFailure(v.buildKey, failure{key: k.key}, false)
	}
}

// addFailure adds a build_failures row: once per (build, id) in a batch,
// the first reported one winning over one only a cause named (the SQL
// applies the same rule to a stored row).
func (c *onceCols) addFailure(build int64, f failure, reported bool) {
	r := &c.fail
	k := [2]int64{build, f.key.id()}
	if i, ok := r.at[k]; ok {
		if reported && !r.reported[i] {
			r.reported[i] = true
			r.mnemonic[i], r.message[i] = f.mnemonic, f.message
			r.exitCode[i] = pgtype.Int4{Int32: f.exitCode, Valid: f.hasExit}
			r.stderrURI[i], r.stderr[i], r.stdoutURI[i] = f.stderrURI, f.stderr, f.stdoutURI
		}
		return
	}
	if r.at == nil {
		r.at = make(map[[2]int64]int)
	}
	r.at[k] = len(r.key)
	r.key, r.id, r.reported = append(r.key, build), append(r.id, k[1]), append(r.reported, reported)
	r.kind, r.label = append(r.kind, f.key.kind), append(r.label, f.key.label)
	r.output, r.config = append(r.output, f.key.output), append(r.config, f.key.config)
	r.mnemonic, r.message = append(r.mnemonic, f.mnemonic), append(r.message, f.message)
	r.exitCode = append(r.exitCode, pgtype.Int4{Int32: f.exitCode, Valid: f.hasExit})
	r.stderrURI, r.stderr, r.stdoutURI = append(r.stderrURI, f.stderrURI), append(r.stderr, f.stderr), append(r.stdoutURI, f.stdoutURI)
}

func (c *onceCols) queue(b *pgx.Batch) {
	if m := &c.meta; len(m.build) > 0 {
		b.Queue(sqlInsertMetadata, m.build, m.project, m.source, m.key, m.value)
	}
	if m := &c.cmd; len(m.build) > 0 {
		a := &c.argv
		b.Queue(sqlInsertCommandLines, m.build, m.project, m.source, m.label, m.hash, a.project, a.hash, a.argv)
	}
	if f := &c.fail; len(f.key) > 0 {
		b.Queue(sqlInsertFailures, f.key, f.id, f.reported, f.kind, f.label, f.output, f.config, f.mnemonic,
			f.exitCode, f.message, f.stderrURI, f.stderr, f.stdoutURI)
	}
	if k := &c.cause; len(k.key) > 0 {
		b.Queue(sqlInsertCauses, k.key, k.label, k.id)
	}
}

// Collecting argument arrays: deleting builds deletes their
// build_command_lines rows, then the build_argv rows those named that no
// row names any more (an array that other builds name stays).

// sqlDeleteCommandLines deletes builds' command lines ($1 the project, $2
// their ids) and locks the arrays they named, but for those a projector's
// batch holds (it names them again: sqlInsertCommandLines).
const sqlDeleteCommandLines = `
with gone as (
    delete from build_command_lines
    where build_key in (select build_key from invocations where id = any($2) and project = $1) returning argv_hash
)
select hash from build_argv where project = $1 and hash in (select argv_hash from gone)
for update skip locked`

// sqlCollectArgv deletes the locked arrays $2 of project $1 that no row
// names. It must be a statement after the one that locked them: its
// snapshot then holds every row that a projector's batch which held one of
// them committed (READ COMMITTED: each statement takes its own).
const sqlCollectArgv = `
delete from build_argv a
where a.project = $1 and a.hash = any($2)
  and not exists (select 1 from build_command_lines c where c.project = a.project and c.argv_hash = a.hash)`

// collectArgv deletes, in tx (READ COMMITTED), those of the locked arrays
// hashes of project that no command line names.
func collectArgv(ctx context.Context, tx pgx.Tx, project string, hashes [][]byte) error {
	if len(hashes) == 0 {
		return nil
	}
	_, err := tx.Exec(ctx, sqlCollectArgv, project, hashes)
	return err
}

// sqlLockProjectArgv locks a batch of project $1's arrays after hash $2,
// skipping those a projector's batch holds.
const sqlLockProjectArgv = `
select hash from build_argv where project = $1 and hash > $2 order by hash limit $3
for update skip locked`

// collectProjectArgv deletes, batch arrays to a transaction, those of
// project's arrays that no command line names: what deleting a whole
// project leaves (an array skipped while a batch of the projector held it
// and no build then named).
func collectProjectArgv(ctx context.Context, pool *pgxpool.Pool, project string, batch int) error {
	after := []byte{}
	for {
		var locked [][]byte
		err := pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
			rows, err := tx.Query(ctx, sqlLockProjectArgv, project, after, batch)
			if err != nil {
				return err
			}
			if locked, err = pgx.CollectRows(rows, pgx.RowTo[[]byte]); err != nil {
				return err
			}
			return collectArgv(ctx, tx, project, locked)
		})
		if err != nil || len(locked) < batch {
			return err
		}
		after = locked[len(locked)-1]
	}
}

// The read side (Show).

// StatusItem is one workspace status key: Bazel's own (BUILD_USER,
// BUILD_HOST, BUILD_TIMESTAMP, ...) and the --workspace_status_command's
// (BUILD_SCM_REVISION, STABLE_..., ...).
type StatusItem struct {
	Key   string `json:"key"`
	Value string `json:"value"`
	// Stable: the key is in Bazel's stable-status.txt (STABLE_ keys,
	// BUILD_EMBED_LABEL, BUILD_HOST, BUILD_USER), else volatile-status.txt.
	Stable bool `json:"stable"`
}

// CommandLine is one of a build's command lines as Bazel reported it
// (redacted by the edge).
type CommandLine struct {
	// Source is structured_command_line or options_parsed.
	Source string `json:"source"`
	// Label: a structured command line's label ("canonical", or "tool"
	// when it has arguments); the OptionsParsed list
	// ("explicit_startup_options", "explicit_cmd_line").
	Label string   `json:"label"`
	Args  []string `json:"args"`
}

// Cause is a root cause of a failed target, as Bazel named it in the
// event that reported the failure: a failed action (its label, mnemonic,
// exit code, message and stderr) or a label that failed to load or
// analyse. The fields after Kind, Label, PrimaryOutput and Configuration
// are null if the build holds no event about the cause.
type Cause struct {
	Kind          string  `json:"kind"` // action, configured_label or unconfigured_label
	Label         string  `json:"label"`
	PrimaryOutput string  `json:"primary_output"` // "" but for an action
	Configuration string  `json:"configuration"`
	Mnemonic      *string `json:"mnemonic"`
	ExitCode      *int32  `json:"exit_code"`
	Message       *string `json:"message"`
	// StderrURI is where Bazel says the action's stderr is: from Bazel
	// 4.2.3 a file:// URI on the client's machine, which the server cannot
	// read. Stderr is the contents when the event carried them inline.
	StderrURI *string `json:"stderr_uri"`
	Stderr    *string `json:"stderr"`
}

// readMetadata fills b's metadata, workspace status and command lines.
func (b *Build) readMetadata(ctx context.Context, q Querier) error {
	b.BuildMetadata, b.WorkspaceStatus, b.CommandLines = map[string]string{}, []StatusItem{}, []CommandLine{}
	rows, err := q.Query(ctx, `
		select source, key, value from build_metadata where build_key = `+sqlBuildKey+`
		order by source collate "C", key collate "C"`, b.ID, b.Project)
	if err != nil {
		return fmt.Errorf("metadata: %w", err)
	}
	var source, key, value string
	if _, err := pgx.ForEachRow(rows, []any{&source, &key, &value}, func() error {
		if source == sourceBuildMetadata {
			b.BuildMetadata[key] = value
		} else {
			b.WorkspaceStatus = append(b.WorkspaceStatus, StatusItem{key, value, source == sourceStable})
		}
		return nil
	}); err != nil {
		return fmt.Errorf("metadata: %w", err)
	}
	slices.SortFunc(b.WorkspaceStatus, func(x, y StatusItem) int { return strings.Compare(x.Key, y.Key) })

	rows, err = q.Query(ctx, `
		select c.source, c.label, a.argv from build_command_lines c
		join build_argv a on a.project = c.project and a.hash = c.argv_hash
		where c.build_key = `+sqlBuildKey+`
		order by c.source collate "C", c.label collate "C"`, b.ID, b.Project)
	if err != nil {
		return fmt.Errorf("command lines: %w", err)
	}
	var c CommandLine
	if _, err := pgx.ForEachRow(rows, []any{&c.Source, &c.Label, &c.Args}, func() error {
		b.CommandLines = append(b.CommandLines, c)
		if c.Source == sourceStructured && c.Label == "canonical" {
			b.CommandLine = c.Args
		}
		return nil
	}); err != nil {
		return fmt.Errorf("command lines: %w", err)
	}
	return nil
}

// causesColumn is a column of a query over targets joined with their
// build_labels row (labels; neither aliased otherwise): a
// failed target's root causes as a JSON array of Cause, null if it has
// none. Only a target that did not succeed probes target_causes (by its
// primary key) and build_failures (by theirs).
const causesColumn = `case when targets.success is not true then (
    select json_agg(json_build_object('kind', f.kind, 'label', f.label,
               'primary_output', f.primary_output, 'configuration', f.configuration, 'mnemonic', f.mnemonic,
               'exit_code', f.exit_code, 'message', f.message, 'stderr_uri', f.stderr_uri, 'stderr', f.stderr)
           order by f.label collate "C", f.primary_output collate "C", f.kind collate "C",
                    f.configuration collate "C")
    from target_causes c
    join build_failures f on f.build_key = c.build_key and f.id = c.cause_id
    where c.build_key = targets.build_key and c.label_id = targets.label_id) end`

// setCauses sets t's root causes from causesColumn's value, and a failure
// reason the row does not keep: that of the target's own failed action
// (rankOwnAction), as the projector would have copied it from the action.
func (t *Target) setCauses(raw []byte) error {
	t.RootCauses = []Cause{}
	if raw == nil {
		return nil
	}
	if err := json.Unmarshal(raw, &t.RootCauses); err != nil {
		return err
	}
	if t.FailureReason != nil {
		return nil
	}
	for _, c := range t.RootCauses {
		// A cause with neither message, mnemonic nor exit code is one no
		// event has reported yet (or ever: the build was cut off between
		// the TargetComplete and the ActionExecuted): no reason to show.
		// Of several failed actions of the target's own, the first in
		// the causes' order gives it.
		if c.Kind == causeAction && c.Label == t.Label && (c.Message != nil || c.Mnemonic != nil || c.ExitCode != nil) {
			r := actionReason(c)
			t.FailureReason = &r
			return nil
		}
	}
	return nil
}

// actionReason is a failed action's message, or what is known of it.
func actionReason(c Cause) string {
	if c.Message != nil && *c.Message != "" {
		return *c.Message
	}
	typ := "action"
	if c.Mnemonic != nil && *c.Mnemonic != "" {
		typ = *c.Mnemonic
	}
	code := int32(0)
	if c.ExitCode != nil {
		code = *c.ExitCode
	}
	return fmt.Sprintf("%s failed: exit code %d", typ, code)
}

// sqlPageCauses reads the root causes of some of a build's targets.
// Each target is probed by its key (the LIMIT keeps the subquery a loop
// over the ids, as in pages.go's walk).
const sqlPageCauses = `select c.* from unnest($3::int8[]) u(id) cross join lateral
    (select labels.label, ` + causesColumn + `
     from all_targets targets join build_labels labels on labels.project = $2 and labels.id = targets.label_id
     where targets.build_key = ` + sqlBuildKey + ` and targets.label_id = u.id limit 1) c`

// pageCauses fills the root causes of a page of targets, in one query for
// those that did not succeed.
func pageCauses(ctx context.Context, db Querier, project, invocationID string, ts []Target) error {
	var failed []int64
	for i := range ts {
		ts[i].RootCauses = []Cause{}
		if !ts[i].Success {
			failed = append(failed, labelID(ts[i].Label))
		}
	}
	if len(failed) == 0 {
		return nil
	}
	rows, err := db.Query(ctx, sqlPageCauses, invocationID, project, failed)
	if err != nil {
		return err
	}
	byLabel := make(map[string][]byte, len(failed))
	var (
		label string
		raw   []byte
	)
	if _, err := pgx.ForEachRow(rows, []any{&label, &raw}, func() error {
		byLabel[label] = slices.Clone(raw)
		return nil
	}); err != nil {
		return err
	}
	for i := range ts {
		if err := ts[i].setCauses(byLabel[ts[i].Label]); err != nil {
			return err
		}
	}
	return nil
}
