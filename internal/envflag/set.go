package envflag

import (
	"flag"
	"time"
)

// Set registers flags on FS whose variables share a prefix, for a tool
// whose every variable starts alike: -nodes reads $MILLRACE_FLEETSIM_NODES
// with Prefix "MILLRACE_FLEETSIM_". Its methods are the package's
// functions with env after the prefix.
type Set struct {
	FS     *flag.FlagSet
	Prefix string
}

// String registers a string flag.
func (s Set) String(p *string, name, env, def, usage string) {
	String(s.FS, p, name, s.Prefix+env, def, usage)
}

// List registers a comma-separated list.
func (s Set) List(p *[]string, name, env, def, usage string) {
	List(s.FS, p, name, s.Prefix+env, def, usage)
}

// Bool registers a boolean flag, false unless the variable says otherwise.
func (s Set) Bool(p *bool, name, env, usage string) {
	Bool(s.FS, p, name, s.Prefix+env, false, usage)
}

// Int registers an int flag that may not be negative.
func (s Set) Int(p *int, name, env string, def int, usage string) {
	Int(s.FS, p, name, s.Prefix+env, def, usage)
}

// SignedInt registers an int flag that may be negative.
func (s Set) SignedInt(p *int, name, env string, def int, usage string) {
	SignedInt(s.FS, p, name, s.Prefix+env, def, usage)
}

// Int64 registers an int64 flag that may not be negative.
func (s Set) Int64(p *int64, name, env string, def int64, usage string) {
	Int64(s.FS, p, name, s.Prefix+env, def, usage)
}

// Float registers a float64 flag that may not be negative.
func (s Set) Float(p *float64, name, env string, def float64, usage string) {
	Float(s.FS, p, name, s.Prefix+env, def, usage)
}

// Duration registers a duration flag that may not be negative.
func (s Set) Duration(p *time.Duration, name, env string, def time.Duration, usage string) {
	Duration(s.FS, p, name, s.Prefix+env, def, usage)
}

// SignedDuration registers a duration flag that may be negative.
func (s Set) SignedDuration(p *time.Duration, name, env string, def time.Duration, usage string) {
	SignedDuration(s.FS, p, name, s.Prefix+env, def, usage)
}

// Var registers v, a flag of its own type.
func (s Set) Var(v flag.Value, name, env, usage string) {
	Var(s.FS, v, name, s.Prefix+env, usage)
}

// Func registers a flag parsed by set.
func (s Set) Func(name, env, usage string, set func(string) error) {
	Func(s.FS, name, s.Prefix+env, usage, set)
}
