package deps

import (
	"go/ast"
	"go/parser"
	"go/token"
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
)

// root is the repository, two directories up from this package.
const root = "../.."

// knownLogKeyExceptions are keys in use that the table does not list,
// each with the name to use instead: room for code being rewritten to
// keep an old key for a while, so that the test holds everywhere else.
// Empty: every key in the tree is in the table.
var knownLogKeyExceptions = map[string]string{}

// logKeys reads the attribute names of CONTRIBUTING.md's table of log
// attributes: every `name` in the first cell of its rows.
func logKeys(t *testing.T) map[string]bool {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(root, "CONTRIBUTING.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(b), "\n### Logs and metrics\n")
	if !ok {
		t.Fatal(`CONTRIBUTING.md has no "### Logs and metrics" section`)
	}
	section, _, _ = strings.Cut(section, "\n#")
	name := regexp.MustCompile("`([a-z][a-z0-9_]*)`")
	keys := map[string]bool{}
	for _, line := range strings.Split(section, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) < 3 || strings.TrimSpace(cells[0]) != "" {
			continue
		}
		for _, m := range name.FindAllStringSubmatch(cells[1], -1) {
			keys[m[1]] = true
		}
	}
	if len(keys) < 20 {
		t.Fatalf("only %d attributes found in CONTRIBUTING.md's table", len(keys))
	}
	return keys
}

// TestLogAttributes: every slog attribute key in the repository's code is
// one of CONTRIBUTING.md's, so that one concept has one name in every
// component's logs (err, never error; retry_in wherever a retry waits).
func TestLogAttributes(t *testing.T) {
	keys := logKeys(t)
	for k, why := range knownLogKeyExceptions {
		if keys[k] {
			t.Errorf("%q is in CONTRIBUTING.md's table and in the exceptions (%s): remove the exception", k, why)
		}
	}
	used := map[string]bool{}
	fset := token.NewFileSet()
	err := filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && path != root && (strings.HasPrefix(d.Name(), ".") || d.Name() == "testdata" || d.Name() == "var") {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(path, ".go") || strings.HasSuffix(path, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(fset, path, nil, parser.SkipObjectResolution)
		if err != nil {
			return err
		}
		for _, k := range slogKeys(f, fset) {
			used[k.name] = true
			if !keys[k.name] && knownLogKeyExceptions[k.name] == "" {
				t.Errorf("%s: log attribute %q is not in CONTRIBUTING.md's table (\"Logs and metrics\"): use the listed name for its concept, or add a row", k.pos, k.name)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for k := range knownLogKeyExceptions {
		if !used[k] {
			t.Errorf("exception %q is no longer used: remove it", k)
		}
	}
}

type logKey struct {
	name string
	pos  token.Position
}

// slogKeys finds the literal attribute keys of f's log calls: the
// key-value arguments after the message of Debug, Info, Warn and Error
// (and their Context forms), those of With, and the first argument of
// slog's attribute constructors. It goes by shape, without types: a call
// named Error whose first argument is not a string (http.Error,
// status.Error) is not a log call.
func slogKeys(f *ast.File, fset *token.FileSet) []logKey {
	var out []logKey
	add := func(e ast.Expr) {
		if l, ok := e.(*ast.BasicLit); ok && l.Kind == token.STRING {
			s, _ := strconv.Unquote(l.Value)
			out = append(out, logKey{s, fset.Position(l.Pos())})
		}
	}
	ast.Inspect(f, func(n ast.Node) bool {
		c, ok := n.(*ast.CallExpr)
		if !ok {
			return true
		}
		sel, ok := c.Fun.(*ast.SelectorExpr)
		if !ok {
			return true
		}
		if isSlog(sel.X) {
			switch sel.Sel.Name {
			case "String", "Int", "Int64", "Uint64", "Float64", "Bool", "Time", "Duration", "Any", "Group":
				add(c.Args[0])
				return true
			}
		}
		args := c.Args
		switch sel.Sel.Name {
		case "DebugContext", "InfoContext", "WarnContext", "ErrorContext":
			if len(args) < 2 {
				return true
			}
			args = args[1:]
			fallthrough
		case "Debug", "Info", "Warn", "Error":
			if len(args) == 0 || !isString(args[0]) {
				return true
			}
			args = args[1:]
		case "With":
		default:
			return true
		}
		if c.Ellipsis.IsValid() {
			return true
		}
		for i := 0; i < len(args); i++ {
			// An attribute takes one argument, a key and its value two.
			if call, ok := args[i].(*ast.CallExpr); ok {
				if s, ok := call.Fun.(*ast.SelectorExpr); ok && isSlog(s.X) {
					continue
				}
			}
			add(args[i])
			i++
		}
		return true
	})
	return out
}

func isSlog(e ast.Expr) bool {
	id, ok := e.(*ast.Ident)
	return ok && id.Name == "slog"
}

func isString(e ast.Expr) bool {
	switch e := e.(type) {
	case *ast.BasicLit:
		return e.Kind == token.STRING
	case *ast.BinaryExpr:
		return isString(e.X) || isString(e.Y)
	}
	return false
}
