package replay

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"slices"

	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/loadtest/besrecord"
)

// Script is one recorded build, ready to be replayed any number of times,
// each time under fresh build and invocation ids.
type Script struct {
	// BuildID is the build id as recorded.
	BuildID string
	// Before are the lifecycle events sent before the streams
	// (BuildEnqueued, InvocationAttemptStarted), After those sent once the
	// streams are acknowledged (InvocationAttemptFinished, BuildFinished).
	Before, After []*buildpb.PublishLifecycleEventRequest
	// Streams holds one tool event stream per invocation, in recorded order.
	Streams []*ToolStream
}

// ToolStream is one invocation's PublishBuildToolEventStream, its requests
// numbered 1..N+1 (the last is ComponentStreamFinished).
type ToolStream struct {
	InvocationID string
	Requests     []*buildpb.PublishBuildToolEventStreamRequest
	component    buildpb.StreamId_BuildComponent
	// Each request pre-encoded without its stream id and project id, so a
	// replay costs a few copies per event rather than a clone and a marshal.
	obeRest [][]byte // OrderedBuildEvent minus stream_id
	reqRest [][]byte // the request minus ordered_build_event and project_id
}

// Events is how many messages one replay of the script publishes: every
// tool event (ComponentStreamFinished included) and lifecycle event.
func (s *Script) Events() int {
	n := len(s.Before) + len(s.After)
	for _, ts := range s.Streams {
		n += len(ts.Requests)
	}
	return n
}

// Scripts groups a recording's records into one Script per build. Bazel's
// retries are undone: a request recorded twice (same invocation and
// sequence) is kept once. A build whose streams are not complete
// (1..N+1 with ComponentStreamFinished last) is left out, with the reason
// in skipped.
func Scripts(recs []besrecord.Record) (scripts []*Script, skipped []error) {
	type build struct {
		s       *Script
		streams map[string]*ToolStream
		seen    map[string]bool // lifecycle events already taken
		bad     error
	}
	var order []string
	builds := map[string]*build{}
	get := func(id string) *build {
		b := builds[id]
		if b == nil {
			b = &build{s: &Script{BuildID: id}, streams: map[string]*ToolStream{}, seen: map[string]bool{}}
			builds[id] = b
			order = append(order, id)
		}
		return b
	}
	for _, r := range recs {
		switch {
		case r.Lifecycle != nil:
			obe := r.Lifecycle.GetBuildEvent()
			sid := obe.GetStreamId()
			b := get(sid.GetBuildId())
			key := fmt.Sprintf("%s/%d/%d", sid.GetInvocationId(), sid.GetComponent(), obe.GetSequenceNumber())
			if b.seen[key] {
				continue
			}
			b.seen[key] = true
			switch obe.GetEvent().GetEvent().(type) {
			case *buildpb.BuildEvent_BuildEnqueued_, *buildpb.BuildEvent_InvocationAttemptStarted_:
				b.s.Before = append(b.s.Before, r.Lifecycle)
			case *buildpb.BuildEvent_InvocationAttemptFinished_, *buildpb.BuildEvent_BuildFinished_:
				b.s.After = append(b.s.After, r.Lifecycle)
			default:
				b.bad = fmt.Errorf("build %s: unexpected lifecycle event %T", sid.GetBuildId(), obe.GetEvent().GetEvent())
			}
		case r.Stream != nil:
			sid := r.Stream.GetOrderedBuildEvent().GetStreamId()
			b := get(sid.GetBuildId())
			ts := b.streams[sid.GetInvocationId()]
			if ts == nil {
				ts = &ToolStream{InvocationID: sid.GetInvocationId(), component: sid.GetComponent()}
				b.streams[sid.GetInvocationId()] = ts
				b.s.Streams = append(b.s.Streams, ts)
			}
			ts.Requests = append(ts.Requests, r.Stream)
		}
	}
	for _, id := range order {
		b := builds[id]
		if b.bad == nil {
			b.bad = b.s.finish()
		}
		if b.bad != nil {
			skipped = append(skipped, b.bad)
			continue
		}
		scripts = append(scripts, b.s)
	}
	return scripts, skipped
}

func (s *Script) finish() error {
	if len(s.Streams) == 0 {
		return fmt.Errorf("build %s: no tool event stream", s.BuildID)
	}
	for _, ts := range s.Streams {
		if ts.InvocationID == "" {
			return fmt.Errorf("build %s: a stream has no invocation id", s.BuildID)
		}
		// Keep the first copy of each sequence number (a retry resends
		// from the first unacknowledged event), in order.
		bySeq := map[int64]*buildpb.PublishBuildToolEventStreamRequest{}
		for _, r := range ts.Requests {
			seq := r.GetOrderedBuildEvent().GetSequenceNumber()
			if _, ok := bySeq[seq]; !ok {
				bySeq[seq] = r
			}
		}
		seqs := make([]int64, 0, len(bySeq))
		for seq := range bySeq {
			seqs = append(seqs, seq)
		}
		slices.Sort(seqs)
		ts.Requests = ts.Requests[:0]
		for i, seq := range seqs {
			if seq != int64(i+1) {
				return fmt.Errorf("build %s invocation %s: recorded sequence numbers are not 1..%d (event %d missing)", s.BuildID, ts.InvocationID, len(seqs), i+1)
			}
			ts.Requests = append(ts.Requests, bySeq[seq])
		}
		last := ts.Requests[len(ts.Requests)-1].GetOrderedBuildEvent().GetEvent()
		if last.GetComponentStreamFinished() == nil {
			return fmt.Errorf("build %s invocation %s: the stream does not end with component_stream_finished (recording cut short?)", s.BuildID, ts.InvocationID)
		}
		if err := ts.encode(); err != nil {
			return fmt.Errorf("build %s: %w", s.BuildID, err)
		}
	}
	return nil
}

func (ts *ToolStream) encode() error {
	ts.obeRest = make([][]byte, len(ts.Requests))
	ts.reqRest = make([][]byte, len(ts.Requests))
	for i, r := range ts.Requests {
		obe := proto.CloneOf(r.GetOrderedBuildEvent())
		obe.StreamId = nil
		b, err := proto.Marshal(obe)
		if err != nil {
			return fmt.Errorf("encode event %d: %w", i+1, err)
		}
		ts.obeRest[i] = b
		req := proto.CloneOf(r)
		req.OrderedBuildEvent = nil
		req.ProjectId = ""
		if b, err = proto.Marshal(req); err != nil {
			return fmt.Errorf("encode request %d: %w", i+1, err)
		}
		ts.reqRest[i] = b
	}
	return nil
}

// Field numbers of the messages replay writes by hand.
const (
	fieldReqOrderedBuildEvent = 4 // PublishBuildToolEventStreamRequest.ordered_build_event
	fieldReqProjectID         = 6 // PublishBuildToolEventStreamRequest.project_id
	fieldOBEStreamID          = 1 // OrderedBuildEvent.stream_id
)

// streamIDs are the fresh ids of one replayed tool stream, pre-encoded.
type streamIDs struct {
	sid     *buildpb.StreamId
	sidFld  []byte // OrderedBuildEvent field 1 with the new StreamId
	projFld []byte // request field 6 with the project id
}

func newStreamIDs(buildID, invocationID, project string, c buildpb.StreamId_BuildComponent) (streamIDs, error) {
	sid := &buildpb.StreamId{BuildId: buildID, InvocationId: invocationID, Component: c}
	b, err := proto.Marshal(sid)
	if err != nil {
		return streamIDs{}, err
	}
	ids := streamIDs{sid: sid}
	ids.sidFld = protowire.AppendBytes(protowire.AppendTag(nil, fieldOBEStreamID, protowire.BytesType), b)
	if project != "" {
		ids.projFld = protowire.AppendString(protowire.AppendTag(nil, fieldReqProjectID, protowire.BytesType), project)
	}
	return ids, nil
}

// request returns the wire bytes of request i with the stream's fresh ids:
// what proto.Marshal would give for the recorded request with its stream id
// and project id replaced (fields in another order, which protobuf allows).
func (ts *ToolStream) request(i int, ids streamIDs) []byte {
	rest := ts.obeRest[i]
	obeLen := len(ids.sidFld) + len(rest)
	n := 1 + protowire.SizeVarint(uint64(obeLen)) + obeLen + len(ts.reqRest[i]) + len(ids.projFld)
	b := make([]byte, 0, n)
	b = protowire.AppendTag(b, fieldReqOrderedBuildEvent, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(obeLen))
	b = append(b, ids.sidFld...)
	b = append(b, rest...)
	b = append(b, ts.reqRest[i]...)
	b = append(b, ids.projFld...)
	return b
}

// lifecycle returns a copy of req under the fresh ids.
func lifecycle(req *buildpb.PublishLifecycleEventRequest, buildID string, invocations map[string]string, project string) *buildpb.PublishLifecycleEventRequest {
	c := proto.CloneOf(req)
	sid := c.GetBuildEvent().GetStreamId()
	sid.BuildId = buildID
	if sid.InvocationId != "" {
		sid.InvocationId = invocations[sid.InvocationId]
	}
	if project != "" {
		c.ProjectId = project
	}
	return c
}

// NewID returns a random (version 4) UUID, as Bazel uses for build and
// invocation ids.
func NewID() string {
	var u [16]byte
	rand.Read(u[:])
	u[6] = u[6]&0x0f | 0x40
	u[8] = u[8]&0x3f | 0x80
	var s [36]byte
	hex.Encode(s[0:8], u[0:4])
	s[8] = '-'
	hex.Encode(s[9:13], u[4:6])
	s[13] = '-'
	hex.Encode(s[14:18], u[6:8])
	s[18] = '-'
	hex.Encode(s[19:23], u[8:10])
	s[23] = '-'
	hex.Encode(s[24:], u[10:])
	return string(s[:])
}
