package redact

import (
	"strings"

	"google.golang.org/protobuf/encoding/protowire"
)

// BuildEvent redacts an encoded build_event_stream.BuildEvent (the value of
// a BES bazel_event). It returns b itself and false when nothing changed,
// and never fails: bytes that do not parse where a message is expected are
// left as they are (the edge refuses a malformed event before this runs).
// Fields it does not describe, known or not, keep their bytes and order.
func (r *Redactor) BuildEvent(b []byte) ([]byte, bool) {
	return r.walk(b, buildEvent)
}

// rewriter copies a message lazily: nothing until the first field that
// changes, then each unchanged run of fields in one append.
type rewriter struct {
	src   []byte
	out   []byte
	last  int // src[:last] is in out
	dirty bool
}

// replace puts field num with value v where src[start:end] was.
func (w *rewriter) replace(start, end int, num protowire.Number, v []byte) {
	if !w.dirty {
		w.out = make([]byte, 0, len(w.src)+len(v))
		w.dirty = true
	}
	w.out = append(w.out, w.src[w.last:start]...)
	w.out = protowire.AppendTag(w.out, num, protowire.BytesType)
	w.out = protowire.AppendBytes(w.out, v)
	w.last = end
}

func (w *rewriter) finish() ([]byte, bool) {
	if !w.dirty {
		return w.src, false
	}
	return append(w.out, w.src[w.last:]...), true
}

// lenField is one length-delimited field of a message.
type lenField struct {
	num        protowire.Number
	start, end int    // the whole field, tag included
	v          []byte // its value
}

// eachLen calls fn for each length-delimited field of b, in order, and
// reports whether b parsed as a message.
func eachLen(b []byte, fn func(f lenField)) bool {
	for i := 0; ; {
		f, found, ok := nextLen(b, i)
		if !found {
			return ok
		}
		fn(f)
		i = f.end
	}
}

// nextLen returns the first length-delimited field of b at or after
// offset i, skipping fields of other types. found is false at the end of
// b, and ok false (with found false) when b does not parse from i. It is
// the one scan of a message's fields: the walks on the per-event path
// loop over it themselves, since a closure (eachLen) would cost them an
// allocation per message.
func nextLen(b []byte, i int) (f lenField, found, ok bool) {
	for i < len(b) {
		num, typ, n := protowire.ConsumeTag(b[i:])
		if n < 0 {
			return f, false, false
		}
		if typ != protowire.BytesType {
			m := protowire.ConsumeFieldValue(num, typ, b[i+n:])
			if m < 0 {
				return f, false, false
			}
			i += n + m
			continue
		}
		v, m := protowire.ConsumeBytes(b[i+n:])
		if m < 0 {
			return f, false, false
		}
		return lenField{num: num, start: i, end: i + n + m, v: v}, true, true
	}
	return f, false, true
}

// parses reports whether b is a well-formed message, so that a rewrite is
// only ever made of a message that parsed to its end.
func parses(b []byte) bool { return eachLen(b, func(lenField) {}) }

func (r *Redactor) walk(b []byte, d *desc) ([]byte, bool) {
	// A loop over nextLen rather than eachLen: this is the path every
	// event takes, and a closure would cost an allocation per message.
	w := rewriter{src: b}
	var st argState
	for i := 0; ; {
		f, found, ok := nextLen(b, i)
		if !ok {
			return b, false
		}
		if !found {
			return w.finish()
		}
		i = f.end
		fd := d.field(int(f.num))
		if fd.kind == kSkip {
			continue
		}
		if nv, ok := r.fieldValue(f.v, fd, &st); ok {
			w.replace(f.start, f.end, f.num, nv)
		}
	}
}

// fieldValue redacts one field's value; st is the argument state of the
// enclosing message (the repeated args of one command line).
func (r *Redactor) fieldValue(v []byte, fd field, st *argState) ([]byte, bool) {
	switch fd.kind {
	case kMsg:
		return r.walk(v, fd.sub)
	case kText:
		return r.TextBytes(v)
	case kArg:
		if !r.argCandidate(v, st) {
			return v, false
		}
		return changed(v, r.arg(string(v), st))
	case kShellArgs:
		if !r.shellCandidate(v) {
			return v, false
		}
		return changed(v, r.ShellArgs(string(v)))
	case kOption:
		return r.option(v)
	case kPolicy:
		return r.policy(v)
	case kSecretKV, kStatusKV, kTextKV:
		return r.keyValue(v, fd.kind)
	}
	return v, false
}

func changed(old []byte, s string) ([]byte, bool) {
	if string(old) == s {
		return old, false
	}
	return []byte(s), true
}

// shellCandidate: a sensitive flag appears in the words, or an anchor.
func (r *Redactor) shellCandidate(b []byte) bool {
	return r.scan(b) != 0 // "--" is an anchor of the text scan
}

// stringField returns the last value of string field num of message b
// (proto3: the last one wins).
func stringField(b []byte, num protowire.Number) string {
	var s []byte
	eachLen(b, func(f lenField) {
		if f.num == num {
			s = f.v
		}
	})
	return string(s)
}

// option redacts a command_line.Option: combined_form (1) as an argument,
// option_value (3) as the value of option_name (2). One explicit pass finds
// the three: a canonical command line holds a hundred options or more.
func (r *Redactor) option(b []byte) ([]byte, bool) {
	var name, combined, value []byte
	var cStart, cEnd, vStart, vEnd int
	for i := 0; ; {
		f, found, ok := nextLen(b, i)
		if !ok {
			return b, false
		}
		if !found {
			break
		}
		switch f.num {
		case 1:
			combined, cStart, cEnd = f.v, f.start, f.end
		case 2:
			name = f.v
		case 3:
			value, vStart, vEnd = f.v, f.start, f.end
		}
		i = f.end
	}
	class := classify(name)
	if class == flagPlain && r.scan(combined) == 0 && r.scan(value) == 0 {
		return b, false
	}
	var nc, nv []byte
	var cch, vch bool
	if combined != nil {
		nc, cch = changed(combined, r.combinedForm(string(combined)))
	}
	if value != nil {
		nv, vch = changed(value, r.value(class, string(value)))
	}
	if !cch && !vch {
		return b, false
	}
	// Rewrite in field order (proto3: the last occurrence of each counts;
	// those are the ones found above).
	w := rewriter{src: b}
	if cch && (!vch || cStart < vStart) {
		w.replace(cStart, cEnd, 1, nc)
		cch = false
	}
	if vch {
		w.replace(vStart, vEnd, 3, nv)
	}
	if cch {
		w.replace(cStart, cEnd, 1, nc)
	}
	return w.finish()
}

// combinedForm redacts an option as Bazel prints it: --name=value, or
// --name value when it was given as two words.
func (r *Redactor) combinedForm(s string) string {
	if strings.HasPrefix(s, "--") && !strings.Contains(s, "=") {
		if name, v, ok := strings.Cut(s[2:], " "); ok {
			if c := classify(name); c != flagPlain {
				return "--" + name + " " + r.value(c, v)
			}
		}
	}
	return r.Arg(s)
}

// policy redacts a FlagPolicy: the values (1) and replacement (3) of its
// set_value (3), disallow_values (5) and allow_values (6) by flag_name (1).
func (r *Redactor) policy(b []byte) ([]byte, bool) {
	if !parses(b) {
		return b, false
	}
	class := classify(stringField(b, 1))
	w := rewriter{src: b}
	eachLen(b, func(f lenField) {
		if f.num != 3 && f.num != 5 && f.num != 6 || !parses(f.v) {
			return
		}
		inner := rewriter{src: f.v}
		eachLen(f.v, func(g lenField) {
			if g.num != 1 && g.num != 3 {
				return
			}
			if class == flagPlain && r.scan(g.v) == 0 {
				return
			}
			if nv, ok := changed(g.v, r.value(class, string(g.v))); ok {
				inner.replace(g.start, g.end, g.num, nv)
			}
		})
		if nv, ok := inner.finish(); ok {
			w.replace(f.start, f.end, f.num, nv)
		}
	})
	return w.finish()
}

// secretKey reports whether a workspace status key names a secret.
func secretKey(k string) bool {
	k = strings.ToUpper(k)
	for _, s := range []string{"SECRET", "TOKEN", "PASSWORD", "PASSWD", "CREDENTIAL", "API_KEY", "APIKEY", "PRIVATE", "AUTH"} {
		if strings.Contains(k, s) {
			return true
		}
	}
	return false
}

// keyValue redacts the value (2) of a key (1) / value pair.
func (r *Redactor) keyValue(b []byte, k kind) ([]byte, bool) {
	if !parses(b) {
		return b, false
	}
	key := stringField(b, 1)
	w := rewriter{src: b}
	eachLen(b, func(f lenField) {
		switch f.num {
		case 2:
			var s string
			switch {
			case len(f.v) == 0:
				return
			case k == kSecretKV && !r.allowed(key), k == kStatusKV && secretKey(key) && !r.allowed(key):
				s = Marker
			case r.scan(f.v) != 0:
				s = r.Text(string(f.v))
			default:
				return
			}
			if nv, ok := changed(f.v, s); ok {
				w.replace(f.start, f.end, f.num, nv)
			}
		}
	})
	return w.finish()
}
