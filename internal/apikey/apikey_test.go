package apikey

import (
	"errors"
	"fmt"
	"strings"
	"testing"
)

// named is a syntax whose principal is the name itself, refusing "bad".
var named = Syntax[string]{
	What: "API key", Name: "project", Form: "project=key",
	Principal: func(name string) (string, error) {
		if name == "bad" {
			return "", errors.New(`"bad" is not a project`)
		}
		return name, nil
	},
}

var bare = Syntax[struct{}]{What: "metrics token"}

const (
	k1 = "key-one-0123456789"
	k2 = "key-two-0123456789"
	k3 = "key-three-0123456789"
)

func TestParseNamed(t *testing.T) {
	for _, c := range []struct {
		name, text string
		want       map[string]string // key -> principal
	}{
		{"empty", "", map[string]string{}},
		{"only blanks and comments", "\n  \n# a, b=" + k1 + "\n\t# c\n", map[string]string{}},
		{"commas", "a=" + k1 + ",b=" + k2, map[string]string{k1: "a", k2: "b"}},
		{"lines, CRLF and spaces", " a = " + k1 + " \r\n\r\nb=" + k2 + "\r\n", map[string]string{k1: "a", k2: "b"}},
		{"'=' in a key", "a=" + k1 + "==x", map[string]string{k1 + "==x": "a"}},
		{"blank entries", ",a=" + k1 + ",,\n,", map[string]string{k1: "a"}},
		{"an entry commented out", "a=" + k1 + ", # b=" + k2 + ", c=" + k3, map[string]string{k1: "a", k3: "c"}},
		{"a name with several keys", "a=" + k1 + "\na=" + k2, map[string]string{k1: "a", k2: "a"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			tab, err := Parse(c.text, named)
			if err != nil {
				t.Fatal(err)
			}
			if tab.Len() != len(c.want) {
				t.Errorf("%d keys, want %d", tab.Len(), len(c.want))
			}
			for key, want := range c.want {
				if got, ok := tab.Lookup(key); !ok || got != want {
					t.Errorf("Lookup(%q) = %q, %v; want %q", key, got, ok, want)
				}
			}
			for _, key := range []string{"", "nope-nope-nope-nope", "b=" + k2} {
				if _, ok := c.want[key]; !ok {
					if _, ok := tab.Lookup(key); ok {
						t.Errorf("Lookup(%q) found a key never given", key)
					}
				}
			}
		})
	}
}

func TestParseErrorsNameTheLineNeverTheKey(t *testing.T) {
	for _, c := range []struct {
		text, want string
		is         error
	}{
		{"a=" + k1 + "\n" + k2, "line 2: API keys are written project=key", nil},
		{"\n\n=" + k1, "line 3: API keys are written project=key", nil},
		{"a=", "line 1: API keys are written project=key", nil},
		{"a=" + k1 + ", b=tiny-key", `line 1: the API key of project "b" is shorter than 16 characters`, ErrShort},
		{"a=" + k1 + "\n# c\nb=" + k1, `line 3: the API key of project "b" is given twice (first on line 1)`, ErrTwice},
		{"a=" + k1 + ",a=" + k1, `line 1: the API key of project "a" is given twice (first on line 1)`, ErrTwice},
		{"a=" + k1 + "\nbad=" + k2, `line 2: "bad" is not a project`, nil},
	} {
		_, err := Parse(c.text, named)
		if err == nil || err.Error() != c.want {
			t.Errorf("Parse(%q) = %v, want %q", c.text, err, c.want)
			continue
		}
		if c.is != nil && !errors.Is(err, c.is) {
			t.Errorf("Parse(%q): %v is not %v", c.text, err, c.is)
		}
		for _, key := range []string{k1, k2, "tiny-key"} {
			if strings.Contains(err.Error(), key) {
				t.Errorf("Parse(%q): the error %q shows a key", c.text, err)
			}
		}
	}
}

// A service's syntax names its package in front of every error.
func TestParseErrorsNameThePackage(t *testing.T) {
	s := named
	s.Package = "bes"
	for text, want := range map[string]string{
		"a=":                       "bes: line 1: API keys are written project=key",
		"a=" + k1 + "\nb=tiny-key": `bes: line 2: the API key of project "b" is shorter than 16 characters`,
		"bad=" + k1:                `bes: line 1: "bad" is not a project`,
	} {
		if _, err := Parse(text, s); err == nil || err.Error() != want {
			t.Errorf("Parse(%q) = %v, want %q", text, err, want)
		}
	}
	if _, err := Parse("a=tiny-key", s); !errors.Is(err, ErrShort) {
		t.Errorf("the prefixed error %v is not ErrShort", err)
	}
	if tab, err := Parse("a="+k1, s); err != nil || tab.Len() != 1 {
		t.Errorf("a valid table with a package: %v", err)
	}
}

func TestParseBare(t *testing.T) {
	tab, err := Parse("# tokens\n "+k1+" \n\n"+"a,b=c,d-0123456789\n", bare)
	if err != nil {
		t.Fatal(err)
	}
	if tab.Len() != 2 {
		t.Fatalf("%d keys", tab.Len())
	}
	for _, key := range []string{k1, "a,b=c,d-0123456789"} {
		if _, ok := tab.Lookup(key); !ok {
			t.Errorf("%q not found", key)
		}
	}
	if _, ok := tab.Lookup("a"); ok {
		t.Error("a bare key was split at a comma")
	}
	for text, want := range map[string]string{
		k1 + "\nshort":   "line 2: the metrics token is shorter than 16 characters",
		k1 + "\n\n" + k1: "line 3: the metrics token is given twice (first on line 1)",
	} {
		if _, err := Parse(text, bare); err == nil || err.Error() != want {
			t.Errorf("Parse(%q) = %v, want %q", text, err, want)
		}
	}
}

// A Bare syntax takes keys alone (principal "") among name=key entries.
func TestParseBareAmongNamed(t *testing.T) {
	both := named
	both.Bare = true
	tab, err := Parse(k1+"\nacme="+k2+", "+k3+"\n", both)
	if err != nil {
		t.Fatal(err)
	}
	for key, want := range map[string]string{k1: "", k2: "acme", k3: ""} {
		if p, ok := tab.Lookup(key); !ok || p != want {
			t.Errorf("%q: %q %v, want %q", key, p, ok, want)
		}
	}
	if _, err := Parse(k1+"\n"+k1, both); err == nil || err.Error() != "line 2: the API key is given twice (first on line 1)" {
		t.Errorf("a bare key twice: %v", err)
	}
	if _, err := Parse(k1, named); err == nil || !strings.Contains(err.Error(), "written project=key") {
		t.Errorf("a bare key without Bare: %v", err)
	}
}

func TestReplace(t *testing.T) {
	var live Table[string] // the zero value, as a server starts with
	if live.Len() != 0 {
		t.Fatal("zero table not empty")
	}
	first, _ := Parse("a="+k1+",b="+k2, named)
	live.Replace(first)
	held := live.entries() // a request in flight
	second, _ := Parse("c="+k3, named)
	live.Replace(second)
	if _, ok := live.Lookup(k1); ok {
		t.Error("a removed key is still accepted")
	}
	if p, ok := live.Lookup(k3); !ok || p != "c" || live.Len() != 1 {
		t.Errorf("after Replace: %q %v, %d keys", p, ok, live.Len())
	}
	if len(held) != 2 {
		t.Error("Replace changed the list a request held")
	}
	live.Replace(nil)
	if live.Len() != 0 {
		t.Error("Replace(nil) left keys")
	}
	var none *Table[string]
	if _, ok := none.Lookup(k1); ok || none.Len() != 0 {
		t.Error("nil table not empty")
	}
}

// Lookups run while a reload replaces the table: each sees one table or
// the other (the race detector watches the rest).
func TestReplaceWhileLookingUp(t *testing.T) {
	a, _ := Parse("a="+k1, named)
	b, _ := Parse("b="+k1, named)
	var live Table[string]
	live.Replace(a)
	done := make(chan struct{})
	go func() {
		defer close(done)
		for i := range 1000 {
			live.Replace([]*Table[string]{a, b}[i%2])
		}
	}()
	for {
		select {
		case <-done:
			return
		default:
		}
		if p, ok := live.Lookup(k1); !ok || (p != "a" && p != "b") {
			t.Fatalf("Lookup during Replace: %q %v", p, ok)
		}
	}
}

// FuzzParse: Parse never panics, and whatever it accepts, written out again
// an entry a line, parses to a table that finds every key where the first
// one did.
func FuzzParse(f *testing.F) {
	for _, s := range []string{
		"", "a=" + k1, "a=" + k1 + ",b=" + k2, "# c\n a = " + k1 + "==\r\n", "a=" + k1 + ", #b=" + k2,
		"owner:a100|h100=" + k1, "*=" + k1 + "\nw1=" + k2, "a=short", "a=" + k1 + ",b=" + k1, "=", ",,\n,", "bad=" + k1,
	} {
		f.Add(s, false)
		f.Add(s, true)
	}
	f.Fuzz(func(t *testing.T, text string, isBare bool) {
		if isBare {
			roundTrip(t, text, bare)
		} else {
			roundTrip(t, text, named)
		}
	})
}

func roundTrip[P comparable](t *testing.T, text string, s Syntax[P]) {
	tab, err := Parse(text, s)
	if err != nil {
		return
	}
	raws, err := split(text, s.Principal == nil, s.Bare, s.What, s.Form)
	if err != nil || len(raws) != tab.Len() {
		t.Fatalf("Parse accepted %d keys, split says %d (%v)", tab.Len(), len(raws), err)
	}
	var again strings.Builder
	for _, r := range raws {
		if r.name != "" {
			again.WriteString(r.name + "=")
		}
		fmt.Fprintln(&again, r.key)
	}
	tab2, err := Parse(again.String(), s)
	if err != nil || tab2.Len() != tab.Len() {
		t.Fatalf("written out again as %q: %v, %d keys", again.String(), err, tab2.Len())
	}
	for _, r := range raws {
		p, ok := tab.Lookup(r.key)
		p2, ok2 := tab2.Lookup(r.key)
		if !ok || !ok2 || p != p2 {
			t.Fatalf("key of line %d: %v %v, %v %v", r.line, p, ok, p2, ok2)
		}
		if s.Principal != nil {
			if want, _ := s.Principal(r.name); p != want {
				t.Fatalf("key of line %d acts for %v, want %v", r.line, p, want)
			}
		}
	}
}
