package main

import (
	"go/ast"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// The command layer maps flags to configs, lists components and prints
// what it did; a function that outgrows maxFuncLines, or a package that
// outgrows maxLines, holds code that belongs in a package of its own.
// maxLines is a ceiling for later commands to stay under: lower it when
// code leaves, raise it only with a reason. It was 1,800 until the raw
// archive's two commands (archive verify, zstd train) and its component
// came (archive.go, about 200 lines: flags, help and output; what they
// compute is in the archive and streams packages), and 2,000 until replay
// builds planned from the archive (the bucket and the stream's tail; the
// plan is archive.PlanReplay), and 2,100 until retention and deletion
// (projects retention, builds delete, the retention component of project
// builds and dev: flags, wiring and output, about 125 lines; what they do
// is in projectors/builds and archive), and 2,230 until console output
// moved into the archive (the adapter between archive and projectors/builds,
// which import neither the other, builds show --output, the replay's
// moves at its end and the console's bucket: about 65 lines; what they do
// is in projectors/builds, archive and console). It came down from 2,300
// when what was not wiring left (about 320 lines): opening the backbone,
// the database and the bucket of a command that runs once, which each
// command did by hand (internal/resources), the help of the commands whose
// work is one package's (beside that package's flags, as the load tools'),
// the output of builds show, builds scrub, archive verify and builds
// delete (console, projectors/builds, archive), a replay's progress
// (streams.Runner.ReplayReported) and the version (internal/cli). It
// went from 2,000 to 2,060 when the console got a command of its own
// (serve console: flags and wiring, about 60 lines; the console's views
// of the backbone and the bucket are console/backbone's), and from 2,060
// to 2,130 when the backbone got its operator's commands (streams
// accounts, backup and restore: flags and wiring, about 60 lines; their
// help, output and work are in streams), and from 2,130 to 2,170 when build
// events were partitioned (the builds projector's group and heartbeat flag,
// replay builds --partition, the layout handed to the archiver, the
// output mover and the console: wiring, about 40 lines; the group, the
// pause and the readers of every partition are in streams, the partition's
// projector in projectors/builds).
const (
	maxFuncLines = 60
	maxLines     = 2170
)

func TestCommandsStayThin(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	total := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		src, err := os.ReadFile(name)
		if err != nil {
			t.Fatal(err)
		}
		total += strings.Count(string(src), "\n")
		f, err := parser.ParseFile(fset, name, src, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			fn, ok := d.(*ast.FuncDecl)
			if !ok {
				continue
			}
			if n := fset.Position(fn.End()).Line - fset.Position(fn.Pos()).Line + 1; n > maxFuncLines {
				t.Errorf("%s: %s is %d lines (at most %d): move what is not flags, components or output to its package", fset.Position(fn.Pos()), fn.Name.Name, n, maxFuncLines)
			}
		}
	}
	if total > maxLines {
		t.Errorf("cmd/millrace holds %d lines outside its tests (at most %d)", total, maxLines)
	}
	t.Logf("cmd/millrace: %d lines outside its tests", total)
}
