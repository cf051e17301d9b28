package envflag

import (
	"errors"
	"flag"
	"strings"
	"testing"
	"time"
)

func TestEnvSetsDefaults(t *testing.T) {
	t.Setenv("T_N", "7")
	t.Setenv("T_L", "a, b,,c")
	t.Setenv("T_B", "true")
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	s := Set{FS: fs, Prefix: "T_"}
	var (
		n int
		d time.Duration
		l []string
		b bool
		x string
	)
	s.Int(&n, "n", "N", 1, "n")
	s.Duration(&d, "d", "D", time.Second, "d")
	s.List(&l, "l", "L", "", "l")
	s.Bool(&b, "b", "B", "b")
	s.String(&x, "x", "X", "def", "x")
	if err := fs.Parse(nil); err != nil {
		t.Fatal(err)
	}
	if err := Errors(fs); err != nil {
		t.Fatal(err)
	}
	if n != 7 || d != time.Second || len(l) != 3 || l[2] != "c" || !b || x != "def" {
		t.Fatalf("n %d, d %s, l %q, b %v, x %q", n, d, l, b, x)
	}
	if err := fs.Parse([]string{"-n", "9", "-l", "z"}); err != nil || n != 9 || len(l) != 1 {
		t.Fatalf("flags over the environment: n %d, l %q, %v", n, l, err)
	}
	if !strings.Contains(fs.Lookup("n").Usage, "[$T_N]") {
		t.Fatalf("the help does not name the variable: %q", fs.Lookup("n").Usage)
	}
}

// A variable that does not parse is an error naming it and its value, for
// every kind of flag; the flag keeps its default meanwhile.
func TestBadVariables(t *testing.T) {
	for _, c := range []struct {
		val      string
		register func(fs *flag.FlagSet)
	}{
		{"1k", func(fs *flag.FlagSet) { var p int; Int(fs, &p, "f", "T_BAD", 1, "") }},
		{"1.5", func(fs *flag.FlagSet) { var p int64; Int64(fs, &p, "f", "T_BAD", 1, "") }},
		{"fast", func(fs *flag.FlagSet) { var p float64; Float(fs, &p, "f", "T_BAD", 1, "") }},
		{"250", func(fs *flag.FlagSet) { var p time.Duration; Duration(fs, &p, "f", "T_BAD", 1, "") }},
		{"yes", func(fs *flag.FlagSet) { var p bool; Bool(fs, &p, "f", "T_BAD", false, "") }},
		{"4MB", func(fs *flag.FlagSet) { var p int; Size(fs, &p, "f", "T_BAD", 1, "") }},
		{"x", func(fs *flag.FlagSet) {
			Func(fs, "f", "T_BAD", "", func(s string) error { return errors.New("never") })
		}},
	} {
		t.Run(c.val, func(t *testing.T) {
			t.Setenv("T_BAD", c.val)
			fs := flag.NewFlagSet("t", flag.ContinueOnError)
			c.register(fs)
			if err := fs.Parse(nil); err != nil {
				t.Fatal(err)
			}
			err := Errors(fs)
			if err == nil || !strings.Contains(err.Error(), "$T_BAD") || !strings.Contains(err.Error(), c.val) {
				t.Fatalf("T_BAD=%s: %v; want an error naming the variable and its value", c.val, err)
			}
		})
	}
}

// A negative count or duration is refused, from the variable or the command
// line; the signed kinds take it.
func TestNegativeValues(t *testing.T) {
	t.Setenv("T_N", "-3")
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var (
		n, signed int
		d, sd     time.Duration
		f         float64
	)
	Int(fs, &n, "n", "T_N", 1, "")
	Duration(fs, &d, "d", "T_D", time.Second, "")
	Float(fs, &f, "f", "T_F", 1, "")
	SignedInt(fs, &signed, "s", "T_S", 1, "")
	SignedDuration(fs, &sd, "sd", "T_SD", time.Second, "")
	if err := fs.Parse([]string{"-d", "-1s", "-s", "-1", "-sd", "-2s"}); err != nil {
		t.Fatal(err)
	}
	err := Errors(fs)
	if err == nil || !strings.Contains(err.Error(), "--n ($T_N) is -3") || !strings.Contains(err.Error(), "--d ($T_D) is -1s") {
		t.Fatalf("negative -n and -d: %v", err)
	}
	if strings.Contains(err.Error(), "--s ") || strings.Contains(err.Error(), "--sd ") || strings.Contains(err.Error(), "--f ") {
		t.Fatalf("a flag that may be negative, or is not, was refused: %v", err)
	}
	if err := fs.Parse([]string{"-n", "0", "-d", "0s"}); err != nil {
		t.Fatal(err)
	}
	if err := Errors(fs); err != nil {
		t.Fatalf("zero values: %v", err)
	}
}

func TestParseMemoryLimit(t *testing.T) {
	for in, want := range map[string]int64{
		"off": 0, "0": 0, "960MiB": 960 << 20, "1GiB": 1 << 30, "512KiB": 512 << 10, "4096B": 4096, "123": 123, " 2TiB ": 2 << 40,
	} {
		if got, err := ParseMemoryLimit(in); err != nil || got != want {
			t.Errorf("ParseMemoryLimit(%q) = %d, %v; want %d", in, got, err, want)
		}
	}
	for _, in := range []string{"", "1GB", "-1MiB", "lots", "9999999TiB", "1.5GiB"} {
		if got, err := ParseMemoryLimit(in); err == nil {
			t.Errorf("ParseMemoryLimit(%q) = %d, want an error", in, got)
		}
	}
}

func TestSizes(t *testing.T) {
	t.Setenv("T_SIZE", "2MiB")
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	var n int
	Size(fs, &n, "size", "T_SIZE", 1, "")
	if err := Errors(fs); err != nil || n != 2<<20 {
		t.Fatalf("T_SIZE=2MiB gave %d, %v", n, err)
	}
	if err := fs.Parse([]string{"-size=512KiB"}); err != nil || n != 512<<10 {
		t.Fatalf("-size=512KiB gave %d, %v", n, err)
	}
	if err := fs.Parse([]string{"-size=1k"}); err == nil {
		t.Fatal("-size=1k was accepted")
	}
}
