package console

import (
	"encoding/xml"
	"strings"
	"testing"
)

func TestANSI(t *testing.T) {
	for _, c := range []struct{ in, want string }{
		{"plain <b>&</b>\n", "plain &lt;b&gt;&amp;&lt;/b&gt;\n"},
		{"\x1b[32mINFO:\x1b[0m Build completed", `<span class="a-f2">INFO:</span> Build completed`},
		{"\x1b[1m\x1b[31mERROR:\x1b[0m x", `<span class="a-b a-f1">ERROR:</span> x`},
		{"\x1b[1;91mbright\x1b[22m not bold\x1b[39m", `<span class="a-b a-f9">bright</span><span class="a-f9"> not bold</span>`},
		// curses: move up, erase the line; a progress line ended by \r.
		{"\x1b[1A\x1b[Kline\rnext\r\n", "line\nnext\n"},
		// 256 colours are dropped with their arguments, not read as codes.
		{"\x1b[38;5;1mx\x1b[0m", "x"},
		// a page cut inside a sequence or a character.
		{"tail\x1b[3", "tail"},
		{"\xe2\x82", "\uFFFD\uFFFD"},
		{"a\x00b\x07c", "abc"},
		{"\x1b[41mred bg", `<span class="a-g1">red bg</span>`},
	} {
		if got := string(ANSI([]byte(c.in))); got != c.want {
			t.Errorf("ANSI(%q) = %q, want %q", c.in, got, c.want)
		}
	}
}

// FuzzANSI: whatever bytes a build printed, the HTML is well-formed (its
// spans balanced, no markup of the input's own) and keeps the text.
func FuzzANSI(f *testing.F) {
	for _, s := range []string{"\x1b[1;31mERROR:\x1b[0m <x>", "\x1b[38;2;1;2;3m\x1b[", "a\rb\x1bc", "\xff\xfe"} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		out := string(ANSI(b))
		d := xml.NewDecoder(strings.NewReader("<pre>" + out + "</pre>"))
		d.Strict = true
		d.Entity = xml.HTMLEntity
		depth := 0
		for {
			tok, err := d.Token()
			if err != nil {
				if depth != 0 || err.Error() != "EOF" {
					t.Fatalf("ANSI(%q) = %q: not well-formed: %v", b, out, err)
				}
				return
			}
			switch e := tok.(type) {
			case xml.StartElement:
				if depth > 0 && e.Name.Local != "span" {
					t.Fatalf("ANSI(%q) = %q: element %s", b, out, e.Name.Local)
				}
				depth++
			case xml.EndElement:
				depth--
			}
		}
	})
}
