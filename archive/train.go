package archive

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"time"

	"github.com/klauspost/compress/dict"
	"github.com/klauspost/compress/zstd"
	buildpb "google.golang.org/genproto/googleapis/devtools/build/v1"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/loadtest/besrecord"
	"github.com/millrace/millrace/schemas/envelope"
	"github.com/millrace/millrace/subjects"
)

// DefaultDictBytes is the size of a trained dictionary unless told: zstd's
// own trainer's default (112 KiB) rounded up.
const DefaultDictBytes = 128 << 10

// Build is one archived build's messages, in stream order.
type Build struct {
	Subject  string
	Messages []*Message
}

// Train builds a dictionary with id from builds: its samples are the
// records as the Writer encodes them, so that it learns subjects and
// headers as well as events. size zero means DefaultDictBytes.
func Train(builds []Build, id uint32, size int, level zstd.EncoderLevel) ([]byte, error) {
	if size == 0 {
		size = DefaultDictBytes
	}
	var samples [][]byte
	for _, b := range builds {
		for _, m := range b.Messages {
			samples = append(samples, AppendRecord(nil, m))
		}
	}
	if len(samples) == 0 {
		return nil, fmt.Errorf("archive: no samples to train a dictionary on")
	}
	d, err := dict.BuildZstdDict(samples, dict.Options{MaxDictSize: size, HashBytes: 6, ZstdDictID: id, ZstdLevel: level})
	if err != nil {
		return nil, fmt.Errorf("archive: train a dictionary: %w", err)
	}
	return d, nil
}

// Ratio is what archiving builds costs: their records uncompressed and
// the objects' bytes.
type Ratio struct {
	Builds, Messages int
	RawBytes, Stored int64
}

// Of is raw over stored (0 when nothing was stored).
func (r Ratio) Of() float64 {
	if r.Stored == 0 {
		return 0
	}
	return float64(r.RawBytes) / float64(r.Stored)
}

// Measure writes each build as an object with d (nil: plain zstd) at
// level and sums the sizes.
func Measure(builds []Build, d *Dict, level zstd.EncoderLevel) (Ratio, error) {
	var r Ratio
	for _, b := range builds {
		var cw countingWriter
		w, err := NewWriter(&cw, d, level)
		if err != nil {
			return Ratio{}, err
		}
		for _, m := range b.Messages {
			if err := w.Write(m); err != nil {
				return Ratio{}, err
			}
		}
		st, err := w.Close()
		if err != nil {
			return Ratio{}, err
		}
		r.Builds++
		r.Messages += len(b.Messages)
		r.RawBytes += int64(st.RawBytes)
		r.Stored += cw.n
	}
	return r, nil
}

type countingWriter struct{ n int64 }

func (c *countingWriter) Write(p []byte) (int, error) { c.n += int64(len(p)); return len(p), nil }

// FromRecording turns a BES recording (loadtest/besrecord's format) into
// the builds the stream would hold for it: one per invocation's subject
// (build-level lifecycle events, which the archive leaves to the stream's
// age limit, are left out), each request's
// event as the BES edge publishes it (subject, headers and the encoded
// OrderedBuildEvent; services/bes, Server.message), with stream
// sequences counted from firstSeq in arrival order and stored times from
// the events' own. The edge's redaction is not applied: a dictionary
// trained on it loses little. Requests that Bazel resent are kept once.
func FromRecording(r io.Reader, firstSeq uint64) ([]Build, error) {
	rd := besrecord.NewReader(r)
	bySubject := map[string]int{}
	seen := map[string]bool{}
	var out []Build
	seq := firstSeq
	for {
		rec, err := rd.Next()
		if err == io.EOF {
			return out, nil
		}
		if err != nil {
			return nil, err
		}
		obe := rec.OrderedBuildEvent()
		project := rec.Stream.GetProjectId()
		kind := envelope.KindTool
		if rec.Lifecycle != nil {
			project, kind = rec.Lifecycle.GetProjectId(), envelope.KindLifecycle
		}
		if project == "" {
			project = "default"
		}
		sid := obe.GetStreamId()
		key := sid.GetInvocationId()
		if key == "" {
			continue // a build-level lifecycle event: its subject is never archived
		}
		msgID := subjects.Token(project) + "/" + subjects.Token(sid.GetInvocationId()) + "/" + strconv.FormatInt(obe.GetSequenceNumber(), 10)
		if kind == envelope.KindLifecycle {
			msgID = "lc/" + subjects.Token(project) + "/" + subjects.Token(sid.GetBuildId()) + "/" +
				subjects.Token(sid.GetInvocationId()) + "/" + strconv.FormatInt(obe.GetSequenceNumber(), 10)
		}
		if seen[msgID] {
			continue
		}
		seen[msgID] = true
		m, err := edgeMessage(project, kind, msgID, subjects.BES(project, key), obe, seq)
		if err != nil {
			return nil, err
		}
		seq++
		i, ok := bySubject[m.SubjectName]
		if !ok {
			i = len(out)
			bySubject[m.SubjectName] = i
			out = append(out, Build{Subject: m.SubjectName})
		}
		out[i].Messages = append(out[i].Messages, m)
	}
}

func edgeMessage(project, kind, msgID, subject string, obe *buildpb.OrderedBuildEvent, seq uint64) (*Message, error) {
	data, err := proto.Marshal(obe)
	if err != nil {
		return nil, fmt.Errorf("archive: encode event: %w", err)
	}
	at := obe.GetEvent().GetEventTime().AsTime()
	if obe.GetEvent().GetEventTime() == nil {
		at = time.Unix(0, 0)
	}
	sid := obe.GetStreamId()
	return &Message{Sequence: seq, Stored: at, SubjectName: subject, Payload: data, Headers: map[string][]string{
		envelope.MsgID:        {msgID},
		envelope.Schema:       {envelope.SchemaBESv1},
		envelope.Kind:         {kind},
		envelope.Project:      {project},
		envelope.BuildID:      {sid.GetBuildId()},
		envelope.InvocationID: {sid.GetInvocationId()},
		envelope.Sequence:     {strconv.FormatInt(obe.GetSequenceNumber(), 10)},
	}}, nil
}

// Trained is what TrainAndSave made and measured.
type Trained struct {
	Dict *Dict
	// Train and Held are how many builds trained the dictionary and how
	// many were held out to measure it; when there was only one build,
	// it did both.
	Train, Held int
	// With and Plain are the held-out builds archived with the new
	// dictionary and with plain zstd, at Level.
	With, Plain Ratio
}

// String is the report `millrace zstd train` prints.
func (t Trained) String() string {
	on := fmt.Sprintf("%d held-out builds", t.Held)
	if t.Held == 0 {
		on = "no build held out (one build), on the training build"
	}
	return fmt.Sprintf("dictionary %d (%s, %d bytes), trained on %d builds, now current\n%s (%d events, %d bytes raw): %.2fx with it, %.2fx with plain zstd",
		t.Dict.ID, DictKey(t.Dict.ID), len(t.Dict.Data), t.Train, on, t.With.Messages, t.With.RawBytes, t.With.Of(), t.Plain.Of())
}

// TrainAndSave holds every fifth build out (none when there is one),
// trains a dictionary of size bytes (zero: DefaultDictBytes) on the rest,
// stores it and makes it current (Dicts.Save), and measures it on the
// held-out builds against plain zstd at the archiver's Level.
func TrainAndSave(ctx context.Context, dicts *Dicts, builds []Build, size int) (Trained, error) {
	var train, held []Build
	for i, b := range builds {
		if len(builds) > 1 && i%5 == 4 || len(builds) > 1 && len(builds) < 5 && i == len(builds)-1 {
			held = append(held, b)
		} else {
			train = append(train, b)
		}
	}
	if len(held) == 0 {
		held = train
	}
	d, err := dicts.Save(ctx, func(id uint32) ([]byte, error) { return Train(train, id, size, Level) })
	if err != nil {
		return Trained{}, err
	}
	out := Trained{Dict: d, Train: len(train), Held: len(held)}
	if out.With, err = Measure(held, d, Level); err != nil {
		return Trained{}, err
	}
	if out.Plain, err = Measure(held, nil, Level); err != nil {
		return Trained{}, err
	}
	if len(builds) == 1 {
		out.Held = 0
	}
	return out, nil
}

// ReadBuild reads the messages of one subject from src into a Build, up
// to maxBytes of data (zero: no limit): samples for Train.
func ReadBuild(ctx context.Context, src Source, subject string, maxBytes int64) (Build, error) {
	b := Build{Subject: subject}
	var n int64
	errFull := errors.New("full")
	err := read(ctx, src, subject, func(m *Message) error {
		b.Messages = append(b.Messages, m)
		if n += int64(len(m.Payload)); maxBytes > 0 && n >= maxBytes {
			return errFull
		}
		return nil
	})
	if err != nil && !errors.Is(err, errFull) {
		return Build{}, err
	}
	return b, nil
}

// FromRecordings reads the builds of each recording file (FromRecording).
func FromRecordings(files []string) ([]Build, error) {
	var out []Build
	for _, name := range files {
		f, err := os.Open(name)
		if err != nil {
			return nil, err
		}
		bs, err := FromRecording(f, 1)
		f.Close()
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		out = append(out, bs...)
	}
	return out, nil
}
