// Package knob holds the rule every component's Config follows, so that
// each says it the same way: a zero field takes its default, and a
// negative number or duration is an error (unless the field's comment
// gives negative a meaning, such as "never"), refused by the component's
// constructor with a message that says what to set instead. An operator
// who typed -5 meant something; taking the default silently would hide it.
//
// It imports nothing but the standard library: the agent, which runs on
// GPU nodes, uses it too.
package knob

import (
	"fmt"
	"strings"
	"time"
)

// Number is what a limit, size, rate or duration may be.
type Number interface {
	~int | ~int8 | ~int16 | ~int32 | ~int64 | ~float32 | ~float64
}

// NotNegative returns nil when v is zero or positive, else an error naming
// pkg, field and v and saying what to set: 0 for the default (def: a
// string as it is, a duration as Go writes it, a size of a field whose name
// ends in Bytes in KiB or MiB when it divides) or a positive value. A tool
// whose errors name its flags passes pkg "" and the flag as field.
func NotNegative[T Number](pkg, field string, v T, def any) error {
	if v >= 0 {
		return nil
	}
	if pkg != "" {
		field = pkg + ": " + field
	}
	return fmt.Errorf("%s %v is negative; set 0 for the default (%s) or a positive %s", field, v, show(field, def), noun(field, any(v)))
}

func noun(field string, v any) string {
	if _, ok := v.(time.Duration); ok {
		return "duration"
	}
	if strings.HasSuffix(field, "Bytes") {
		return "size"
	}
	return "number"
}

func show(field string, def any) string {
	switch d := def.(type) {
	case string:
		return d
	case time.Duration:
		return d.String()
	case int:
		if strings.HasSuffix(field, "Bytes") {
			return Bytes(int64(d))
		}
	case int32:
		if strings.HasSuffix(field, "Bytes") {
			return Bytes(int64(d))
		}
	case int64:
		if strings.HasSuffix(field, "Bytes") {
			return Bytes(d)
		}
	}
	return fmt.Sprint(def)
}

// Bytes writes n in MiB or KiB when it is a whole number of them, else in
// bytes.
func Bytes(n int64) string {
	switch {
	case n != 0 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n != 0 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d bytes", n)
}
