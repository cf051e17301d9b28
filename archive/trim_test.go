package archive_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/nats-io/nats.go/jetstream"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/millrace/millrace/archive"
	"github.com/millrace/millrace/projectors/builds"
	"github.com/millrace/millrace/streams"
	"github.com/millrace/millrace/subjects"
)

// The durable the archiver always waits for is the builds projector's.
func TestProjectorDurable(t *testing.T) {
	if archive.ProjectorDurable != builds.ConsumerName {
		t.Fatalf("archive.ProjectorDurable %q, the builds projector's durable %q", archive.ProjectorDurable, builds.ConsumerName)
	}
}

// ackTo makes (or takes) the durable consumer name on every BES subject
// and acknowledges every message up to seq, one delivery at a time, so
// that nothing past seq is left delivered and unacknowledged.
func (e *env) ackTo(t *testing.T, name string, seq uint64) {
	t.Helper()
	s := e.src.Stream
	c, err := s.CreateOrUpdateConsumer(e.ctx, jetstream.ConsumerConfig{Durable: name, FilterSubject: subjects.BESFilter, AckPolicy: jetstream.AckAllPolicy})
	if err != nil {
		t.Fatal(err)
	}
	if info, _ := c.Info(e.ctx); info.AckFloor.Stream >= seq {
		return
	}
	for {
		m, err := c.Next(jetstream.FetchMaxWait(5 * time.Second))
		if err != nil {
			t.Fatalf("%s: next past %d: %v", name, seq, err)
		}
		md, _ := m.Metadata()
		if md.Sequence.Stream >= seq {
			if err := m.DoubleAck(e.ctx); err != nil {
				t.Fatal(err)
			}
			return
		}
	}
}

// inStream is how many messages of subject the stream holds.
func (e *env) inStream(t *testing.T, subject string) uint64 {
	t.Helper()
	info, err := e.src.Stream.Info(e.ctx, jetstream.WithSubjectFilter(subject))
	if err != nil {
		t.Fatal(err)
	}
	return info.State.Subjects[subject]
}

// trimmedSeq is archived_builds.trimmed_seq (0: null).
func (e *env) trimmedSeq(t *testing.T, project, id string) uint64 {
	t.Helper()
	var seq *int64
	if err := e.pool.QueryRow(e.ctx, `select trimmed_seq from archived_builds where project = $1 and invocation_id = $2`, project, id).Scan(&seq); err != nil {
		t.Fatal(err)
	}
	if seq == nil {
		return 0
	}
	return uint64(*seq)
}

// value is the value of the counter or gauge name on reg.
func value(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, _ := reg.Gather()
	for _, mf := range mfs {
		if mf.GetName() == name {
			m := mf.GetMetric()[0]
			if m.GetCounter() != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	t.Fatalf("no metric %s", name)
	return 0
}

// trimming is an archiver that trims the stream.
func (e *env) trimming(t *testing.T, c archive.Config, m *archive.Metrics) *archive.Archiver {
	t.Helper()
	a, err := archive.New(c, e.pool, e.store, e.src, m)
	if err != nil {
		t.Fatal(err)
	}
	return a.TrimWith(streams.SubjectTrimmer{Stream: e.src.Stream})
}

const otherID = "4132743f-f8c2-4341-90c8-70e094d45b16"

// TestTrimWaitsForEveryReader: an archived build's raw events leave the
// stream only once the builds projector's durable, every other durable
// of BES (a Kafka export's) and every holder named have acknowledged
// them; a holder that does not exist holds them; the messages of another
// build are untouched; the metrics count what left.
func TestTrimWaitsForEveryReader(t *testing.T) {
	e := newEnv(t)
	other := invocation(t, "bazel-build-10.besrec") // running: never archived
	half := len(other.Messages) / 2
	e.publish(t, archive.Build{Messages: other.Messages[:half]})
	b := invocation(t, "bazel-test-60.besrec")
	last := e.publish(t, b)
	e.publish(t, archive.Build{Messages: other.Messages[half:]}) // stored after this build's
	n, lastTool := tools(b)
	e.finished(t, project, testID, time.Hour, n, lastTool)
	subject := subjects.BES(project, testID)
	otherSubject := other.Messages[0].SubjectName
	otherCount := e.inStream(t, otherSubject)
	reg := prometheus.NewRegistry()
	m := archive.NewMetrics(reg)
	a := e.trimming(t, archive.Config{}, m)
	held := func(why string, a *archive.Archiver) {
		t.Helper()
		if _, _, err := a.Pass(e.ctx); err != nil {
			t.Fatal(err)
		}
		if got := e.inStream(t, subject); got != uint64(len(b.Messages)) || e.trimmedSeq(t, project, testID) != 0 {
			t.Fatalf("%s: the stream holds %d of the build's %d messages, trimmed_seq %d; want none trimmed",
				why, got, len(b.Messages), e.trimmedSeq(t, project, testID))
		}
		if g := value(t, reg, "millrace_archive_trim_waiting_builds"); g != 1 {
			t.Fatalf("%s: waiting gauge %v, want 1", why, g)
		}
	}
	held("no builds projector durable", a)
	if row, ok := e.archived(t, project, testID); !ok || row.LastSeq != int64(last) {
		t.Fatalf("not archived: %+v %v", row, ok)
	}
	e.ackTo(t, builds.ConsumerName, last-1)
	held("the projector one message short", a)
	e.ackTo(t, builds.ConsumerName, last)
	e.ackTo(t, "export-kafka-bes", 5)
	held("a Kafka export's durable behind", a)
	e.ackTo(t, "export-kafka-bes", last)
	named := e.trimming(t, archive.Config{HoldFor: []string{"mirror"}}, m)
	held("a named holder that does not exist", named)

	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	if got, seq := e.inStream(t, subject), e.trimmedSeq(t, project, testID); got != 0 || seq != last {
		t.Fatalf("every reader past the build: %d of its messages in the stream, trimmed_seq %d; want 0 and %d", got, seq, last)
	}
	if got := e.inStream(t, otherSubject); got != otherCount {
		t.Fatalf("the other build: %d messages in the stream, want %d", got, otherCount)
	}
	if v := value(t, reg, "millrace_archive_trimmed_builds_total"); v != 1 {
		t.Fatalf("trimmed builds %v, want 1", v)
	}
	if v := value(t, reg, "millrace_archive_trimmed_messages_total"); v != float64(len(b.Messages)) {
		t.Fatalf("trimmed messages %v, want %d", v, len(b.Messages))
	}
	if g := value(t, reg, "millrace_archive_trim_waiting_builds"); g != 0 {
		t.Fatalf("waiting gauge %v after the trim, want 0", g)
	}
	verify(t, e, 0) // the object is the build, with the stream holding none of it
}

// TestTrimNeverABadObject: a build whose object verify found bad keeps
// its raw events in the stream, whoever has read them; once verify finds
// it good again (the object restored), it is trimmed.
func TestTrimNeverABadObject(t *testing.T) {
	e := newEnv(t)
	b := invocation(t, "bazel-test-60.besrec")
	last := e.publish(t, b)
	n, lastTool := tools(b)
	e.finished(t, project, testID, time.Hour, n, lastTool)
	e.ackTo(t, builds.ConsumerName, last)
	a, _ := archive.New(archive.Config{}, e.pool, e.store, e.src, nil) // archives, does not trim
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	key := archive.BuildKey(project, testID)
	orig, _ := e.store.Get(e.ctx, key)
	e.store.Put(e.ctx, key, flip(orig, len(orig)/2))
	verify(t, e, 1)
	a = e.trimming(t, archive.Config{}, nil)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	if got := e.inStream(t, subject(testID)); got != uint64(len(b.Messages)) || e.trimmedSeq(t, project, testID) != 0 {
		t.Fatalf("a bad object: %d of the build's messages left in the stream, trimmed_seq %d; want all, null", got, e.trimmedSeq(t, project, testID))
	}
	e.store.Put(e.ctx, key, orig)
	verify(t, e, 0)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	if got := e.inStream(t, subject(testID)); got != 0 || e.trimmedSeq(t, project, testID) != last {
		t.Fatalf("the object good again: %d messages left, trimmed_seq %d", got, e.trimmedSeq(t, project, testID))
	}
}

func subject(id string) string { return subjects.BES(project, id) }

// TestRearchiveAfterTrim: a build trimmed from the stream that gets a
// late event is archived again from its object and the stream's message
// after it: the new object holds every message once, in order; then it is
// trimmed again up to the late event, and verify finds it good.
func TestRearchiveAfterTrim(t *testing.T) {
	e := newEnv(t)
	b := invocation(t, "bazel-test-60.besrec")
	first := e.publish(t, b) - uint64(len(b.Messages)) + 1
	n, lastTool := tools(b)
	e.finished(t, project, testID, time.Hour, n, lastTool)
	e.ackTo(t, builds.ConsumerName, first+uint64(len(b.Messages))-1)
	a := e.trimming(t, archive.Config{}, nil)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	if e.inStream(t, subject(testID)) != 0 {
		t.Fatal("not trimmed")
	}
	late := *b.Messages[len(b.Messages)-1]
	late.Headers = map[string][]string{}
	for k, v := range b.Messages[len(b.Messages)-1].Headers {
		late.Headers[k] = v
	}
	late.Headers["Nats-Msg-Id"] = []string{"late"}
	lateSeq := e.publish(t, archive.Build{Messages: []*archive.Message{&late}})
	e.finished(t, project, testID, time.Hour-time.Minute, n, lastTool)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	got := readAll(t, e, archive.BuildKey(project, testID))
	want := append(append([]*archive.Message{}, b.Messages...), &late)
	if len(got) != len(want) {
		t.Fatalf("re-archived object: %d messages, want %d (the trimmed %d and the late one)", len(got), len(want), len(b.Messages))
	}
	for i, m := range got {
		wantSeq := first + uint64(i)
		if i == len(want)-1 {
			wantSeq = lateSeq
		}
		if m.Sequence != wantSeq || !bytes.Equal(m.Payload, want[i].Payload) || m.SubjectName != want[i].SubjectName {
			t.Fatalf("message %d: seq %d, want %d, or its data differs", i, m.Sequence, wantSeq)
		}
	}
	if row, _ := e.archived(t, project, testID); row.Events != int64(len(want)) || row.LastSeq != int64(lateSeq) {
		t.Fatalf("archived_builds: %+v", row)
	}
	// The projector reads the late event: trimmed up to it.
	e.ackTo(t, builds.ConsumerName, lateSeq)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	if e.inStream(t, subject(testID)) != 0 || e.trimmedSeq(t, project, testID) != lateSeq {
		t.Fatalf("the late event not trimmed: trimmed_seq %d", e.trimmedSeq(t, project, testID))
	}
	verify(t, e, 0)
}

// TestRearchiveKeepsABadTrimmedObject: a trimmed build whose object does
// not decode is not rewritten when a late event comes (that would keep
// the late event alone): the failure is counted as check, with the
// build, and the object stays as it was.
func TestRearchiveKeepsABadTrimmedObject(t *testing.T) {
	e := newEnv(t)
	b := invocation(t, "bazel-build-10.besrec")
	last := e.publish(t, b)
	n, lastTool := tools(b)
	e.finished(t, project, otherID, time.Hour, n, lastTool)
	e.ackTo(t, builds.ConsumerName, last)
	reg := prometheus.NewRegistry()
	a := e.trimming(t, archive.Config{}, archive.NewMetrics(reg))
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	if e.trimmedSeq(t, project, otherID) != last {
		t.Fatal("not trimmed")
	}
	key := archive.BuildKey(project, otherID)
	orig, _ := e.store.Get(e.ctx, key)
	bad := flip(orig, len(orig)/2)
	e.store.Put(e.ctx, key, bad)
	late := *b.Messages[len(b.Messages)-1]
	late.Headers = map[string][]string{"Nats-Msg-Id": {"late"}}
	e.publish(t, archive.Build{Messages: []*archive.Message{&late}})
	e.finished(t, project, otherID, time.Hour-time.Minute, n, lastTool)
	if _, _, err := a.Pass(e.ctx); err != nil {
		t.Fatal(err)
	}
	if f := failures(t, reg, archive.ReasonCheck); f != 1 {
		t.Fatalf("failures{reason=check} = %v, want 1", f)
	}
	if now, _ := e.store.Get(e.ctx, key); !bytes.Equal(now, bad) {
		t.Fatal("the bad object of a trimmed build was rewritten")
	}
	if e.inStream(t, subject(otherID)) != 1 {
		t.Fatal("the late event left the stream")
	}
}
