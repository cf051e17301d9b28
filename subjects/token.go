package subjects

import "strings"

// Token encodes s so that it is one safe subject token: letters, digits,
// '-' and '_' stay as they are, every other byte (including '.', '*', '>',
// spaces and '%') becomes %XX. The empty string becomes "_" so that no
// subject has an empty token. Token is reversible with Untoken.
func Token(s string) string {
	switch s {
	case "":
		return "_"
	case "_":
		return "%5F" // "_" alone stands for the empty string
	}
	if isPlain(s) {
		return s
	}
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	b.Grow(len(s) + 8)
	for i := 0; i < len(s); i++ {
		c := s[i]
		if plain(c) {
			b.WriteByte(c)
			continue
		}
		b.WriteByte('%')
		b.WriteByte(hex[c>>4])
		b.WriteByte(hex[c&15])
	}
	return b.String()
}

// Untoken reverses Token; ok is false when t is not the Token encoding of
// any string (including non-canonical escapes such as "%41" for "A", so
// that one id has exactly one subject).
func Untoken(t string) (s string, ok bool) {
	if t == "_" {
		return "", true
	}
	var b strings.Builder
	for i := 0; i < len(t); i++ {
		c := t[i]
		if c != '%' {
			b.WriteByte(c)
			continue
		}
		if i+2 >= len(t) {
			return "", false
		}
		hi, ok1 := unhex(t[i+1])
		lo, ok2 := unhex(t[i+2])
		if !ok1 || !ok2 {
			return "", false
		}
		b.WriteByte(hi<<4 | lo)
		i += 2
	}
	s = b.String()
	return s, Token(s) == t
}

func plain(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_'
}

func isPlain(s string) bool {
	for i := 0; i < len(s); i++ {
		if !plain(s[i]) {
			return false
		}
	}
	return s != "_"
}

func unhex(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	}
	return 0, false
}
