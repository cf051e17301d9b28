package builds

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/millrace/millrace/schemas/bep"
	"github.com/millrace/millrace/subjects"
)

// The merge rules below are the ones the SQL in write.go applies when a
// batch's values meet a stored row; keeping the two in step is what makes
// the rows independent of batch boundaries.

// state is one batch merged in memory.
type state struct {
	invs map[invKey]*inv
	ids  []invKey // in order of first appearance

	// Target and test rows the batch may write, and which of them exist.
	targetKeys, testKeys     keys
	targetExists, testExists map[rowKey]bool

	// cache is the projector's (nil: none); rowsKnown says it answered
	// for some of the batch's target and test rows.
	cache     *cache
	rowsKnown bool

	// layout and part are the projector's partition (buildKey).
	layout subjects.BESLayout
	part   int
}

// invKey is a build's identity: Bazel lets any client choose its
// invocation id, so two projects may send the same one, and only the pair
// names one build. Every map, row and statement of the projection uses it.
type invKey struct{ project, id string }

// compare orders keys as the primary keys do: invocation id, then project.
func (k invKey) compare(o invKey) int {
	if c := strings.Compare(k.id, o.id); c != 0 {
		return c
	}
	return strings.Compare(k.project, o.project)
}

type rowKey struct {
	invKey
	label string
}

// keys is a set of (project, invocation, label) triples kept as unnest()
// arguments.
type keys struct {
	seen                map[rowKey]bool
	project, inv, label []string
	labelID             []int64
}

func (k *keys) add(key invKey, label string) {
	rk := rowKey{key, label}
	if k.seen[rk] {
		return
	}
	if k.seen == nil {
		k.seen = make(map[rowKey]bool)
	}
	k.seen[rk] = true
	k.project = append(k.project, key.project)
	k.inv = append(k.inv, key.id)
	k.label = append(k.label, label)
	k.labelID = append(k.labelID, labelID(label))
}

// inv is what one batch says about one invocation.
type inv struct {
	key invKey

	// As stored before this batch.
	stored       bool
	storedSeq    int64
	storedStatus string
	storedDone   bool
	recalled     bool // the stored values come from the cache
	// buildKey is invocations.build_key: as stored, or for a new build
	// made of its first message applied (firstSeq, firstAt).
	buildKey int64
	firstSeq uint64

	// Labels of the target and test rows the batch inserts.
	newTargets, newTests []string

	write      bool // the batch changes the invocation
	buildID    string
	firstAt    time.Time
	lastAt     time.Time
	maxSeq     int64
	count      int64
	command    string
	version    string
	workspace  string
	user       string
	host       string
	startedAt  time.Time
	patterns   []string
	hasExit    bool
	exitCode   int32
	exitName   string
	finishedAt time.Time // BuildFinished, else InvocationAttemptFinished
	result     string    // InvocationAttemptFinished
	done       bool      // the tool stream has ended

	stdout, stderr []byte
	outSeq         int64 // sequence of the first progress event with output

	targets     map[string]*target
	targetOrder []string
	tests       map[string]*test
	testOrder   []string
	metrics     *bep.BuildMetrics
	// criticalPathMs and criticalPathSteps are what BuildToolLogs said of
	// the critical path, when hasCriticalPath (in this batch).
	criticalPathMs    int64
	criticalPathSteps string
	hasCriticalPath   bool

	// Rows of the tables that take a build's events once (metadata.go).
	meta     []metaRow
	cmdLines []cmdLine
	failures []failure
	causes   []cause
}

type target struct {
	label   string
	id      int64 // labelID(label), once
	known   bool  // a target event (not only a failed action) names it
	kind    string
	success int8 // 0 unknown, 1 true, -1 false
	reason  string
	rank    int16
	hasTags bool
	tags    []string
}

// Ranks of failure reasons; the strongest source wins, the first of equals.
// rankOwnAction: the target's TargetComplete names its own failed action
// as a root cause, and Bazel copied that action's failure detail into it.
// The reason is then the action's message, which build_failures holds:
// the target row keeps no text (a failed genrule's message is a few
// hundred bytes, kept twice before), and readers take the action's
// (Target.setCauses).
const (
	rankAction    = 1
	rankAborted   = 2
	rankComplete  = 3
	rankOwnAction = 4
)

type test struct {
	label         string
	id            int64 // labelID(label), once
	hasSummary    bool
	status        string
	attempts      int32
	runCount      int32
	shardCount    int32
	totalRunCount int32
	results       int32
	durationMs    int64
	numCached     int32
}

func newState() *state {
	return &state{invs: make(map[invKey]*inv)}
}

// add registers an event's invocation and the row it may write.
func (s *state) add(e *event) {
	k := e.key()
	if _, ok := s.invs[k]; !ok {
		s.invs[k] = &inv{key: k}
		s.ids = append(s.ids, k)
	}
	if e.kind != kindBazel || e.bazel.label == "" {
		return
	}
	switch e.bazel.payload {
	case payTestResult, payTestSummary:
		s.testKeys.add(k, e.bazel.label)
	default:
		s.targetKeys.add(k, e.bazel.label)
	}
}

// load reads, in one round trip, what the database knows of the batch's
// invocations and which of its target and test rows exist, but for what
// recall took from the cache.
func (s *state) load(ctx context.Context, tx pgx.Tx) error {
	b := &pgx.Batch{}
	var (
		project, id string
		seq         int64
		status      string
		done        bool
		key         int64
		label       string
	)
	b.Queue(sqlKeyedPlans)
	var unknown []invKey
	for _, k := range s.ids {
		if !s.invs[k].recalled {
			unknown = append(unknown, k)
		}
	}
	projects, ids := splitKeys(unknown)
	b.Queue(sqlLoad, projects, ids).Query(func(rows pgx.Rows) error {
		_, err := pgx.ForEachRow(rows, []any{&project, &id, &seq, &status, &done, &key}, func() error {
			if v := s.invs[invKey{project, id}]; v != nil {
				v.stored, v.storedSeq, v.storedStatus, v.storedDone, v.buildKey = true, seq, status, done, key
			}
			return nil
		})
		return err
	})
	exists := func(sql string, k *keys, into *map[rowKey]bool) {
		if len(k.inv) == 0 {
			return
		}
		if *into == nil {
			*into = make(map[rowKey]bool)
		}
		b.Queue(sql, k.project, k.inv, k.label, k.labelID).Query(func(rows pgx.Rows) error {
			_, err := pgx.ForEachRow(rows, []any{&project, &id, &label}, func() error {
				(*into)[rowKey{invKey{project, id}, label}] = true
				return nil
			})
			return err
		})
	}
	exists(sqlExistingTargets, &s.targetKeys, &s.targetExists)
	exists(sqlExistingTests, &s.testKeys, &s.testExists)
	if err := tx.SendBatch(ctx, b).Close(); err != nil {
		return fmt.Errorf("builds: load: %w", err)
	}
	return nil
}

// splitKeys returns the projects and ids of keys as unnest() arguments.
func splitKeys(ks []invKey) (projects, ids []string) {
	projects, ids = make([]string, len(ks)), make([]string, len(ks))
	for i, k := range ks {
		projects[i], ids[i] = k.project, k.id
	}
	return projects, ids
}

// apply merges one event.
func (s *state) apply(e *event) {
	v := s.invs[e.key()]
	if e.kind.tool() {
		if e.sequence <= v.storedSeq || e.sequence <= v.maxSeq {
			return // a resend of an event already applied
		}
		v.maxSeq = e.sequence
		v.count++
	}
	v.write = true
	if v.buildID == "" {
		v.buildID = e.buildID
	}
	if v.firstAt.IsZero() || e.at.Before(v.firstAt) {
		v.firstAt = e.at
	}
	if v.firstSeq == 0 || e.seq < v.firstSeq {
		v.firstSeq = e.seq
	}
	if e.at.After(v.lastAt) {
		v.lastAt = e.at
	}
	switch e.kind {
	case kindStreamFinished:
		v.done = true
	case kindAttemptFinished:
		v.result = e.attemptResult
		v.done = true
		if !v.hasExit {
			v.finishedAt = e.eventTime
			if v.finishedAt.IsZero() {
				v.finishedAt = e.at
			}
		}
	case kindBazel:
		v.applyBazel(e)
	}
}

func (v *inv) applyBazel(e *event) {
	be := &e.bazel
	if be.last {
		v.done = true
	}
	switch be.payload {
	case payProgress:
		if len(be.stdout) > 0 || len(be.stderr) > 0 {
			if v.outSeq == 0 {
				v.outSeq = e.sequence
			}
			v.stdout = append(v.stdout, be.stdout...)
			v.stderr = append(v.stderr, be.stderr...)
		}

	case payStarted:
		m := be.msg.(*bep.BuildStarted)
		v.command = setIf(v.command, m.GetCommand())
		v.version = setIf(v.version, m.GetBuildToolVersion())
		v.workspace = setIf(v.workspace, m.GetWorkspaceDirectory())
		if t := pbTime(m.GetStartTime(), m.GetStartTimeMillis()); !t.IsZero() {
			v.startedAt = t
		}

	case payWorkspace:
		for _, it := range be.msg.(*bep.WorkspaceStatus).GetItem() {
			switch it.GetKey() {
			case "BUILD_USER":
				v.user = setIf(v.user, it.GetValue())
			case "BUILD_HOST":
				v.host = setIf(v.host, it.GetValue())
			}
			v.addMeta(statusSource(it.GetKey()), it.GetKey(), it.GetValue())
		}

	case payBuildMetadata:
		v.addBuildMetadata(be.msg.(*bep.BuildMetadata))

	case payStructured:
		v.addStructured(be)

	case payOptionsParsed:
		v.addOptions(be.msg.(*bep.OptionsParsed))

	case payExpanded:
		for _, p := range be.id.GetPattern().GetPattern() {
			v.patterns = append(v.patterns, clean(p))
		}

	case payAborted:
		m := be.msg.(*bep.Aborted)
		reason := m.GetDescription()
		if reason == "" {
			reason = m.GetReason().String()
		}
		switch {
		case be.label != "":
			v.target(be.label).fail(rankAborted, reason)
			v.addCauses(be)
		case be.id.GetConfiguredLabel() != nil, be.id.GetUnconfiguredLabel() != nil:
			v.addLabelFailure(be.id, reason)
		case be.id.GetPattern() != nil:
			for _, p := range be.id.GetPattern().GetPattern() {
				v.patterns = append(v.patterns, clean(p))
			}
		}

	case payConfigured:
		if be.label == "" {
			return
		}
		m := be.msg.(*bep.TargetConfigured)
		t := v.target(be.label)
		t.known = true
		t.setKind(m.GetTargetKind())
		t.setTags(m.GetTag())

	case payAction:
		if !be.failedAction {
			return // successful actions are not even unmarshalled
		}
		m := be.msg.(*bep.ActionExecuted)
		v.addActionFailure(be.id, m)
		if be.label == "" {
			return
		}
		reason := m.GetFailureDetail().GetMessage()
		if reason == "" {
			typ := m.GetType()
			if typ == "" {
				typ = "action"
			}
			reason = fmt.Sprintf("%s failed: exit code %d", typ, m.GetExitCode())
		}
		v.target(be.label).fail(rankAction, reason)

	case payCompleted:
		if be.label == "" {
			return
		}
		m := be.msg.(*bep.TargetComplete)
		t := v.target(be.label)
		t.known = true
		t.setKind(m.GetTargetKind())
		t.setTags(m.GetTag())
		if m.GetSuccess() {
			t.succeed()
		} else {
			// Bazel copies the root cause's failure detail into every
			// target that failed because of it; the target keeps it as its
			// own failure reason only if it is one of its root causes, and
			// names the others in target_causes.
			reason := m.GetFailureDetail().GetMessage()
			switch {
			case ownAction(be):
				t.fail(rankOwnAction, "")
			case !ownCause(be):
				t.fail(rankComplete, "")
			default:
				t.fail(rankComplete, reason)
			}
			v.addCauses(be)
		}

	case payTestResult:
		if be.label == "" {
			return
		}
		id := be.id.GetTestResult()
		m := be.msg.(*bep.TestResult)
		t := v.test(be.label)
		t.results++
		t.attempts = max(t.attempts, id.GetAttempt())
		t.runCount = max(t.runCount, id.GetRun())
		t.shardCount = max(t.shardCount, id.GetShard())
		if !t.hasSummary {
			t.status = m.GetStatus().String()
			t.durationMs += pbMillis(m.GetTestAttemptDuration(), m.GetTestAttemptDurationMillis())
			if m.GetCachedLocally() || m.GetExecutionInfo().GetCachedRemotely() {
				t.numCached++
			}
		}

	case payTestSummary:
		if be.label == "" {
			return
		}
		m := be.msg.(*bep.TestSummary)
		t := v.test(be.label)
		t.hasSummary = true
		t.status = m.GetOverallStatus().String()
		t.totalRunCount = m.GetTotalRunCount()
		t.durationMs = pbMillis(m.GetTotalRunDuration(), m.GetTotalRunDurationMillis())
		t.numCached = m.GetTotalNumCached()
		t.attempts = max(t.attempts, m.GetAttemptCount())
		t.runCount = max(t.runCount, m.GetRunCount())
		t.shardCount = max(t.shardCount, m.GetShardCount())

	case payFinished:
		m := be.msg.(*bep.BuildFinished)
		v.hasExit = true
		if ec := m.GetExitCode(); ec != nil {
			v.exitCode, v.exitName = ec.GetCode(), clean(ec.GetName())
		} else if m.GetOverallSuccess() {
			v.exitCode, v.exitName = 0, "SUCCESS"
		} else {
			v.exitCode, v.exitName = 1, ""
		}
		v.finishedAt = pbTime(m.GetFinishTime(), m.GetFinishTimeMillis())
		if v.finishedAt.IsZero() {
			v.finishedAt = e.eventTime
		}
		if v.finishedAt.IsZero() {
			v.finishedAt = e.at
		}

	case payBuildMetrics:
		v.metrics = be.msg.(*bep.BuildMetrics)

	case payBuildToolLogs:
		if be.criticalPathMs >= 0 {
			v.criticalPathMs, v.criticalPathSteps, v.hasCriticalPath = be.criticalPathMs, be.criticalPathSteps, true
		}
	}
}

// progressOnly reports whether the batch changes nothing of a stored,
// running invocation but its event times, last sequence, event count and
// an empty build id: no descriptive field, no finish, no end of its
// stream. sqlUpdateProgress then writes it.
func (v *inv) progressOnly() bool {
	return v.stored && v.storedStatus == "running" && !v.done && !v.hasExit && v.result == "" &&
		v.finishedAt.IsZero() && v.startedAt.IsZero() && len(v.patterns) == 0 &&
		v.command == "" && v.version == "" && v.workspace == "" && v.user == "" && v.host == ""
}

// setIf returns s cleaned if it is not empty, else old: the newest value wins.
func setIf(old, s string) string {
	if s == "" {
		return old
	}
	return clean(s)
}

func (v *inv) target(label string) *target {
	if v.targets == nil {
		v.targets = make(map[string]*target)
	}
	t := v.targets[label]
	if t == nil {
		t = &target{label: label, id: labelID(label)}
		v.targets[label] = t
		v.targetOrder = append(v.targetOrder, label)
	}
	return t
}

func (v *inv) test(label string) *test {
	if v.tests == nil {
		v.tests = make(map[string]*test)
	}
	t := v.tests[label]
	if t == nil {
		t = &test{label: label, id: labelID(label)}
		v.tests[label] = t
		v.testOrder = append(v.testOrder, label)
	}
	return t
}

// setKind keeps the first kind: TargetConfigured's comes before
// TargetComplete's deprecated one.
func (t *target) setKind(kind string) {
	if t.kind == "" {
		t.kind = clean(kind)
	}
}

// setTags sets the first non-empty tag list a target's events give: a
// target without tags (most of them) keeps tags null, 13 bytes a row less
// than an empty array.
func (t *target) setTags(tags []string) {
	if t.hasTags || len(tags) == 0 {
		return
	}
	t.hasTags = true
	t.tags = make([]string, len(tags))
	for i, s := range tags {
		t.tags[i] = clean(s)
	}
}

// succeed and fail combine completions of several configurations of one
// label: the target succeeded only if every one did.
func (t *target) succeed() {
	if t.success == 0 {
		t.success = 1
	}
}

func (t *target) fail(rank int16, reason string) {
	if rank != rankAction {
		t.success = -1
		t.known = true
	}
	if (reason != "" || rank == rankOwnAction) && rank > t.rank {
		t.rank, t.reason = rank, clean(reason)
	}
}
