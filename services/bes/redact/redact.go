package redact

import (
	"bytes"
	"fmt"
	"regexp"
	"strings"
)

// Marker replaces every secret. It matches none of the built-in patterns,
// which is what makes redaction idempotent.
const Marker = "<redacted>"

// DefaultAllow are the variable names whose values are kept by default:
// what every client environment holds and no one keeps a secret in
// (Bazel sends the whole client environment as --client_env=NAME=VALUE),
// and the --build_metadata keys that CI systems set to say which commit,
// branch and run a build is, which the builds projection indexes
// (projectors/builds, build_metadata): a build of a commit cannot be found
// by a value that was redacted. Their values are still scanned for token
// shapes and URL credentials (a REPO_URL with a token in it loses the token).
var DefaultAllow = []string{
	"PATH", "HOME", "PWD", "OLDPWD", "USER", "LOGNAME", "SHELL", "SHLVL", "TERM",
	"LANG", "LANGUAGE", "LC_*", "TZ", "TMPDIR", "HOSTNAME",
	"COMMIT_SHA", "BRANCH", "REPO_URL", "ROLE", "CI_RUN_URL",
}

// Config of a Redactor. The zero value redacts with the built-in rules and
// keeps no variable's value.
type Config struct {
	// Patterns are extra regular expressions (RE2 syntax); every match in
	// a command-line value or a text field becomes Marker. A pattern must
	// not match the empty string nor Marker itself.
	Patterns []string
	// Allow are variable names (of --action_env and the other environment
	// flags, --build_metadata keys, workspace status keys) whose values are
	// kept; they are still scanned for token shapes and URL credentials.
	// A trailing '*' matches any suffix ("LC_*").
	Allow []string
}

// Redactor applies one configuration. It is safe for concurrent use.
type Redactor struct {
	extra      []extraPattern
	allow      map[string]bool
	allowStart []string
}

type extraPattern struct {
	re     *regexp.Regexp
	prefix []byte // literal every match starts with, if any: a cheap anchor
}

// New checks cfg and makes a Redactor.
func New(cfg Config) (*Redactor, error) {
	r := &Redactor{allow: map[string]bool{}}
	for _, p := range cfg.Patterns {
		if p == "" {
			continue
		}
		re, err := regexp.Compile(p)
		if err != nil {
			return nil, fmt.Errorf("redact: pattern %q: %w", p, err)
		}
		if re.MatchString("") {
			return nil, fmt.Errorf("redact: pattern %q matches the empty string", p)
		}
		if re.MatchString(Marker) {
			return nil, fmt.Errorf("redact: pattern %q matches the marker %s (redacting twice would not be a no-op)", p, Marker)
		}
		lit, _ := re.LiteralPrefix()
		r.extra = append(r.extra, extraPattern{re: re, prefix: []byte(lit)})
	}
	for _, a := range cfg.Allow {
		a = strings.TrimSpace(a)
		switch {
		case a == "":
		case strings.HasSuffix(a, "*"):
			r.allowStart = append(r.allowStart, strings.TrimSuffix(a, "*"))
		default:
			r.allow[a] = true
		}
	}
	return r, nil
}

// MustNew is New for configurations known to be valid.
func MustNew(cfg Config) *Redactor {
	r, err := New(cfg)
	if err != nil {
		panic(err)
	}
	return r
}

func (r *Redactor) allowed(name string) bool {
	if r.allow[name] {
		return true
	}
	for _, p := range r.allowStart {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

// Text redacts free text (console output, a failure message, a projected
// column): token shapes, URL credentials, sensitive flags written out
// (--remote_header=..., --action_env=NAME=...) and the extra patterns. It
// returns s itself when nothing matched.
func (r *Redactor) Text(s string) string {
	m := r.scan([]byte(s))
	if m == 0 {
		return s
	}
	return r.text(s, m)
}

// TextBytes is Text for bytes: b itself when nothing matched.
func (r *Redactor) TextBytes(b []byte) ([]byte, bool) {
	m := r.scan(b)
	if m == 0 {
		return b, false
	}
	s := string(b)
	out := r.text(s, m)
	if out == s {
		return b, false
	}
	return []byte(out), true
}

// Rule families, as scan finds their anchors.
const (
	mToken uint8 = 1 << iota // gh?_, github_pat_, glpat-, xox?-, AKIA, ASIA, AIza, eyJ
	mURL                     // '@' after "://"
	mPEM                     // -----BEGIN
	mFlag                    // --flag, of a sensitive flag's name
	mExtra                   // an extra pattern's literal prefix, or one without
)

// anchorByte marks the first bytes of every built-in anchor.
var anchorByte = func() (t [256]bool) {
	for _, c := range "gxAe-:@" {
		t[c] = true
	}
	return t
}()

// scan returns the rule families that could match b. It is the cheap scan
// that lets nearly every string skip the regular expressions.
func (r *Redactor) scan(b []byte) uint8 {
	var m uint8
	scheme := false // "://" seen: an '@' after it may end URL credentials
	for i := 0; i < len(b); i++ {
		if !anchorByte[b[i]] {
			continue
		}
		rest := b[i:]
		switch b[i] {
		case 'g':
			if len(rest) > 4 && rest[1] == 'h' && rest[3] == '_' || bytes.HasPrefix(rest, []byte("github_pat_")) || isGitLabToken(rest) {
				m |= mToken
			}
		case 'x':
			if len(rest) > 4 && rest[1] == 'o' && rest[2] == 'x' && rest[4] == '-' {
				m |= mToken
			}
		case 'A':
			if bytes.HasPrefix(rest, []byte("AKIA")) || bytes.HasPrefix(rest, []byte("ASIA")) || bytes.HasPrefix(rest, []byte("AIza")) {
				m |= mToken
			}
		case 'e':
			if len(rest) > 3 && rest[1] == 'y' && rest[2] == 'J' {
				m |= mToken
			}
		case '-':
			if len(rest) > 2 && rest[1] == '-' {
				if rest[2] >= 'a' && rest[2] <= 'z' {
					j := 2
					for j < len(rest) && isNameByte(rest[j]) {
						j++
					}
					if classify(rest[2:j]) != flagPlain {
						m |= mFlag
					}
					i += j - 1
				} else if bytes.HasPrefix(rest, []byte(pemBegin)) {
					m |= mPEM
				}
			}
		case ':':
			if len(rest) > 2 && rest[1] == '/' && rest[2] == '/' {
				scheme = true
			}
		case '@':
			if scheme {
				m |= mURL
			}
		}
	}
	for _, p := range r.extra {
		if len(p.prefix) == 0 || bytes.Contains(b, p.prefix) {
			m |= mExtra
			break
		}
	}
	return m
}

// gitLabPrefixes are GitLab's token prefixes (personal, runner,
// deploy, pipeline trigger, feed, CI job, SCIM, agent, incoming mail,
// OAuth application secrets), each followed by '-'.
var gitLabPrefixes = [][]byte{[]byte("glpat-"), []byte("glrt-"), []byte("gldt-"), []byte("glptt-"), []byte("glft-"),
	[]byte("glcbt-"), []byte("glsoat-"), []byte("glagent-"), []byte("glimt-"), []byte("gloas-")}

func isGitLabToken(b []byte) bool {
	if len(b) < 5 || b[1] != 'l' {
		return false
	}
	for _, p := range gitLabPrefixes {
		if bytes.HasPrefix(b, p) {
			return true
		}
	}
	return false
}

// tokenRE matches the built-in token shapes. Each alternative needs one of
// the anchors scan looks for.
var tokenRE = regexp.MustCompile(`gh[pousr]_[A-Za-z0-9]{20,}` +
	`|github_pat_[A-Za-z0-9_]{20,}` +
	`|gl(?:pat|rt|dt|ptt|ft|cbt|soat|agent|imt|oas)-[A-Za-z0-9_-]{20,}` +
	`|xox[abprs]-[A-Za-z0-9-]{10,}` +
	`|(?:AKIA|ASIA)[A-Z0-9]{16}` +
	`|AIza[0-9A-Za-z_-]{35}` +
	`|eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]*`)

// urlCredRE matches the user information of a URL: scheme://user:token@.
// The user alone is redacted too: a token is often given as the user.
var urlCredRE = regexp.MustCompile(`([A-Za-z][A-Za-z0-9+.-]*://)[^/?#@\s'"]+@`)

func (r *Redactor) text(s string, m uint8) string {
	if m&mPEM != 0 {
		s = redactPEM(s)
	}
	if m&mToken != 0 && tokenRE.MatchString(s) {
		s = tokenRE.ReplaceAllLiteralString(s, Marker)
	}
	if m&mURL != 0 {
		s = urlCredRE.ReplaceAllString(s, "${1}"+Marker+"@")
	}
	if m&mFlag != 0 {
		s = r.flagsInText(s)
	}
	if m&mExtra != 0 {
		for _, p := range r.extra {
			s = replaceOutsideMarkers(s, p.re)
		}
	}
	return s
}

// replaceOutsideMarkers replaces re's matches by Marker, except those that
// touch a marker already there (so that a second pass changes nothing).
func replaceOutsideMarkers(s string, re *regexp.Regexp) string {
	matches := re.FindAllStringIndex(s, -1)
	if matches == nil {
		return s
	}
	var b strings.Builder
	last := 0
	for _, m := range matches {
		if overlapsMarker(s, m[0], m[1]) {
			continue
		}
		b.WriteString(s[last:m[0]])
		b.WriteString(Marker)
		last = m[1]
	}
	b.WriteString(s[last:])
	return b.String()
}

func overlapsMarker(s string, start, end int) bool {
	lo := max(0, start-len(Marker)+1)
	hi := min(len(s), end+len(Marker)-1)
	return strings.Contains(s[lo:hi], Marker)
}

const (
	pemBegin = "-----BEGIN "
	pemEnd   = "-----END "
	pemDash  = "-----"
)

// redactPEM replaces the body of every PEM private key block, keeping its
// BEGIN and END lines; a block with no END is redacted to the end of s.
func redactPEM(s string) string {
	if !strings.Contains(s, pemBegin) {
		return s
	}
	var b strings.Builder
	for {
		i := strings.Index(s, pemBegin)
		if i < 0 {
			break
		}
		// The header line: -----BEGIN <label>-----, a private key's label
		// ends in "PRIVATE KEY" (PGP: "PRIVATE KEY BLOCK").
		j := strings.Index(s[i+len(pemBegin):], pemDash)
		if j < 0 {
			break
		}
		headerEnd := i + len(pemBegin) + j + len(pemDash)
		label := s[i+len(pemBegin) : i+len(pemBegin)+j]
		b.WriteString(s[:headerEnd])
		s = s[headerEnd:]
		if !strings.HasSuffix(label, "PRIVATE KEY") && !strings.HasSuffix(label, "PRIVATE KEY BLOCK") {
			continue
		}
		k := strings.Index(s, pemEnd)
		if k < 0 {
			if s != "" {
				b.WriteString(Marker)
			}
			s = ""
			break
		}
		if s[:k] != "" {
			b.WriteString(Marker)
		}
		s = s[k:]
	}
	b.WriteString(s)
	return b.String()
}

// flagsInText redacts sensitive flags written into text, as Bazel's
// --announce_rc or an error message prints them: --NAME=VALUE, the value
// running to the next white space (or its closing quote).
func (r *Redactor) flagsInText(s string) string {
	var b strings.Builder
	last := 0
	for i := 0; i+2 < len(s); i++ {
		if s[i] != '-' || s[i+1] != '-' || (i > 0 && s[i-1] == '-') {
			continue
		}
		j := i + 2
		for j < len(s) && isNameByte(s[j]) {
			j++
		}
		if j >= len(s) || s[j] != '=' {
			continue
		}
		class := classify(s[i+2 : j])
		if class == flagPlain {
			continue
		}
		vstart := j + 1
		vend := valueEnd(s, vstart)
		if class == flagHeader && vend < len(s) && s[vend] == ' ' && authScheme(s[vstart:vend]) {
			// --remote_header=Authorization=Bearer TOKEN, unquoted: the
			// credential is the next word.
			vend = valueEnd(s, vend+1)
		}
		quoted := vend > vstart && (s[vstart] == '\'' || s[vstart] == '"') && s[vend-1] == s[vstart] && vend-vstart >= 2
		v := s[vstart:vend]
		if quoted {
			v = v[1 : len(v)-1]
		}
		nv := r.value(class, v)
		if nv == v {
			i = vend - 1
			continue
		}
		b.WriteString(s[last:vstart])
		if quoted {
			b.WriteByte(s[vstart])
			b.WriteString(nv)
			b.WriteByte(s[vstart])
		} else {
			b.WriteString(nv)
		}
		last = vend
		i = vend - 1
	}
	if last == 0 {
		return s
	}
	b.WriteString(s[last:])
	return b.String()
}

// valueEnd is where a flag value starting at i ends in text: at its
// closing quote if it opens with one, else at white space.
func valueEnd(s string, i int) int {
	if i < len(s) && (s[i] == '\'' || s[i] == '"') {
		if k := strings.IndexByte(s[i+1:], s[i]); k >= 0 {
			return i + 1 + k + 1
		}
	}
	for j := i; j < len(s); j++ {
		switch s[j] {
		case ' ', '\t', '\n', '\r':
			return j
		}
	}
	return len(s)
}

// authScheme reports whether a header value written NAME=WORD ends in an
// HTTP authentication scheme, whose credential follows after a space.
func authScheme(v string) bool {
	_, w, ok := strings.Cut(v, "=")
	if !ok {
		return false
	}
	switch strings.ToLower(w) {
	case "bearer", "basic", "token", "digest", "negotiate", "apikey":
		return true
	}
	return false
}

func isNameByte(c byte) bool { return c >= 'a' && c <= 'z' || c == '_' || c >= '0' && c <= '9' }
