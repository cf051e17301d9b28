// Package envflag registers command-line flags whose defaults environment
// variables may set, for the load tools (fleetsim, commitsload): a flag
// -name reads $<Prefix><ENV> first, and says so in its help. A variable
// that does not parse is reported and ignored.
package envflag

import (
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// Set registers flags on FS; Prefix is put before every variable name and
// Who names the tool in warnings.
type Set struct {
	FS     *flag.FlagSet
	Prefix string
	Who    string
}

// lookup returns the variable's value when it is set and parses.
func lookup[T any](s Set, env, what string, parse func(string) (T, error)) (T, bool) {
	var zero T
	v, ok := os.LookupEnv(env)
	if !ok {
		return zero, false
	}
	x, err := parse(v)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: ignoring $%s=%q: not %s\n", s.Who, env, v, what)
		return zero, false
	}
	return x, true
}

func help(text, env string) string { return fmt.Sprintf("%s [$%s]", text, env) }

// String registers a string flag.
func (s Set) String(p *string, name, env, def, usage string) {
	Env(s.FS, p, name, s.Prefix+env, def, usage)
}

// Env registers a string flag read from env as it is (no prefix).
func Env(fs *flag.FlagSet, p *string, name, env, def, usage string) {
	if v, ok := os.LookupEnv(env); ok {
		def = v
	}
	fs.StringVar(p, name, def, help(usage, env))
}

// List registers a comma-separated list.
func (s Set) List(p *[]string, name, env, def, usage string) {
	env = s.Prefix + env
	if v, ok := os.LookupEnv(env); ok {
		def = v
	}
	*p = SplitList(def)
	s.FS.Func(name, fmt.Sprintf("%s (default %q) [$%s]", usage, def, env), func(v string) error {
		*p = SplitList(v)
		return nil
	})
}

// SplitList splits a comma-separated list, dropping empty items.
func SplitList(v string) []string {
	var out []string
	for _, f := range strings.Split(v, ",") {
		if f = strings.TrimSpace(f); f != "" {
			out = append(out, f)
		}
	}
	return out
}

// Bool registers a boolean flag, false unless the variable says otherwise.
func (s Set) Bool(p *bool, name, env, usage string) {
	env = s.Prefix + env
	def, _ := lookup(s, env, "true or false", strconv.ParseBool)
	s.FS.BoolVar(p, name, def, help(usage, env))
}

// Int registers an int flag.
func (s Set) Int(p *int, name, env string, def int, usage string) {
	env = s.Prefix + env
	if v, ok := lookup(s, env, "a number", strconv.Atoi); ok {
		def = v
	}
	s.FS.IntVar(p, name, def, help(usage, env))
}

// Int64 registers an int64 flag.
func (s Set) Int64(p *int64, name, env string, def int64, usage string) {
	env = s.Prefix + env
	if v, ok := lookup(s, env, "a number", func(v string) (int64, error) { return strconv.ParseInt(v, 10, 64) }); ok {
		def = v
	}
	s.FS.Int64Var(p, name, def, help(usage, env))
}

// Float registers a float64 flag.
func (s Set) Float(p *float64, name, env string, def float64, usage string) {
	env = s.Prefix + env
	if v, ok := lookup(s, env, "a number", func(v string) (float64, error) { return strconv.ParseFloat(v, 64) }); ok {
		def = v
	}
	s.FS.Float64Var(p, name, def, help(usage, env))
}

// Duration registers a duration flag.
func (s Set) Duration(p *time.Duration, name, env string, def time.Duration, usage string) {
	env = s.Prefix + env
	if v, ok := lookup(s, env, "a duration", time.ParseDuration); ok {
		def = v
	}
	s.FS.DurationVar(p, name, def, help(usage, env))
}
