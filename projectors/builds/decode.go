package builds

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	"github.com/millrace/millrace/schemas/bep"
)

// The decoder walks the wire format of the BES envelope
// (google.devtools.build.v1.OrderedBuildEvent) and of each BuildEvent by
// hand, and unmarshals into generated types only the payloads the
// projection reads. Progress events, about a third of a build's events and
// most of its bytes, are never unmarshalled: their output is sliced out of
// the message bytes.

// Field numbers of google.devtools.build.v1 (build_events.proto,
// publish_build_event.proto, build_status.proto).
const (
	obeStreamID = 1 // OrderedBuildEvent.stream_id
	obeSequence = 2 // OrderedBuildEvent.sequence_number
	obeEvent    = 3 // OrderedBuildEvent.event

	streamBuildID      = 1 // StreamId.build_id
	streamInvocationID = 6 // StreamId.invocation_id

	evTime             = 1  // BuildEvent.event_time
	evAttemptStarted   = 51 // BuildEvent.invocation_attempt_started
	evAttemptFinished  = 52 // BuildEvent.invocation_attempt_finished
	evBuildEnqueued    = 53 // BuildEvent.build_enqueued
	evBuildFinished    = 55 // BuildEvent.build_finished
	evStreamFinished   = 59 // BuildEvent.component_stream_finished
	evBazelEvent       = 60 // BuildEvent.bazel_event
	attemptFinStatus   = 3  // InvocationAttemptFinished.invocation_status
	buildStatusResult  = 1  // BuildStatus.result
	anyTypeURL         = 1
	anyValue           = 2
	timestampSeconds   = 1
	timestampNanos     = 2
	maxScrubDepth      = 64
	bazelEventTypeName = bep.TypeURL
)

// Field numbers of build_event_stream.BuildEvent (see schemas/proto).
const (
	beID          = 1
	beChildren    = 2
	beLastMessage = 20

	payProgress      = 3
	payAborted       = 4
	payStarted       = 5
	payExpanded      = 6
	payAction        = 7
	payCompleted     = 8
	payTestSummary   = 9
	payTestResult    = 10
	payOptionsParsed = 13
	payFinished      = 14
	payWorkspace     = 16
	payConfigured    = 18
	payStructured    = 22
	payBuildToolLogs = 23
	payBuildMetrics  = 24
	payBuildMetadata = 26

	toolLogsLog     = 1 // BuildToolLogs.log (repeated File)
	fileName        = 1 // File.name
	fileContents    = 3 // File.contents
	criticalPathLog = "critical path"

	progressStdout = 1
	progressStderr = 2
	actionSuccess  = 1
)

// eventKind says what an OrderedBuildEvent carries, as far as the
// projection cares.
type eventKind uint8

const (
	// kindIgnore: build-level lifecycle events and anything else that does
	// not belong to one invocation's projection.
	kindIgnore eventKind = iota
	// kindBazel: a tool event holding a build_event_stream.BuildEvent.
	kindBazel
	// kindOtherTool: a tool event of another type; it still takes up its
	// sequence number.
	kindOtherTool
	// kindStreamFinished: ComponentStreamFinished, the end of the tool stream.
	kindStreamFinished
	kindAttemptStarted
	kindAttemptFinished
)

// tool reports whether the event is part of the sequenced tool stream.
func (k eventKind) tool() bool {
	return k == kindBazel || k == kindOtherTool || k == kindStreamFinished
}

// body is the decoded form of one message body.
type body struct {
	kind          eventKind
	invocationID  string
	buildID       string
	sequence      int64
	eventTime     time.Time // zero if absent or out of range
	attemptResult string    // InvocationAttemptFinished: BuildStatus.Result name
	bazel         bazelEvent
}

// bazelEvent is the part of a BuildEvent that the projection reads.
type bazelEvent struct {
	payload protowire.Number // oneof case number, 0 if none
	last    bool
	// id is set for the payloads that need it (targets, tests, patterns).
	id *bep.BuildEventId
	// stdout and stderr of a Progress event alias the message bytes.
	stdout, stderr []byte
	// msg is the unmarshalled payload for the payloads read in full; nil
	// for progress and for payloads the projection does not read.
	msg proto.Message
	// failedAction is set for an ActionExecuted with success=false (msg is
	// then its *bep.ActionExecuted); successful actions are not unmarshalled.
	failedAction bool
	// label is the (cleaned) target label of a target event or failed
	// action, or the test label of a test event; "" if none. Aspect events
	// have none: they would collide with their target's row.
	label string
	// children are the ids a failed TargetComplete or a target's Aborted
	// event names: its root causes. Decoded for those events only.
	children []*bep.BuildEventId
	// criticalPathMs is the critical path's length that BuildToolLogs
	// names (-1: it names none), criticalPathSteps its steps as stored
	// (CriticalStep).
	criticalPathMs    int64
	criticalPathSteps string
}

// setLabel computes label from the id (and a failed action's payload).
func (e *bazelEvent) setLabel() {
	var l string
	switch e.payload {
	case payAborted, payConfigured, payCompleted:
		if id := e.id.GetTargetCompleted(); id != nil && id.GetAspect() == "" {
			l = id.GetLabel()
		} else if id := e.id.GetTargetConfigured(); id != nil && id.GetAspect() == "" {
			l = id.GetLabel()
		}
	case payAction:
		if e.failedAction {
			if l = e.id.GetActionCompleted().GetLabel(); l == "" {
				l = e.msg.(*bep.ActionExecuted).GetLabel()
			}
		}
	case payTestResult:
		l = e.id.GetTestResult().GetLabel()
	case payTestSummary:
		l = e.id.GetTestSummary().GetLabel()
	}
	e.label = clean(l)
}

var errTruncated = errors.New("truncated or malformed protobuf")

// field is one protobuf field read off the wire.
type field struct {
	num protowire.Number
	typ protowire.Type
	v   uint64 // varint and fixed values
	b   []byte // length-delimited values (aliases the input)
}

// next reads the field at the start of b and returns it and the rest.
func next(b []byte) (field, []byte, error) {
	num, typ, n := protowire.ConsumeTag(b)
	if n < 0 {
		return field{}, nil, errTruncated
	}
	b = b[n:]
	f := field{num: num, typ: typ}
	switch typ {
	case protowire.VarintType:
		f.v, n = protowire.ConsumeVarint(b)
	case protowire.BytesType:
		f.b, n = protowire.ConsumeBytes(b)
	case protowire.Fixed32Type:
		var v uint32
		v, n = protowire.ConsumeFixed32(b)
		f.v = uint64(v)
	case protowire.Fixed64Type:
		f.v, n = protowire.ConsumeFixed64(b)
	default:
		n = protowire.ConsumeFieldValue(num, typ, b)
	}
	if n < 0 {
		return field{}, nil, errTruncated
	}
	return f, b[n:], nil
}

// decodeBody decodes one message body: an OrderedBuildEvent in protobuf
// binary form as a BES client sent it. It is the decoder of bytes from the
// network and is fuzzed (FuzzDecode). The returned body may alias data.
func decodeBody(data []byte) (body, error) {
	var (
		d      body
		event  []byte
		f      field
		err    error
		gotEvt bool
	)
	for b := data; len(b) > 0; {
		if f, b, err = next(b); err != nil {
			return d, fmt.Errorf("OrderedBuildEvent: %w", err)
		}
		switch {
		case f.num == obeStreamID && f.typ == protowire.BytesType:
			if err := d.decodeStreamID(f.b); err != nil {
				return d, err
			}
		case f.num == obeSequence && f.typ == protowire.VarintType:
			d.sequence = int64(f.v)
		case f.num == obeEvent && f.typ == protowire.BytesType:
			event, gotEvt = f.b, true
		}
	}
	if !gotEvt {
		return d, errors.New("OrderedBuildEvent has no event")
	}
	if err := d.decodeEvent(event); err != nil {
		return d, err
	}
	return d, nil
}

func (d *body) decodeStreamID(b []byte) error {
	for len(b) > 0 {
		f, rest, err := next(b)
		if err != nil {
			return fmt.Errorf("StreamId: %w", err)
		}
		b = rest
		if f.typ != protowire.BytesType {
			continue
		}
		switch f.num {
		case streamBuildID:
			d.buildID = clean(string(f.b))
		case streamInvocationID:
			d.invocationID = clean(string(f.b))
		}
	}
	return nil
}

// decodeEvent decodes a google.devtools.build.v1.BuildEvent.
func (d *body) decodeEvent(b []byte) error {
	var (
		f       field
		err     error
		which   protowire.Number
		payload []byte
	)
	for len(b) > 0 {
		if f, b, err = next(b); err != nil {
			return fmt.Errorf("BuildEvent: %w", err)
		}
		if f.typ != protowire.BytesType {
			continue
		}
		switch f.num {
		case evTime:
			d.eventTime = decodeTimestamp(f.b)
		case evAttemptStarted, evAttemptFinished, evBuildEnqueued, evBuildFinished, evStreamFinished, evBazelEvent:
			which, payload = f.num, f.b
		}
	}
	switch which {
	case evBazelEvent:
		return d.decodeAny(payload)
	case evStreamFinished:
		d.kind = kindStreamFinished
	case evAttemptStarted:
		d.kind = kindAttemptStarted
	case evAttemptFinished:
		d.kind = kindAttemptFinished
		d.attemptResult = decodeAttemptResult(payload)
	default:
		d.kind = kindIgnore
	}
	return nil
}

// decodeAttemptResult returns the name of
// InvocationAttemptFinished.invocation_status.result.
func decodeAttemptResult(b []byte) string {
	var result uint64
	for len(b) > 0 {
		f, rest, err := next(b)
		if err != nil {
			break
		}
		b = rest
		if f.num != attemptFinStatus || f.typ != protowire.BytesType {
			continue
		}
		for s := f.b; len(s) > 0; {
			g, rest, err := next(s)
			if err != nil {
				break
			}
			s = rest
			if g.num == buildStatusResult && g.typ == protowire.VarintType {
				result = g.v
			}
		}
	}
	return buildpb.BuildStatus_Result(int32(result)).String()
}

func (d *body) decodeAny(b []byte) error {
	var typeURL, value []byte
	for len(b) > 0 {
		f, rest, err := next(b)
		if err != nil {
			return fmt.Errorf("bazel_event Any: %w", err)
		}
		b = rest
		if f.typ != protowire.BytesType {
			continue
		}
		switch f.num {
		case anyTypeURL:
			typeURL = f.b
		case anyValue:
			value = f.b
		}
	}
	if string(typeURL) != bazelEventTypeName {
		d.kind = kindOtherTool
		return nil
	}
	d.kind = kindBazel
	if err := d.bazel.decode(value); err != nil {
		return fmt.Errorf("build_event_stream.BuildEvent: %w", err)
	}
	return nil
}

// decode decodes a build_event_stream.BuildEvent.
func (e *bazelEvent) decode(b []byte) error {
	var (
		f       field
		err     error
		id      []byte
		payload []byte
		all     = b
	)
	for len(b) > 0 {
		if f, b, err = next(b); err != nil {
			return err
		}
		switch {
		case f.num == beID && f.typ == protowire.BytesType:
			id = f.b
		case f.num == beLastMessage && f.typ == protowire.VarintType:
			e.last = f.v != 0
		case f.num >= payProgress && f.typ == protowire.BytesType && f.num != beLastMessage:
			e.payload, payload = f.num, f.b
		}
	}
	var needID bool
	switch e.payload {
	case payProgress:
		return e.decodeProgress(payload)
	case payAborted:
		e.msg, needID = new(bep.Aborted), true
	case payStarted:
		e.msg = new(bep.BuildStarted)
	case payWorkspace:
		e.msg = new(bep.WorkspaceStatus)
	case payExpanded:
		needID = true
	case payConfigured:
		e.msg, needID = new(bep.TargetConfigured), true
	case payAction:
		if actionSucceeded(payload) {
			return nil
		}
		e.msg, needID, e.failedAction = new(bep.ActionExecuted), true, true
	case payCompleted:
		e.msg, needID = new(bep.TargetComplete), true
	case payBuildMetadata:
		e.msg = new(bep.BuildMetadata)
	case payStructured:
		e.msg, needID = new(bep.StructuredCommandLine), true
	case payOptionsParsed:
		e.msg = new(bep.OptionsParsed)
	case payTestResult:
		e.msg, needID = new(bep.TestResult), true
	case payTestSummary:
		e.msg, needID = new(bep.TestSummary), true
	case payFinished:
		e.msg = new(bep.BuildFinished)
	case payBuildMetrics:
		e.msg = new(bep.BuildMetrics)
	case payBuildToolLogs:
		e.criticalPathMs, e.criticalPathSteps = criticalPath(payload)
		return nil
	default:
		e.payload = 0 // not read by the projection
		return nil
	}
	if needID {
		e.id = new(bep.BuildEventId)
		if err := unmarshal(id, e.id); err != nil {
			return fmt.Errorf("id: %w", err)
		}
	}
	if e.msg != nil {
		if err := unmarshal(payload, e.msg); err != nil {
			return fmt.Errorf("payload %d: %w", e.payload, err)
		}
	}
	e.setLabel()
	if e.label != "" && e.failedTarget() {
		return e.decodeChildren(all)
	}
	return nil
}

// failedTarget reports whether the event reports a target's failure: a
// TargetComplete with success false, or an Aborted event about a target.
func (e *bazelEvent) failedTarget() bool {
	switch e.payload {
	case payCompleted:
		return !e.msg.(*bep.TargetComplete).GetSuccess()
	case payAborted:
		return true
	}
	return false
}

// decodeChildren reads the children ids of the BuildEvent b. Only the
// kinds of id that can be a root cause are kept (a failed action, a label
// that failed to load or analyse); Bazel lists no others in a failed
// target's event, and an Aborted target lists none at all when it was
// only skipped.
func (e *bazelEvent) decodeChildren(b []byte) error {
	for len(b) > 0 {
		f, rest, err := next(b)
		if err != nil {
			return err
		}
		b = rest
		if f.num != beChildren || f.typ != protowire.BytesType {
			continue
		}
		id := new(bep.BuildEventId)
		if err := unmarshal(f.b, id); err != nil {
			return fmt.Errorf("child id: %w", err)
		}
		if id.GetActionCompleted() != nil || id.GetConfiguredLabel() != nil || id.GetUnconfiguredLabel() != nil {
			e.children = append(e.children, id)
		}
	}
	return nil
}

func (e *bazelEvent) decodeProgress(b []byte) error {
	for len(b) > 0 {
		f, rest, err := next(b)
		if err != nil {
			return fmt.Errorf("progress: %w", err)
		}
		b = rest
		if f.typ != protowire.BytesType {
			continue
		}
		switch f.num {
		case progressStdout:
			e.stdout = f.b
		case progressStderr:
			e.stderr = f.b
		}
	}
	return nil
}

// actionSucceeded reads ActionExecuted.success without unmarshalling the
// action (its command line and file references are large).
func actionSucceeded(b []byte) bool {
	success := false
	for len(b) > 0 {
		f, rest, err := next(b)
		if err != nil {
			return false
		}
		b = rest
		if f.num == actionSuccess && f.typ == protowire.VarintType {
			success = f.v != 0
		}
	}
	return success
}

// decodeTimestamp decodes a google.protobuf.Timestamp; zero if invalid.
func decodeTimestamp(b []byte) time.Time {
	var secs, nanos int64
	for len(b) > 0 {
		f, rest, err := next(b)
		if err != nil {
			return time.Time{}
		}
		b = rest
		if f.typ != protowire.VarintType {
			continue
		}
		switch f.num {
		case timestampSeconds:
			secs = int64(f.v)
		case timestampNanos:
			nanos = int64(int32(f.v))
		}
	}
	if nanos < 0 || nanos >= 1e9 {
		return time.Time{}
	}
	return validTime(time.Unix(secs, nanos))
}

// unmarshal is proto.Unmarshal that tolerates invalid UTF-8 in string
// fields: Bazel's strings are bytes from file names and tool output, and a
// stray byte must not make a whole event undecodable. On a first failure it
// replaces invalid sequences in every string field by U+FFFD and tries once
// more; it reports the original error if the bytes are malformed otherwise.
func unmarshal(b []byte, m proto.Message) error {
	err := proto.Unmarshal(b, m)
	if err == nil {
		return nil
	}
	fixed, changed, ok := scrubUTF8(b, m.ProtoReflect().Descriptor(), 0)
	if !ok || !changed {
		return err
	}
	if proto.Unmarshal(fixed, m) != nil {
		return err
	}
	return nil
}

// scrubUTF8 rewrites the message bytes b of type md with every string
// field made valid UTF-8. ok is false if b is not well-formed protobuf.
func scrubUTF8(b []byte, md protoreflect.MessageDescriptor, depth int) (out []byte, changed, ok bool) {
	if depth > maxScrubDepth {
		return nil, false, false
	}
	out = make([]byte, 0, len(b))
	for len(b) > 0 {
		start := b
		f, rest, err := next(b)
		if err != nil {
			return nil, false, false
		}
		b = rest
		fd := md.Fields().ByNumber(f.num)
		if f.typ != protowire.BytesType || fd == nil {
			out = append(out, start[:len(start)-len(rest)]...)
			continue
		}
		v := f.b
		switch fd.Kind() {
		case protoreflect.StringKind:
			if !utf8.Valid(v) {
				v, changed = []byte(strings.ToValidUTF8(string(v), "\uFFFD")), true
			}
		case protoreflect.MessageKind:
			sub, ch, ok := scrubUTF8(v, fd.Message(), depth+1)
			if !ok {
				return nil, false, false
			}
			if ch {
				v, changed = sub, true
			}
		}
		out = protowire.AppendTag(out, f.num, f.typ)
		out = protowire.AppendBytes(out, v)
	}
	return out, changed, true
}

// clean makes s storable as PostgreSQL text: valid UTF-8 without NUL bytes.
func clean(s string) string {
	for i := 0; i < len(s); i++ {
		if c := s[i]; c == 0 || c >= utf8.RuneSelf {
			return cleanSlow(s)
		}
	}
	return s
}

func cleanSlow(s string) string {
	if !utf8.ValidString(s) {
		s = strings.ToValidUTF8(s, "\uFFFD")
	}
	return strings.ReplaceAll(s, "\x00", "\uFFFD")
}

// PostgreSQL's timestamptz reaches from 4713 BC to 294276 AD; a client's
// nonsense time must not make a batch fail forever, so times outside years
// 1..9999 are treated as absent.
var (
	minTime = time.Date(1, 1, 1, 0, 0, 0, 0, time.UTC)
	maxTime = time.Date(9999, 12, 31, 23, 59, 59, 0, time.UTC)
)

func validTime(t time.Time) time.Time {
	if t.Before(minTime) || t.After(maxTime) {
		return time.Time{}
	}
	return t.UTC()
}

// pbTime prefers a google.protobuf.Timestamp field (newer Bazel) over a
// milliseconds field (Bazel up to 5); zero if neither is set.
func pbTime(ts interface {
	GetSeconds() int64
	GetNanos() int32
}, millis int64) time.Time {
	if ts != nil && (ts.GetSeconds() != 0 || ts.GetNanos() != 0) {
		if n := ts.GetNanos(); n >= 0 && n < 1e9 {
			return validTime(time.Unix(ts.GetSeconds(), int64(n)))
		}
	}
	if millis != 0 {
		return validTime(time.UnixMilli(millis))
	}
	return time.Time{}
}

// pbMillis prefers a google.protobuf.Duration field over a milliseconds field.
func pbMillis(d interface {
	GetSeconds() int64
	GetNanos() int32
}, millis int64) int64 {
	if d != nil && (d.GetSeconds() != 0 || d.GetNanos() != 0) {
		return d.GetSeconds()*1000 + int64(d.GetNanos())/1e6
	}
	return millis
}

// criticalPath reads the critical path from BuildToolLogs' log named
// "critical path", whose contents Bazel writes as "Critical Path: 12.34s,
// ..." and then the path's steps, one a line ("  0.17s action 'Testing
// //a:b'"): its length in milliseconds (-1 when there is none, or it does
// not read so) and its steps (parseCriticalPath).
func criticalPath(b []byte) (int64, string) {
	for len(b) > 0 {
		f, rest, err := next(b)
		if err != nil {
			return -1, ""
		}
		b = rest
		if f.num != toolLogsLog || f.typ != protowire.BytesType {
			continue
		}
		var name string
		var contents []byte
		for file := f.b; len(file) > 0; {
			g, rest, err := next(file)
			if err != nil {
				return -1, ""
			}
			file = rest
			switch {
			case g.num == fileName && g.typ == protowire.BytesType:
				name = string(g.b)
			case g.num == fileContents && g.typ == protowire.BytesType:
				contents = g.b
			}
		}
		if name == criticalPathLog {
			return parseCriticalPath(contents)
		}
	}
	return -1, ""
}

const (
	// maxCriticalSteps and maxCriticalWhat bound what a build keeps of its
	// critical path: Bazel lists every step, and a deep build's path is
	// long, and each step costs a build about 40 bytes (the bench's
	// storage scenario). The steps kept are the longest, in the path's
	// order.
	maxCriticalSteps = 5
	maxCriticalWhat  = 200
)

// parseCriticalPath reads "Critical Path: 12.34s" at the start of
// contents, and the steps on the lines after it: the steps are kept as
// lines of "MS\tWHAT" (at most maxCriticalSteps, the longest; WHAT cut at
// maxCriticalWhat bytes), a line that does not read as a step is skipped.
func parseCriticalPath(contents []byte) (int64, string) {
	first, rest, _ := strings.Cut(string(contents), "\n")
	first, ok := strings.CutPrefix(first, "Critical Path: ")
	ms := parseSeconds(first)
	if !ok || ms < 0 {
		return -1, ""
	}
	type step struct {
		ms   int64
		what string
		at   int
	}
	var steps []step
	for line := range strings.Lines(rest) {
		d, what, ok := strings.Cut(strings.TrimSpace(line), " ")
		if !ok || what == "" {
			continue
		}
		sms := parseSeconds(d)
		if sms < 0 || len(d) != strings.IndexByte(d, 's')+1 {
			continue
		}
		what = strings.TrimSpace(what)
		// An action's step is "action 'DESCRIPTION'": the description
		// alone is kept (it says what the action did), others as written
		// ("runfiles for //a:b").
		if d, ok := strings.CutPrefix(what, "action '"); ok && len(d) > 1 && strings.HasSuffix(d, "'") {
			what = d[:len(d)-1]
		}
		steps = append(steps, step{sms, cut(what, maxCriticalWhat), len(steps)})
	}
	if len(steps) > maxCriticalSteps {
		slices.SortStableFunc(steps, func(a, b step) int { return cmp.Compare(b.ms, a.ms) })
		steps = steps[:maxCriticalSteps]
		slices.SortFunc(steps, func(a, b step) int { return cmp.Compare(a.at, b.at) })
	}
	var out strings.Builder
	for i, st := range steps {
		if i > 0 {
			out.WriteByte('\n')
		}
		out.WriteString(strconv.FormatInt(st.ms, 10))
		out.WriteByte('\t')
		out.WriteString(st.what)
	}
	return ms, out.String()
}

// parseSeconds reads the "12.34s" that s starts with as milliseconds; -1
// when it does not start so.
func parseSeconds(s string) int64 {
	i := 0
	for i < len(s) && (s[i] >= '0' && s[i] <= '9' || s[i] == '.') {
		i++
	}
	if i == 0 || i == len(s) || s[i] != 's' {
		return -1
	}
	secs, err := strconv.ParseFloat(s[:i], 64)
	if err != nil || secs > 1e9 {
		return -1
	}
	return int64(math.Round(secs * 1000))
}
