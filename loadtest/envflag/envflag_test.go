package envflag

import (
	"flag"
	"testing"
	"time"
)

func TestEnvSetsDefaults(t *testing.T) {
	t.Setenv("T_N", "7")
	t.Setenv("T_D", "not a duration")
	t.Setenv("T_L", "a, b,,c")
	t.Setenv("T_B", "true")
	fs := flag.NewFlagSet("t", flag.ContinueOnError)
	s := Set{FS: fs, Prefix: "T_", Who: "test"}
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
	if n != 7 || d != time.Second || len(l) != 3 || l[2] != "c" || !b || x != "def" {
		t.Fatalf("n %d, d %s, l %q, b %v, x %q", n, d, l, b, x)
	}
	if err := fs.Parse([]string{"-n", "9", "-l", "z"}); err != nil || n != 9 || len(l) != 1 {
		t.Fatalf("flags over the environment: n %d, l %q, %v", n, l, err)
	}
}
