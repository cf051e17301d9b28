// Package apikey is the one table of secrets a server checks its callers
// against: the API keys of the BES edge, the reservations API and the
// commit log, the fleet's join tokens, the console's keys and the metrics
// tokens. A service says what a key acts for, its principal (a project;
// an owner and its pools; a world; a pool; nothing at all), and how the
// name in front of a key spells it; the table does the rest the same way
// for every one of them:
//
//   - A key is kept only as its SHA-256 digest, and Lookup compares the
//     digest of what it is given with every entry in constant time, so
//     the time a lookup takes says nothing about which entry matched, or
//     how much of one.
//   - Replace swaps the whole table at once, which is how a key file is
//     reloaded while the server runs (internal/keyfile): a request sees
//     the old keys or the new ones, never a mix, and a removed key is
//     refused from the next request on. Lookups take no lock.
//
// # Syntax
//
// A table is entries separated by commas or newlines, each
//
//	name=key
//
// where the key is everything after the first '=' (so a key may contain
// '=') and both are trimmed of surrounding spaces; what the name may be is
// the service's to say. Blank entries are skipped. A line whose first
// character other than a space is '#' is a comment, whatever follows; an
// entry that starts with '#' is skipped too, so "a=KEY, # b=OLDKEY" holds
// one key.
//
// A table of bare keys (Syntax.Principal nil: metrics tokens) has one key
// a line and nothing else on it, so such a key may contain ',' and '='.
// A Bare syntax (the console's keys) takes both: an entry without '=' is a
// key alone, so such a key may not contain '='.
//
// Keys are at least MinKeyBytes long, and each is given once: the same key
// twice is an error whatever it acts for, since a key that acted for two
// principals would act for whichever came last. An error names the line
// (counted from 1) and the name in front of the key, never the key.
package apikey

import (
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
)

// MinKeyBytes is the shortest key accepted: a short one could be guessed.
const MinKeyBytes = 16

// What is wrong with a key, as Parse's errors wrap it (errors.Is).
var (
	ErrShort = fmt.Errorf("shorter than %d characters", MinKeyBytes)
	ErrTwice = errors.New("given twice")
)

// Table maps keys to the principal P each acts for. The zero value is
// empty and ready; a nil *Table is empty.
type Table[P any] struct {
	list atomic.Pointer[[]entry[P]] // replaced whole, never changed in place
}

type entry[P any] struct {
	digest    [32]byte
	principal P
}

func (t *Table[P]) entries() []entry[P] {
	if t == nil {
		return nil
	}
	if p := t.list.Load(); p != nil {
		return *p
	}
	return nil
}

// Len is the number of keys.
func (t *Table[P]) Len() int { return len(t.entries()) }

// Lookup returns what key acts for. Every entry is compared, in constant
// time, whether or not an earlier one matched.
func (t *Table[P]) Lookup(key string) (P, bool) {
	var p P
	if key == "" {
		return p, false
	}
	d := sha256.Sum256([]byte(key))
	found := false
	for _, e := range t.entries() {
		if subtle.ConstantTimeCompare(d[:], e.digest[:]) == 1 {
			p, found = e.principal, true
		}
	}
	return p, found
}

// Replace makes t hold exactly the keys of from (none if from is nil), at
// once. A request already holding the old list keeps it.
func (t *Table[P]) Replace(from *Table[P]) {
	n := slices.Clone(from.entries())
	t.list.Store(&n)
}

// Syntax is how one service writes its table.
type Syntax[P any] struct {
	// Package names the service's package in front of Parse's errors, as
	// in the package's own ("bes: line 2: ..."). Empty: no prefix.
	Package string
	// What a key is called, for errors: "API key", "join token".
	What string
	// Name is what the name in front of a key names, for errors:
	// "project", "owner".
	Name string
	// Form shows how an entry is written, for the error about one that is
	// not: "project=key".
	Form string
	// Principal reads a name (trimmed, never empty) into what its key acts
	// for; an error says what is wrong with the name, and Parse adds the
	// line. Nil: the table holds bare keys, one a line.
	Principal func(name string) (P, error)
	// Bare, with Principal, also takes a line that is a key alone (no
	// "=" in it) and reads its principal as Principal(""): the console's
	// operator keys beside its project=key read keys.
	Bare bool
}

// Parse reads text written in syntax s (see the package documentation).
func Parse[P any](text string, s Syntax[P]) (*Table[P], error) {
	t, err := s.parse(text)
	if err != nil && s.Package != "" {
		return nil, fmt.Errorf("%s: %w", s.Package, err)
	}
	return t, err
}

func (s Syntax[P]) parse(text string) (*Table[P], error) {
	raws, err := split(text, s.Principal == nil, s.Bare, s.What, s.Form)
	if err != nil {
		return nil, err
	}
	list := make([]entry[P], 0, len(raws))
	first := make(map[[32]byte]int, len(raws)) // digest -> line
	for _, r := range raws {
		d := sha256.Sum256([]byte(r.key))
		if err := s.check(r, d, first); err != nil {
			return nil, err
		}
		var p P
		if s.Principal != nil {
			if p, err = s.Principal(r.name); err != nil { // "" for a bare key of a Bare syntax
				return nil, fmt.Errorf("line %d: %w", r.line, err)
			}
		}
		first[d] = r.line
		list = append(list, entry[P]{digest: d, principal: p})
	}
	t := &Table[P]{}
	t.list.Store(&list)
	return t, nil
}

// check refuses a short key, or one given on an earlier line.
func (s Syntax[P]) check(r raw, digest [32]byte, first map[[32]byte]int) error {
	of := fmt.Sprintf("the %s", s.What)
	if s.Principal != nil && r.name != "" {
		of = fmt.Sprintf("the %s of %s %q", s.What, s.Name, r.name)
	}
	if len(r.key) < MinKeyBytes {
		return fmt.Errorf("line %d: %s is %w", r.line, of, ErrShort)
	}
	if l, ok := first[digest]; ok {
		return fmt.Errorf("line %d: %s is %w (first on line %d)", r.line, of, ErrTwice, l)
	}
	return nil
}

// raw is one entry as written.
type raw struct {
	line      int
	name, key string // name "" for a bare key
}

// split cuts text into entries: bare keys one a line, else name=key
// entries separated by commas or newlines (and, alsoBare, keys alone
// among them).
func split(text string, bare, alsoBare bool, what, form string) ([]raw, error) {
	var out []raw
	for i, line := range strings.Split(text, "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "#") {
			continue
		}
		fields := []string{line}
		if !bare {
			fields = strings.Split(line, ",")
		}
		for _, f := range fields {
			f = strings.TrimSpace(f)
			if f == "" || strings.HasPrefix(f, "#") {
				continue
			}
			if bare || (alsoBare && !strings.Contains(f, "=")) {
				out = append(out, raw{line: i + 1, key: f})
				continue
			}
			name, key, ok := strings.Cut(f, "=")
			name, key = strings.TrimSpace(name), strings.TrimSpace(key)
			if !ok || name == "" || key == "" {
				return nil, fmt.Errorf("line %d: %ss are written %s", i+1, what, form)
			}
			out = append(out, raw{line: i + 1, name: name, key: key})
		}
	}
	return out, nil
}
