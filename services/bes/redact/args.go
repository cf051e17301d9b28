package redact

import (
	"strings"
)

// flagClass says how a flag's value is redacted.
type flagClass uint8

const (
	flagPlain    flagClass = iota // scanned as text
	flagHeader                    // NAME=VALUE: VALUE always goes
	flagEnv                       // NAME=VALUE: VALUE goes unless NAME is allowed; NAME alone stays
	flagOverride                  // --default_override=N:command=OPTION: OPTION is an argument
	flagSecret                    // the whole value goes (--project_id: Bazel 4 sends the edge's API key in it)
)

// classify names the class of a flag, given without its dashes: as a
// string, or as the bytes of an event, which it reads without converting
// (and allocating) them.
func classify[T string | []byte](name T) flagClass {
	switch string(name) {
	case "action_env", "host_action_env", "test_env", "repo_env", "client_env", "build_metadata":
		return flagEnv
	case "default_override":
		return flagOverride
	case "project_id":
		return flagSecret
	}
	const header = "_header" // remote_header, bes_header, remote_cache_header, remote_exec_header, remote_downloader_header
	if len(name) >= len(header) && string(name[len(name)-len(header):]) == header {
		return flagHeader
	}
	return flagPlain
}

// value redacts the value of a flag of class c.
func (r *Redactor) value(c flagClass, v string) string {
	switch c {
	case flagSecret:
		if v == "" {
			return v
		}
		return Marker
	case flagHeader:
		if name, _, ok := strings.Cut(v, "="); ok {
			return name + "=" + Marker
		}
		if v == "" {
			return v
		}
		return Marker
	case flagEnv:
		return r.assignment(v)
	case flagOverride:
		// N:command=OPTION
		prefix, opt, ok := strings.Cut(v, "=")
		if !ok {
			return r.Text(v)
		}
		var st argState
		return prefix + "=" + r.arg(opt, &st)
	}
	return r.Text(v)
}

// assignment redacts NAME=VALUE unless NAME is allowed; NAME alone (take
// the client's value) and NAME= (empty) hide nothing.
func (r *Redactor) assignment(v string) string {
	name, val, ok := strings.Cut(v, "=")
	if !ok || val == "" {
		return v
	}
	if r.allowed(name) {
		return name + "=" + r.Text(val)
	}
	return name + "=" + Marker
}

// argState carries a flag given without '=' over to the next argument,
// which is then its value (--remote_header NAME=VALUE).
type argState struct {
	pending flagClass
	has     bool
}

// arg redacts one argument of a command line.
func (r *Redactor) arg(a string, st *argState) string {
	if st.has {
		st.has = false
		return r.value(st.pending, a)
	}
	if len(a) < 3 || a[0] != '-' || a[1] != '-' {
		return r.Text(a)
	}
	name, v, ok := strings.Cut(a[2:], "=")
	c := classify(name)
	if !ok {
		if c != flagPlain {
			st.pending, st.has = c, true
		}
		return r.Text(a)
	}
	if c == flagPlain {
		return r.Text(a)
	}
	nv := r.value(c, v)
	if nv == v {
		return a
	}
	return "--" + name + "=" + nv
}

// Arg redacts one command-line argument on its own (--remote_header=...,
// --action_env=NAME=VALUE, or any text).
func (r *Redactor) Arg(a string) string {
	var st argState
	return r.arg(a, &st)
}

// argCandidate reports whether arg could change: a flag with '=' or a
// sensitive flag without it, or text with an anchor. It lets unchanged
// arguments of a command line skip the string work.
func (r *Redactor) argCandidate(b []byte, st *argState) bool {
	if st.has {
		return true
	}
	if len(b) >= 3 && b[0] == '-' && b[1] == '-' {
		end := len(b)
		for i := 2; i < len(b); i++ {
			if b[i] == '=' {
				end = i
				break
			}
		}
		if classify(b[2:end]) != flagPlain {
			return true
		}
	}
	return r.scan(b) != 0
}
