package console

import (
	"bytes"
	"html"
	"html/template"
	"strconv"
	"strings"
	"unicode/utf8"
)

// ANSI renders console output as Bazel printed it (with --color=yes: SGR
// escape sequences for bold, colours and their resets; with curses,
// cursor movements and line erases) as HTML: text escaped, each run of
// one style in a <span> whose classes name it (console.css draws them:
// a-b bold, a-d dim, a-i italic, a-u underline, a-fN and a-gN the
// foreground and background of the 16 colours, 0-15). Sequences other
// than SGR, and the SGR codes it does not draw (256 and true colours),
// are dropped rather than printed: what Bazel's curses output does to a
// terminal (move up, erase the line) has no place in a page of history.
// A page of output may begin or end inside a sequence or a UTF-8
// character; what cannot be decoded is dropped, and invalid UTF-8
// becomes U+FFFD, so whatever the bytes the result is well-formed HTML.
func ANSI(b []byte) template.HTML {
	var (
		out   strings.Builder
		st    style
		open  bool
		start = 0
	)
	out.Grow(len(b) + len(b)/8)
	flush := func(end int) {
		if end <= start {
			return
		}
		text := b[start:end]
		if !open && st != (style{}) {
			out.WriteString(`<span class="`)
			out.WriteString(st.classes())
			out.WriteString(`">`)
			open = true
		}
		writeText(&out, text)
	}
	setStyle := func(next style) {
		if next == st {
			return
		}
		if open {
			out.WriteString("</span>")
			open = false
		}
		st = next
	}
	for i := 0; i < len(b); {
		if b[i] != 0x1b {
			i++
			continue
		}
		flush(i)
		// ESC [ params intermediates final: a CSI sequence.
		j := i + 1
		if j < len(b) && b[j] == '[' {
			j++
			p := j
			for j < len(b) && b[j] >= 0x30 && b[j] <= 0x3f {
				j++
			}
			params := b[p:j]
			for j < len(b) && b[j] >= 0x20 && b[j] <= 0x2f {
				j++
			}
			if j < len(b) && b[j] >= 0x40 && b[j] <= 0x7e {
				if b[j] == 'm' {
					setStyle(st.apply(params))
				}
				j++
			}
		} else if j < len(b) && b[j] >= 0x40 && b[j] <= 0x5f {
			j++ // a two-byte escape (ESC c, ESC M, ...)
		}
		i, start = j, j
	}
	flush(len(b))
	if open {
		out.WriteString("</span>")
	}
	return template.HTML(out.String())
}

// writeText writes text escaped for HTML, invalid UTF-8 and control
// characters but tab and newline replaced (a carriage return ends a
// progress line that the next one overwrote: it is kept as a newline).
func writeText(out *strings.Builder, text []byte) {
	clean := make([]byte, 0, len(text))
	for len(text) > 0 {
		r, n := utf8.DecodeRune(text)
		switch {
		case r == utf8.RuneError && n <= 1:
			clean = utf8.AppendRune(clean, utf8.RuneError)
		case r == '\r':
			if len(text) < 2 || text[1] != '\n' {
				clean = append(clean, '\n')
			}
		case r < 0x20 && r != '\t' && r != '\n', r == 0x7f:
		default:
			clean = append(clean, text[:n]...)
		}
		text = text[n:]
	}
	out.WriteString(html.EscapeString(string(clean)))
}

// style is the SGR state a run of text is drawn in. fg and bg are a
// colour 0-15 plus one (0: the default).
type style struct {
	bold, dim, italic, underline bool
	fg, bg                       uint8
}

// apply returns s after the SGR parameters (";"-separated numbers; none
// is 0, the reset).
func (s style) apply(params []byte) style {
	if len(params) == 0 {
		return style{}
	}
	codes := bytes.Split(params, []byte{';'})
	for k := 0; k < len(codes); k++ {
		n, err := strconv.Atoi(string(codes[k]))
		if len(codes[k]) == 0 {
			n, err = 0, nil
		}
		if err != nil {
			continue
		}
		switch {
		case n == 0:
			s = style{}
		case n == 1:
			s.bold = true
		case n == 2:
			s.dim = true
		case n == 3:
			s.italic = true
		case n == 4:
			s.underline = true
		case n == 22:
			s.bold, s.dim = false, false
		case n == 23:
			s.italic = false
		case n == 24:
			s.underline = false
		case n >= 30 && n <= 37:
			s.fg = uint8(n-30) + 1
		case n == 39:
			s.fg = 0
		case n >= 40 && n <= 47:
			s.bg = uint8(n-40) + 1
		case n == 49:
			s.bg = 0
		case n >= 90 && n <= 97:
			s.fg = uint8(n-90) + 9
		case n >= 100 && n <= 107:
			s.bg = uint8(n-100) + 9
		case n == 38 || n == 48:
			// 38;5;N or 38;2;R;G;B: colours it does not draw; skip their
			// arguments so that they are not read as codes.
			if k+1 < len(codes) && string(codes[k+1]) == "5" {
				k += 2
			} else if k+1 < len(codes) && string(codes[k+1]) == "2" {
				k += 4
			}
		}
	}
	return s
}

func (s style) classes() string {
	var c []string
	for _, f := range []struct {
		on   bool
		name string
	}{{s.bold, "a-b"}, {s.dim, "a-d"}, {s.italic, "a-i"}, {s.underline, "a-u"}} {
		if f.on {
			c = append(c, f.name)
		}
	}
	if s.fg > 0 {
		c = append(c, "a-f"+strconv.Itoa(int(s.fg-1)))
	}
	if s.bg > 0 {
		c = append(c, "a-g"+strconv.Itoa(int(s.bg-1)))
	}
	return strings.Join(c, " ")
}
