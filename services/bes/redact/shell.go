package redact

import "strings"

// ShellArgs redacts a command line written as one string of shell words, as
// Bazel writes BuildStarted.options_description
// (--test_env='NAME=/a b' --remote_header='Authorization=Bearer X'). Each
// word is unquoted, redacted as an argument, and, if it changed, written
// back single-quoted; the words that did not change keep their bytes.
func (r *Redactor) ShellArgs(s string) string {
	var (
		b    strings.Builder
		st   argState
		last int
	)
	for i := 0; i < len(s); {
		if isSpace(s[i]) {
			i++
			continue
		}
		word, end := shellWord(s, i)
		nw := r.arg(word, &st)
		if nw != word {
			b.WriteString(s[last:i])
			b.WriteString(shellQuote(nw))
			last = end
		}
		i = end
	}
	if last == 0 {
		return s
	}
	b.WriteString(s[last:])
	return b.String()
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

// shellWord reads the word starting at i (POSIX quoting: '...' literal,
// "..." with \ escaping " \ $ `, \ outside quotes escaping anything) and
// returns it unquoted with the index after it. An unterminated quote runs
// to the end of s.
func shellWord(s string, i int) (string, int) {
	var w strings.Builder
	for i < len(s) && !isSpace(s[i]) {
		switch c := s[i]; c {
		case '\'':
			k := strings.IndexByte(s[i+1:], '\'')
			if k < 0 {
				w.WriteString(s[i+1:])
				return w.String(), len(s)
			}
			w.WriteString(s[i+1 : i+1+k])
			i += k + 2
		case '"':
			i++
			for i < len(s) && s[i] != '"' {
				if s[i] == '\\' && i+1 < len(s) && strings.IndexByte("\"\\$`", s[i+1]) >= 0 {
					i++
				}
				w.WriteByte(s[i])
				i++
			}
			i++ // the closing quote (or past the end)
		case '\\':
			if i+1 < len(s) {
				w.WriteByte(s[i+1])
			}
			i += 2
		default:
			w.WriteByte(c)
			i++
		}
	}
	return w.String(), min(i, len(s))
}

// shellQuote writes w as one shell word: bare if it needs no quoting,
// else single-quoted (an inner quote closes, escapes and reopens).
func shellQuote(w string) string {
	safe := w != ""
	for i := 0; i < len(w) && safe; i++ {
		c := w[i]
		safe = c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || strings.IndexByte("-_=./:,@%+", c) >= 0
	}
	if safe {
		return w
	}
	return "'" + strings.ReplaceAll(w, "'", `'\''`) + "'"
}
