package redact

import (
	"bytes"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	"github.com/millrace/millrace/loadtest/besrecord"
	"github.com/millrace/millrace/schemas/bep"
)

// fixtureEvents are the bazel_event values of the recordings of real Bazel
// builds in loadtest/fixtures.
func fixtureEvents(tb testing.TB) [][]byte {
	_, file, _, _ := runtime.Caller(0)
	paths, _ := filepath.Glob(filepath.Join(filepath.Dir(file), "..", "..", "..", "loadtest", "fixtures", "*.besrec"))
	var evs [][]byte
	for _, p := range paths {
		recs, err := besrecord.Read(p)
		if err != nil {
			tb.Fatalf("recording %s: %v", p, err)
		}
		for _, rec := range recs {
			if v := rec.OrderedBuildEvent().GetEvent().GetBazelEvent().GetValue(); v != nil {
				evs = append(evs, v)
			}
		}
	}
	if len(evs) < 500 {
		tb.Fatalf("found %d recorded events in loadtest/fixtures, want the ~600 of the two recordings", len(evs))
	}
	return evs
}

// TestFixtures: on real builds with no secret, only the one --test_env value
// changes (the recording's MILLRACE_FLAKY_DIR), every event still decodes,
// and the client environment Bazel reports (PATH, HOME, ...) is kept.
func TestFixtures(t *testing.T) {
	r := MustNew(Config{Allow: DefaultAllow})
	changed := map[string]int{}
	for _, ev := range fixtureEvents(t) {
		out, ch := r.BuildEvent(ev)
		if !ch {
			if !bytes.Equal(out, ev) {
				t.Fatal("unchanged event came back different")
			}
			continue
		}
		var be bep.BuildEvent
		if err := proto.Unmarshal(out, &be); err != nil {
			t.Fatalf("redacted event does not decode: %v", err)
		}
		var orig bep.BuildEvent
		proto.Unmarshal(ev, &orig)
		changed[payloadName(&orig)]++
		if bytes.Contains(out, []byte("/flaky")) {
			t.Errorf("%s: the --test_env value survived", payloadName(&orig))
		}
		for _, keep := range []string{"MILLRACE_FLAKY_DIR=", "--keep_going"} {
			if bytes.Contains(ev, []byte(keep)) && !bytes.Contains(out, []byte(keep)) {
				t.Errorf("%s: %q is gone", payloadName(&orig), keep)
			}
		}
		if bytes.Contains(ev, []byte("--client_env=PATH=/usr/local/sbin")) && !bytes.Contains(out, []byte("--client_env=PATH=/usr/local/sbin")) {
			t.Errorf("%s: the allowed PATH value is gone", payloadName(&orig))
		}
	}
	// The test build (with --test_env) changes in its started, unstructured,
	// options_parsed and the original and canonical structured command lines.
	for _, p := range []string{"started", "unstructured_command_line", "options_parsed", "structured_command_line"} {
		if changed[p] == 0 {
			t.Errorf("no %s event was redacted (changed: %v)", p, changed)
		}
	}
	for p := range changed {
		if !strings.Contains("started unstructured_command_line options_parsed structured_command_line", p) {
			t.Errorf("a %s event changed", p)
		}
	}
}

func payloadName(be *bep.BuildEvent) string {
	f := be.ProtoReflect().WhichOneof(be.ProtoReflect().Descriptor().Oneofs().ByName("payload"))
	if f == nil {
		return "none"
	}
	return string(f.Name())
}

// wireValid reports whether b parses as protobuf wire format, its
// length-delimited fields that parse as messages recursively too.
func wireValid(b []byte) bool {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return false
		}
		m := protowire.ConsumeFieldValue(num, typ, b[n:])
		if m < 0 {
			return false
		}
		b = b[n+m:]
	}
	return true
}

// FuzzBuildEvent feeds the redactor what a client may send as a
// bazel_event. Run it with
//
//	go test -run '^$' -fuzz FuzzBuildEvent ./services/bes/redact/
//
// It checks that the redactor never panics, that its output is valid
// protobuf (decodes as a BuildEvent, parses as wire format) whenever its
// input was, and that redacting twice equals redacting once.
func FuzzBuildEvent(f *testing.F) {
	for _, ev := range fixtureEvents(f) {
		f.Add(ev)
	}
	evs, _ := secretEvents(f)
	for _, ev := range evs {
		f.Add(ev)
	}
	r := MustNew(Config{Allow: DefaultAllow, Patterns: []string{`corp-[0-9a-f]{8}`}})
	f.Fuzz(func(t *testing.T, in []byte) {
		orig := bytes.Clone(in)
		out, changed := r.BuildEvent(in)
		if !bytes.Equal(in, orig) {
			t.Fatal("the input was modified")
		}
		if !changed && !bytes.Equal(out, in) {
			t.Fatal("reported unchanged, returned different bytes")
		}
		if wireValid(in) && !wireValid(out) {
			t.Fatalf("valid wire format in, invalid out: %x", out)
		}
		if proto.Unmarshal(in, &bep.BuildEvent{}) == nil {
			if err := proto.Unmarshal(out, &bep.BuildEvent{}); err != nil {
				t.Fatalf("input decodes as a BuildEvent, output does not: %v", err)
			}
		}
		again, ch := r.BuildEvent(out)
		if ch || !bytes.Equal(again, out) {
			t.Fatalf("redacting twice differs from once:\n once %q\ntwice %q", out, again)
		}
	})
}

// FuzzText: the same properties for free text and single arguments.
func FuzzText(f *testing.F) {
	for _, s := range []string{"--remote_header=Authorization=Bearer X y", "https://u:p@h", ghToken, pemKey, jwt,
		"--action_env='A=b c' --x", "--default_override=0:build=--action_env=A=B", "a@b://c@d"} {
		f.Add(s)
	}
	r := MustNew(Config{Allow: DefaultAllow, Patterns: []string{`corp-[0-9a-f]{8}`}})
	f.Fuzz(func(t *testing.T, s string) {
		for _, fn := range []func(string) string{r.Text, r.Arg, r.ShellArgs} {
			once := fn(s)
			if twice := fn(once); twice != once {
				t.Fatalf("twice differs from once:\n   in %q\n once %q\ntwice %q", s, once, twice)
			}
		}
	})
}
