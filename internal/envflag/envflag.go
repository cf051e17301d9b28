// Package envflag registers command-line flags whose defaults come from
// environment variables, for millrace's commands (cmd/millrace) and its
// load tools (loadtest/fleetsim, loadtest/commitsload): the command line
// wins over the environment, the environment over the built-in default, and
// each flag's help names its variable ("... [$MILLRACE_BUILDS_BATCH]").
//
// A variable that is set but does not parse is a mistake to stop at, not
// one to run past with the default: MILLRACE_BUILDS_BATCH=1k once ran with
// 1000. Each function parses the variable as its flag would and records a
// failure against the flag set; Errors reports them, naming the variable
// and its value. A command calls Errors after parsing its flags and refuses
// to start while it reports one.
//
// Counts, sizes, rates and durations may not be negative: Int, Int64,
// Float and Duration record a check that Errors runs on the value in force
// (from the variable or the command line), so Errors must be called after
// the flags are parsed. SignedInt and SignedDuration are for the few flags
// where a negative value means something; their help says what (for
// example "-1: the brokers' default", "negative: none").
package envflag

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
)

// state is what Errors reports for one flag set.
type state struct {
	env    []error        // variables that did not parse
	checks []func() error // negative values, checked on the values in force
}

var registry = struct {
	sync.Mutex
	m map[*flag.FlagSet]*state
}{m: map[*flag.FlagSet]*state{}}

func record(fs *flag.FlagSet, f func(*state)) {
	registry.Lock()
	defer registry.Unlock()
	s := registry.m[fs]
	if s == nil {
		s = &state{}
		registry.m[fs] = s
	}
	f(s)
}

func fail(fs *flag.FlagSet, env, v, want string) {
	record(fs, func(s *state) { s.env = append(s.env, fmt.Errorf("$%s=%q is not %s", env, v, want)) })
}

// Errors is every variable of fs's flags that did not parse, and every
// flag whose value in force is negative where it may not be. Call it after
// fs.Parse.
func Errors(fs *flag.FlagSet) error {
	registry.Lock()
	s := registry.m[fs]
	registry.Unlock()
	if s == nil {
		return nil
	}
	errs := append([]error(nil), s.env...)
	for _, check := range s.checks {
		errs = append(errs, check())
	}
	return errors.Join(errs...)
}

// nonNegative makes Errors refuse a negative value of the flag.
func nonNegative[T int | int64 | float64 | time.Duration](fs *flag.FlagSet, p *T, name, env string) {
	record(fs, func(s *state) {
		s.checks = append(s.checks, func() error {
			if *p < 0 {
				return fmt.Errorf("--%s ($%s) is %v: it may not be negative", name, env, *p)
			}
			return nil
		})
	})
}

func help(text, env string) string { return fmt.Sprintf("%s [$%s]", text, env) }

// lookup parses the variable env when it is set; a value that does not
// parse is recorded as a failure and leaves def.
func lookup[T any](fs *flag.FlagSet, env string, def T, want string, parse func(string) (T, error)) T {
	v, ok := os.LookupEnv(env)
	if !ok {
		return def
	}
	x, err := parse(strings.TrimSpace(v))
	if err != nil {
		fail(fs, env, v, want)
		return def
	}
	return x
}

// String registers a string flag; the variable is taken as it is.
func String(fs *flag.FlagSet, p *string, name, env, def, usage string) {
	if v, ok := os.LookupEnv(env); ok {
		def = v
	}
	fs.StringVar(p, name, def, help(usage, env))
}

// SignedInt registers an int flag that may be negative.
func SignedInt(fs *flag.FlagSet, p *int, name, env string, def int, usage string) {
	fs.IntVar(p, name, lookup(fs, env, def, "a whole number", strconv.Atoi), help(usage, env))
}

// Int registers an int flag that may not be negative.
func Int(fs *flag.FlagSet, p *int, name, env string, def int, usage string) {
	SignedInt(fs, p, name, env, def, usage)
	nonNegative(fs, p, name, env)
}

// Int64 registers an int64 flag that may not be negative.
func Int64(fs *flag.FlagSet, p *int64, name, env string, def int64, usage string) {
	parse := func(v string) (int64, error) { return strconv.ParseInt(v, 10, 64) }
	fs.Int64Var(p, name, lookup(fs, env, def, "a whole number", parse), help(usage, env))
	nonNegative(fs, p, name, env)
}

// Float registers a float64 flag that may not be negative.
func Float(fs *flag.FlagSet, p *float64, name, env string, def float64, usage string) {
	parse := func(v string) (float64, error) { return strconv.ParseFloat(v, 64) }
	fs.Float64Var(p, name, lookup(fs, env, def, "a number", parse), help(usage, env))
	nonNegative(fs, p, name, env)
}

// SignedDuration registers a duration flag that may be negative.
func SignedDuration(fs *flag.FlagSet, p *time.Duration, name, env string, def time.Duration, usage string) {
	fs.DurationVar(p, name, lookup(fs, env, def, "a duration (a number with a unit: 300ms, 30s, 5m)", time.ParseDuration), help(usage, env))
}

// Duration registers a duration flag that may not be negative.
func Duration(fs *flag.FlagSet, p *time.Duration, name, env string, def time.Duration, usage string) {
	SignedDuration(fs, p, name, env, def, usage)
	nonNegative(fs, p, name, env)
}

// Bool registers a boolean flag.
func Bool(fs *flag.FlagSet, p *bool, name, env string, def bool, usage string) {
	fs.BoolVar(p, name, lookup(fs, env, def, "true or false", strconv.ParseBool), help(usage, env))
}

// List registers a comma-separated list (empty items dropped).
func List(fs *flag.FlagSet, p *[]string, name, env, def, usage string) {
	if v, ok := os.LookupEnv(env); ok {
		def = v
	}
	*p = SplitList(def)
	fs.Func(name, fmt.Sprintf("%s (default %q) [$%s]", usage, def, env), func(v string) error {
		*p = SplitList(v)
		return nil
	})
}

// Var registers v, a flag of its own type; when the variable is set, v is
// Set from it first (a value it refuses is recorded as a failure).
func Var(fs *flag.FlagSet, v flag.Value, name, env, usage string) {
	if s, ok := os.LookupEnv(env); ok {
		if err := v.Set(s); err != nil {
			record(fs, func(st *state) { st.env = append(st.env, fmt.Errorf("$%s=%q: %w", env, s, err)) })
		}
	}
	fs.Var(v, name, help(usage, env))
}

// Func registers a flag parsed by set, which the variable also goes
// through when it is set.
func Func(fs *flag.FlagSet, name, env, usage string, set func(string) error) {
	Var(fs, funcValue(set), name, env, usage)
}

type funcValue func(string) error

// OptionalInt registers a command-line flag (no variable: it says what to
// change, not how to run) that leaves *p nil unless it is given, so that a
// command tells "not given" from 0.
func OptionalInt(fs *flag.FlagSet, p **int, name, usage string) {
	fs.Func(name, usage, func(v string) error {
		n, err := strconv.Atoi(v)
		if err != nil {
			return fmt.Errorf("want a whole number, got %q", v)
		}
		*p = &n
		return nil
	})
}

func (f funcValue) Set(s string) error { return f(s) }
func (f funcValue) String() string     { return "" }

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

// sizeValue is a flag of a byte count, written as a number with an
// optional B, KiB, MiB, GiB or TiB suffix.
type sizeValue struct{ p *int }

func (v sizeValue) String() string {
	if v.p == nil {
		return "0"
	}
	return strconv.Itoa(*v.p)
}

func (v sizeValue) Set(s string) error {
	n, err := ParseSize(s)
	if err != nil {
		return err
	}
	*v.p = n
	return nil
}

// Size registers a byte count: 4MiB as well as 4194304 (never negative).
func Size(fs *flag.FlagSet, p *int, name, env string, def int, usage string) {
	*p = lookup(fs, env, def, "a size (a number of bytes with an optional B, KiB, MiB, GiB or TiB)", ParseSize)
	fs.Var(sizeValue{p}, name, fmt.Sprintf("%s (bytes; KiB, MiB, GiB suffixes allowed) [$%s]", usage, env))
}

// ParseSize reads a byte count like ParseMemoryLimit, without "off".
func ParseSize(s string) (int, error) {
	if strings.TrimSpace(s) == "off" {
		return 0, fmt.Errorf("%q is not a size (a number with B, KiB, MiB, GiB or TiB)", s)
	}
	n, err := ParseMemoryLimit(s)
	if err != nil {
		return 0, fmt.Errorf("%q is not a size (a number with B, KiB, MiB, GiB or TiB)", strings.TrimSpace(s))
	}
	return int(n), nil
}

// ParseMemoryLimit reads a size as GOMEMLIMIT does: a number of bytes with
// an optional B, KiB, MiB, GiB or TiB suffix; "off" or "0" is no limit
// (returned as 0).
func ParseMemoryLimit(s string) (int64, error) {
	s = strings.TrimSpace(s)
	if s == "off" || s == "0" {
		return 0, nil
	}
	mult := int64(1)
	for _, u := range []struct {
		suffix string
		mult   int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}, {"B", 1}} {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), u.mult
			break
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n < 0 || n > math.MaxInt64/mult {
		return 0, fmt.Errorf("%q is not a size (a number with B, KiB, MiB, GiB or TiB, or off)", s)
	}
	return n * mult, nil
}

// UsageError is a mistake in the command line (a flag's value, a missing
// or extra argument) rather than a failure of the work: the command prints
// its usage and exits with 2. Packages that read their own flags return it
// for a value they refuse.
type UsageError struct{ Msg string }

func (e UsageError) Error() string { return e.Msg }

// Usage is a UsageError saying msg.
func Usage(msg string) error { return UsageError{Msg: msg} }

// Usagef is a UsageError saying what format and a make.
func Usagef(format string, a ...any) error { return UsageError{Msg: fmt.Sprintf(format, a...)} }
