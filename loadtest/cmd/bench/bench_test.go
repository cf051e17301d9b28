package main

import (
	"os"
	"testing"
)

func TestParseStat(t *testing.T) {
	// comm may hold spaces and parentheses; fields count from the last ')'.
	line := "4242 (post gres) (x)) S 1 4242 4242 0 -1 4194560 100 0 0 0 1234 567 89 10 20 0 1 0 100 0 0\n"
	got, err := parseStat([]byte(line))
	if err != nil {
		t.Fatal(err)
	}
	if got.comm != "post gres) (x)" || got.ppid != 1 || got.utime != 1234 || got.stime != 567 || got.cutime != 89 || got.cstime != 10 {
		t.Fatalf("parsed %+v", got)
	}
	self, err := readCPU(os.Getpid())
	if err != nil || self.comm == "" {
		t.Fatalf("own /proc stat: %+v, %v", self, err)
	}
}

func TestPromQuantile(t *testing.T) {
	s := promSample{
		`h_bucket{le="0.001"}`: 50,
		`h_bucket{le="0.002"}`: 98,
		`h_bucket{le="0.004"}`: 100,
		`h_bucket{le="+Inf"}`:  100,
		`c{step="a"}`:          3,
		`c{step="b"}`:          4,
	}
	if q := s.quantileMS("h", 0.5); q != 1 {
		t.Errorf("p50 = %v ms, want 1", q)
	}
	if q := s.quantileMS("h", 0.99); q != 4 {
		t.Errorf("p99 = %v ms, want 4", q)
	}
	if n := s.sum("c", `step="b"`); n != 4 {
		t.Errorf("sum = %v, want 4", n)
	}
}
