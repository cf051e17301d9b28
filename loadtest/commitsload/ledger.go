package commitsload

import (
	"bufio"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"os"
	"strconv"
	"strings"
)

// ack is one acknowledged put: what the oracle must find again.
type ack struct {
	world   uint16
	doc     uint32
	version uint64
	hash    uint64
}

// doubt is a put that failed without a clear refusal (a timeout, the
// edge unavailable): it may have been stored, so a version of its document
// that nobody acknowledged is explained rather than a fault.
type doubt struct {
	world uint16
	doc   uint32
	code  string
}

// ledger is every acknowledged put of one or more runs. Documents are
// numbers; their ids are idPrefix and the number zero-padded to idWidth.
type ledger struct {
	worlds   []string
	idPrefix string
	idWidth  int
	acks     []ack
	doubts   []doubt
}

func newLedger(worlds []string, idPrefix string, docs int) *ledger {
	return &ledger{worlds: worlds, idPrefix: idPrefix, idWidth: max(7, len(strconv.Itoa(docs-1)))}
}

func (l *ledger) id(doc uint32) string {
	return l.idPrefix + pad(strconv.FormatUint(uint64(doc), 10), l.idWidth)
}

func pad(s string, width int) string {
	if len(s) >= width {
		return s
	}
	return strings.Repeat("0", width-len(s)) + s
}

// docNum is the number of an id of this ledger's form.
func (l *ledger) docNum(id string) (uint32, bool) {
	rest, ok := strings.CutPrefix(id, l.idPrefix)
	if !ok || len(rest) < l.idWidth {
		return 0, false
	}
	n, err := strconv.ParseUint(rest, 10, 32)
	if err != nil || l.id(uint32(n)) != id {
		return 0, false
	}
	return uint32(n), true
}

func (l *ledger) worldIndex(name string) uint16 {
	for i, w := range l.worlds {
		if w == name {
			return uint16(i)
		}
	}
	l.worlds = append(l.worlds, name)
	return uint16(len(l.worlds) - 1)
}

// bodyHash is what the ledger keeps of a body: enough to tell two
// versions apart (every body starts with a number unique to its write).
func bodyHash(b []byte) uint64 {
	h := fnv.New64a()
	h.Write(b)
	return h.Sum64()
}

const ledgerMagic = "# millrace commitsload ledger 1"

// The file: a magic line, the id form ("I", the quoted prefix, the
// width), the worlds in the run's order ("W", the name), then one line per
// acknowledged put ("P", world, document
// number, version, body hash in hex) and per doubtful one ("U", world,
// document number, gRPC code), tab-separated (worlds hold no control
// characters).

// write saves l to path, or appends its records to the ledger there.
func (l *ledger) write(path string, appendTo bool) error {
	flags := os.O_CREATE | os.O_WRONLY | os.O_TRUNC
	header := true
	if appendTo {
		if old, err := readLedger(path); err == nil {
			if old.idPrefix != l.idPrefix || old.idWidth != l.idWidth {
				return fmt.Errorf("ledger %s holds ids %q with %d digits, this run writes %q with %d: use another file",
					path, old.idPrefix, old.idWidth, l.idPrefix, l.idWidth)
			}
			flags, header = os.O_WRONLY|os.O_APPEND, false
		} else if !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	f, err := os.OpenFile(path, flags, 0o644)
	if err != nil {
		return fmt.Errorf("ledger: %w", err)
	}
	w := bufio.NewWriterSize(f, 1<<20)
	if header {
		fmt.Fprintf(w, "%s\nI\t%s\t%d\n", ledgerMagic, strconv.Quote(l.idPrefix), l.idWidth)
	}
	for _, name := range l.worlds {
		fmt.Fprintf(w, "W\t%s\n", name)
	}
	buf := make([]byte, 0, 128)
	for _, a := range l.acks {
		buf = append(buf[:0], "P\t"...)
		buf = append(buf, l.worlds[a.world]...)
		buf = append(buf, '\t')
		buf = strconv.AppendUint(buf, uint64(a.doc), 10)
		buf = append(buf, '\t')
		buf = strconv.AppendUint(buf, a.version, 10)
		buf = append(buf, '\t')
		buf = strconv.AppendUint(buf, a.hash, 16)
		buf = append(buf, '\n')
		w.Write(buf)
	}
	for _, d := range l.doubts {
		fmt.Fprintf(w, "U\t%s\t%d\t%s\n", l.worlds[d.world], d.doc, d.code)
	}
	if err := w.Flush(); err != nil {
		f.Close()
		return fmt.Errorf("ledger %s: %w", path, err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("ledger %s: %w", path, err)
	}
	return nil
}

// readLedger loads a ledger file.
func readLedger(path string) (*ledger, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("ledger: %w", err)
	}
	defer f.Close()
	l, err := parseLedger(f)
	if err != nil {
		return nil, fmt.Errorf("ledger %s: %w", path, err)
	}
	return l, nil
}

func parseLedger(r io.Reader) (*ledger, error) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	l := &ledger{}
	line := 0
	bad := func(why string) error { return fmt.Errorf("line %d: %s", line, why) }
	for sc.Scan() {
		line++
		text := sc.Text()
		if line == 1 {
			if text != ledgerMagic {
				return nil, errors.New("not a commitsload ledger (its first line is not " + strconv.Quote(ledgerMagic) + ")")
			}
			continue
		}
		f := strings.Split(text, "\t")
		switch {
		case len(f) == 3 && f[0] == "I":
			p, err := strconv.Unquote(f[1])
			w, werr := strconv.Atoi(f[2])
			if err != nil || werr != nil || w < 1 {
				return nil, bad("malformed id form")
			}
			l.idPrefix, l.idWidth = p, w
		case len(f) == 2 && f[0] == "W":
			l.worldIndex(f[1])
		case len(f) == 5 && f[0] == "P":
			doc, e1 := strconv.ParseUint(f[2], 10, 32)
			v, e2 := strconv.ParseUint(f[3], 10, 64)
			h, e3 := strconv.ParseUint(f[4], 16, 64)
			if e1 != nil || e2 != nil || e3 != nil {
				return nil, bad("malformed put")
			}
			l.acks = append(l.acks, ack{world: l.worldIndex(f[1]), doc: uint32(doc), version: v, hash: h})
		case len(f) == 4 && f[0] == "U":
			doc, err := strconv.ParseUint(f[2], 10, 32)
			if err != nil {
				return nil, bad("malformed doubtful put")
			}
			l.doubts = append(l.doubts, doubt{world: l.worldIndex(f[1]), doc: uint32(doc), code: f[3]})
		case text == "" || strings.HasPrefix(text, "#"):
		default:
			return nil, bad("unknown record")
		}
	}
	if err := sc.Err(); err != nil {
		return nil, err
	}
	if line == 0 {
		return nil, errors.New("empty file")
	}
	if l.idWidth == 0 {
		return nil, errors.New("no id form (I line)")
	}
	return l, nil
}
