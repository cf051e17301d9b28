package archive_test

import (
	"bytes"
	"testing"

	"github.com/millrace/millrace/archive"
)

// archive verify prints a line per bad build and a summary, or JSON
// objects, and fails when a build is bad; builds delete a line or an
// object; both their progress on one line rewritten in place.
func TestCommandOutput(t *testing.T) {
	var b bytes.Buffer
	progress := archive.ProgressLine(&b, "archive verify", "builds")
	progress(1, 2)
	progress(2, 2)
	if b.String() != "\rarchive verify: 1/2 builds   \rarchive verify: 2/2 builds   " {
		t.Fatalf("progress %q", b.String())
	}

	good := archive.Finding{Project: "p", Invocation: "i1", Key: "archive/builds/p/i1.mrar", Events: 3, InStream: 3}
	bad := archive.Finding{Project: "p", Invocation: "i2", Key: "archive/builds/p/i2.mrar", Events: 4, Error: "checksum differs\n"}
	b.Reset()
	archive.WriteFinding(&b, good, false)
	archive.WriteFinding(&b, bad, false)
	err := archive.WriteSummary(&b, archive.Summary{Builds: 2, Bad: 1}, false)
	if want := "bad: i2 of project p (archive/builds/p/i2.mrar): checksum differs\narchive verify: 2 builds, 1 bad\n"; b.String() != want {
		t.Fatalf("verify printed %q, want %q", b.String(), want)
	}
	if err == nil || err.Error() != "1 of 2 archived builds are bad" {
		t.Fatalf("a bad build: %v", err)
	}
	b.Reset()
	archive.WriteFinding(&b, good, true)
	if err := archive.WriteSummary(&b, archive.Summary{Builds: 1}, true); err != nil {
		t.Fatalf("no bad build: %v", err)
	}
	want := `{
  "project": "p",
  "invocation": "i1",
  "key": "archive/builds/p/i1.mrar",
  "events": 3,
  "in_stream": 3
}
{
  "builds": 1,
  "bad": 0
}
`
	if b.String() != want {
		t.Fatalf("verify --json printed %q, want %q", b.String(), want)
	}

	d := archive.Deleted{Builds: 2, Messages: 40, Objects: 1}
	b.Reset()
	if err := archive.WriteDeleted(&b, d, "p", false); err != nil || b.String() != "builds delete: deleted 2 builds' rows, 40 stream messages, 1 archive objects of project \"p\"\n" {
		t.Fatalf("delete printed %q, %v", b.String(), err)
	}
	b.Reset()
	if err := archive.WriteDeleted(&b, d, "p", true); err != nil || b.String() != "{\n  \"builds\": 2,\n  \"messages\": 40,\n  \"objects\": 1\n}\n" {
		t.Fatalf("delete --json printed %q, %v", b.String(), err)
	}
}
